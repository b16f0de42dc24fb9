"""The controller cycle on FakeSlurm + a real SQLite store + a FakeClock.

Reports are built the way an agent builds them (rolling windows of step and
collective times per rank); each case has a known answer.
"""

from __future__ import annotations

import logging

import pytest

from slurmguard.config import parse_policy
from slurmguard.controller.daemon import say_held_back
from slurmguard.controller.loop import Controller
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import IncidentStatus, NodeState
from slurmguard.wire import AgentReport, JobReport, RankReport, StepSample, TelemetryRecord

POLICY = parse_policy("""
response:
  tiers: {moderate_slowdown: 0.10, severe_slowdown: 0.20, sustained_s: 20, stall_s: 60}
  escalation: {drain_checkpoint_gpu_s: 2.0, requeue_gpu_s: 4.0}
safety:
  breaker: {max_nodes: 2, max_partition_percent: 50, window_s: 3600}
detection:
  peers: {window_s: 10, consecutive_windows: 2, min_peers: 4}
""")


def rank_report(
    rank: int, now: float, *, base=1.0, slow_factor=1.0, slow_iters=0, culprit=False, n=60, comm=0.2
) -> RankReport:
    """n iterations ending at `now`; the last slow_iters are slowed by slow_factor.

    The culprit rank computes longer; its peers wait the difference inside the collective.
    """
    steps, t = [], now - n * base * slow_factor
    for i in range(n):
        slow = i >= n - slow_iters
        step = base * (slow_factor if slow else 1.0)
        compute = base - comm
        if slow:
            extra = step - base
            c = compute + extra if culprit else compute
        else:
            c = compute
        t += step
        steps.append(StepSample(end=t, step_s=step, comm_s=step - c))
    return RankReport(
        rank=rank,
        gpu=0,
        baseline_step_s=base,
        baseline_compute_s=base - comm,
        steps=steps,
        total_steps=n,
        last_progress=t,
    )


def report(
    node: str, job: int, ranks: list[RankReport], seq: int, now: float, telemetry: list[TelemetryRecord] = ()
) -> AgentReport:
    return AgentReport(
        node=node, seq=seq, sent_at=now, jobs=[JobReport(job_id=job, ranks=ranks)], telemetry=list(telemetry)
    )


@pytest.fixture
def env(sqlite_store, fake_clock):
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    return ctl, slurm, sqlite_store, fake_clock


def feed_job(ctl, clock, job, nodes_slow: dict[str, float], slow_iters: int, seq: int) -> None:
    now = clock.now()
    for r, (node, factor) in enumerate(nodes_slow.items()):
        rk = rank_report(
            r, now, slow_factor=max(nodes_slow.values()), slow_iters=slow_iters, culprit=factor > 1.0
        )
        ctl.fleet.ingest(report(node, job, [rk], seq, now), now)


def test_severe_slowdown_drains_culprit_only_and_requeues_once(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    a = res.assessments[job]
    assert a.slowdown == pytest.approx(0.3, abs=0.01)
    assert [c.node for c in a.culprits] == ["node2"]
    assert ("drain", "node2") in res.actions and ("requeue", str(job)) in res.actions
    n2 = slurm.node("node2")
    assert n2.drained_by_us and n2.reason.startswith("slurmguard: step +30%")
    assert "rank 1 compute" in n2.reason
    assert not slurm.node("node1").drained
    assert slurm.job(job).restarts == 1
    (inc,) = store.incidents(job_id=str(job))
    assert inc.tier == "requeue" and inc.status == IncidentStatus.MITIGATED
    assert store.get_node("node2").state == NodeState.DRAINING
    # the next cycle repeats nothing, also while node2's agent still reports the old run
    clock.advance(5)
    assert ctl.cycle().actions == []
    # the job restarts on healthy nodes: a restarted controller acts on nothing
    slurm.start_job(["node1", "node3"], job_id=job)
    clock.advance(60)
    restarted = Controller(POLICY, store, slurm, clock)
    feed_job(restarted, clock, job, {"node1": 1.0, "node3": 1.0}, slow_iters=0, seq=2)
    assert restarted.cycle().actions == []
    assert len(store.audit_entries(action="drain")) == 1
    assert len(store.audit_entries(action="requeue")) == 1


def test_killed_between_drain_and_requeue_resumes_without_duplicates(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    real_requeue = slurm.requeue

    def dies(*a, **k):  # the process dies right after the drain: requeue never happens
        raise SystemExit("killed")

    slurm.requeue = dies
    with pytest.raises(SystemExit):
        ctl.cycle()
    slurm.requeue = real_requeue
    assert slurm.node("node2").drained_by_us and slurm.job(job).restarts == 0
    restarted = Controller(POLICY, store, slurm, clock)
    clock.advance(5)
    feed_job(restarted, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=20, seq=2)
    res = restarted.cycle()
    # the requeue was written ahead and Slurm shows none: its controller (it could be
    # alive, fenced) may still have it on the way for two command timeouts
    assert res.actions == [] and any("not settled" in e for e in res.errors), res.errors
    clock.advance(2 * POLICY.slurm.command_timeout_s)
    feed_job(restarted, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=25, seq=3)
    res = restarted.cycle()
    assert res.actions == [("requeue", str(job))]
    assert len(store.audit_entries(action="drain")) == 1
    assert slurm.job(job).restarts == 1
    lost, done = store.audit_entries(action="requeue")
    assert lost.outcome == "error" and lost.error.startswith("not taken") and done.outcome == "ok"


def test_killed_between_requeue_and_its_record_closes_the_incident_without_a_second_requeue(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    real_requeue = slurm.requeue

    def requeue_then_die(*a, **k):  # Slurm requeues; the process dies before recording it
        real_requeue(*a, **k)
        raise SystemExit("killed")

    slurm.requeue = requeue_then_die
    with pytest.raises(SystemExit):
        ctl.cycle()
    slurm.requeue = real_requeue
    assert slurm.job(job).restarts == 1 and store.audit_entries(action="requeue") == []
    slurm.start_job(["node1", "node2"], job_id=job)  # restarts where it was (node2 drained later)
    restarted = Controller(POLICY, store, slurm, clock)
    clock.advance(5)
    feed_job(restarted, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=20, seq=2)
    assert restarted.cycle().actions == []
    assert slurm.job(job).restarts == 1
    (inc,) = store.incidents(job_id=str(job))
    assert inc.status == IncidentStatus.MITIGATED and inc.evidence["requeued_at"] is not None
    (row,) = store.audit_entries(action="requeue")  # recorded by the next cycle, not lost
    assert row.job_id == str(job) and row.evidence["recorded_late"] and row.evidence["incident"] == inc.id
    clock.advance(5)
    assert restarted.cycle().actions == []
    assert len(store.audit_entries(action="requeue")) == 1


def test_moderate_sustained_drains_and_signals_without_requeue(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"], comment="slurmguard:signal")
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=10, seq=1)
    res = ctl.cycle()  # onset ~11 s ago: not yet sustained (20 s)
    assert res.actions == []
    clock.advance(30)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=40, seq=2)
    res = ctl.cycle()
    assert res.actions == [("drain", "node2"), ("signal", str(job))]
    assert slurm.signals == [(job, "USR1")]
    assert slurm.job(job).restarts == 0 and slurm.job(job).state == "RUNNING"
    clock.advance(5)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=45, seq=3)
    assert ctl.cycle().actions == []


def feed_pipeline(ctl, clock, job, slow_factor: float, slow_iters: int, seq: int) -> None:
    """A 2-stage pipeline (a role each: no same-role peers); stage 1 computes
    longer by slow_factor in its last slow_iters iterations, stage 0 waits."""
    now = clock.now()
    for r, node in enumerate(("node1", "node2")):
        rk = rank_report(r, now, slow_factor=slow_factor, slow_iters=slow_iters, culprit=r == 1)
        ctl.fleet.ingest(report(node, job, [rk.model_copy(update={"role": f"stage{r}"})], seq, now), now)


def test_a_pipeline_stage_against_its_own_baseline_is_drained_once_named_for_a_while(env):
    """A stage named on its compute against its own baseline (no same-role
    peer, an excess under ALONE_SINCE_CHANGE) is acted on only once its node
    has been named for ALONE_NAMED_S, cycle after cycle; one cycle's naming,
    a spell of uneven load on a shared host, is not acted on."""
    from slurmguard.controller.assess import ALONE_NAMED_S

    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    feed_pipeline(ctl, clock, job, 1.3, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert [c.node for c in res.assessments[job].culprits] == []
    assert "node2 named for 0 s" in res.assessments[job].evidence["localisation"]
    assert res.actions == []
    # the spell ends: named no more for longer than the gap, then named again
    clock.advance(10)
    feed_pipeline(ctl, clock, job, 1.0, slow_iters=0, seq=2)
    assert ctl.cycle().actions == []
    seq = 3
    for _ in range(int(ALONE_NAMED_S / 2)):
        clock.advance(2)
        feed_pipeline(ctl, clock, job, 1.3, slow_iters=15, seq=seq)
        seq += 1
        assert ctl.cycle().actions == [], clock.now()
    clock.advance(2)
    feed_pipeline(ctl, clock, job, 1.3, slow_iters=15, seq=seq)
    res = ctl.cycle()
    assert ("drain", "node2") in res.actions and not slurm.node("node1").drained
    assert "no same-role peer" in slurm.node("node2").reason


def priced(store, clock, *, drain_gpu_s: float, requeue_gpu_s: float) -> tuple[Controller, FakeSlurm]:
    """A controller whose drain and requeue cost these prices (GPU-s, the ski-rental rule)."""
    escalation = POLICY.response.escalation.model_copy(
        update={"drain_checkpoint_gpu_s": drain_gpu_s, "requeue_gpu_s": requeue_gpu_s}
    )
    policy = POLICY.model_copy(
        update={"response": POLICY.response.model_copy(update={"escalation": escalation})}
    )
    slurm = FakeSlurm(clock=clock)
    return Controller(policy, store, slurm, clock), slurm


def test_cost_gate_waits_until_the_slowdown_has_cost_the_action(sqlite_store, fake_clock):
    ctl, slurm = priced(sqlite_store, fake_clock, drain_gpu_s=50.0, requeue_gpu_s=100.0)
    job = slurm.start_job(["node1", "node2"])
    # 30% slower on 2 GPUs: 0.6 GPU-s per 1.3 s iteration; 15 slow iterations = 9 GPU-s
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    assert ctl.cycle().actions == []
    fake_clock.advance(100)  # ~86 slow iterations: 52 GPU-s > drain price, < requeue price
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=59, seq=2)
    res = ctl.cycle()
    assert ("drain", "node2") in res.actions and not any(a == "requeue" for a, _ in res.actions)
    fake_clock.advance(60)  # ~132 slow iterations: 79 GPU-s, requeue not yet paid
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=59, seq=3)
    assert ctl.cycle().actions == []
    fake_clock.advance(60)  # ~178 slow iterations: 107 GPU-s >= 100
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=59, seq=4)
    res = ctl.cycle()
    assert res.actions == [("requeue", str(job))]


def test_drained_culprit_is_requeued_off_when_a_later_cycle_names_no_node(sqlite_store, fake_clock):
    """A severe slowdown drains its node before its cost pays a requeue; when the
    requeue is paid the cycle's localisation misses (a throttled rank's compute is
    noisy): the node the incident named and drained still holds, and the job is
    requeued off it. A node never named is not blamed by that rule."""
    ctl, slurm = priced(sqlite_store, fake_clock, drain_gpu_s=5.0, requeue_gpu_s=100.0)
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=30, seq=1)
    res = ctl.cycle()
    assert res.actions == [("drain", "node2")]
    fake_clock.advance(200)  # ~180 slow iterations: 108 GPU-s >= the requeue price
    now = fake_clock.now()
    for r, node in enumerate(("node1", "node2")):  # both ranks slow alike: no node named now
        rk = rank_report(r, now, slow_factor=1.3, slow_iters=59, culprit=False)
        ctl.fleet.ingest(report(node, job, [rk], 2, now), now)
    res = ctl.cycle()
    assert not res.assessments[job].culprits  # this cycle's localisation named nobody
    assert res.actions == [("requeue", str(job))]
    assert [e.node for e in sqlite_store.audit_entries(action="drain")] == ["node2"]
    assert not slurm.node("node1").drained


def feed_unlocalised(ctl, clock, job, nodes, seconds: float, seq: int = 1, step_s: float = 5.0) -> int:
    """Cycles every step_s for `seconds`, each after fresh reports of a job
    slowed 1.3x on every node alike (no node to blame); returns the next seq."""
    t_end = clock.now() + seconds
    while True:
        now = clock.now()
        for r, node in enumerate(nodes):
            rk = rank_report(r, now, slow_factor=1.3, slow_iters=30, culprit=False)
            ctl.fleet.ingest(report(node, job, [rk], seq, now), now)
        seq += 1
        assert ctl.cycle().actions == []
        if now >= t_end:
            return seq
        clock.advance(step_s)


def test_an_unlocalised_slowdown_is_an_incident_only_once_sustained(env):
    """A job-wide slowdown with no node named is recorded (at tier none, saying
    no node is to blame) only once it has called for a drain tier, cycle after
    cycle, for tiers.sustained_s (20 s here) and UNNAMED_HELD_S (60 s): a busy
    host slows a healthy job alike on every rank for 10-20 s at a time. A spell
    that ends first, or one broken by a gap longer than UNNAMED_GAP_S, starts
    the count again."""
    from slurmguard.controller.loop import UNNAMED_HELD_S

    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    seq = feed_unlocalised(ctl, clock, job, ("node1", "node2"), UNNAMED_HELD_S - 5.0)
    assert store.incidents(job_id=str(job)) == []
    clock.advance(30)  # the spell ended: nothing reported slow meanwhile
    seq = feed_unlocalised(ctl, clock, job, ("node1", "node2"), UNNAMED_HELD_S - 5.0, seq)
    assert store.incidents(job_id=str(job)) == []
    seq = feed_unlocalised(ctl, clock, job, ("node1", "node2"), 5.0, seq)
    (inc,) = store.incidents(job_id=str(job))
    assert inc.tier == "none" and inc.status == IncidentStatus.OPEN
    assert inc.evidence["note"] == "slowdown not localised to a node; no action"
    assert inc.evidence["culprits"] == []


def test_a_restart_not_ours_after_an_unlocalised_slowdown_does_not_pass_for_our_requeue(env):
    """A job-wide slowdown (no node named: an incident, no action), then a
    requeue by an admin, then a real fault in the new run: it is drained and
    requeued like any other (the old incident's restart count must not make
    this run's requeue look done), and the old incident is resolved."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    seq = feed_unlocalised(ctl, clock, job, ("node1", "node2"), 60.0)
    (old,) = store.incidents(job_id=str(job))
    assert old.tier == "none" and old.status == IncidentStatus.OPEN
    slurm.requeue(job)  # an admin's requeue
    slurm.start_job(["node1", "node2"], job_id=job)
    clock.advance(60)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=seq)
    res = ctl.cycle()
    assert ("drain", "node2") in res.actions and ("requeue", str(job)) in res.actions
    old, new = store.incidents(job_id=str(job))
    assert old.status == IncidentStatus.RESOLVED and "restarted before any action" in (old.outcome or "")
    assert new.tier == "requeue" and new.status == IncidentStatus.MITIGATED


def test_a_node_named_after_an_unlocalised_slowdown_is_an_incident_of_its_own(env):
    """A job-wide slowdown no node is to blame for (an incident at tier none,
    no action), then one node slows on its own: drained under a new incident
    that names it, without the old one's "not localised" note; the old one is
    resolved, saying what followed it."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    seq = feed_unlocalised(ctl, clock, job, ("node1", "node2"), 60.0)
    (old,) = store.incidents(job_id=str(job))
    assert old.tier == "none" and old.status == IncidentStatus.OPEN
    clock.advance(5)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=seq)
    res = ctl.cycle()
    assert ("drain", "node2") in res.actions
    old, new = store.incidents(job_id=str(job))
    assert old.status == IncidentStatus.RESOLVED and "named node2" in (old.outcome or "")
    assert list(new.nodes) == ["node2"] and new.tier != "none" and "note" not in new.evidence
    assert [c["node"] for c in new.evidence["culprits"]] == ["node2"]
    # the next cycles act under the new incident, not the old
    clock.advance(5)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=seq + 1)
    ctl.cycle()
    assert len(store.incidents(job_id=str(job))) == 2


def test_an_unlocalised_slowdowns_incident_is_resolved_when_its_job_ends(env):
    """A sustained job-wide slowdown (no node named: an incident at tier none,
    no action) stays open while its job runs, and is resolved once the job has ended;
    a drained and requeued job's incident keeps its status."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    other = slurm.start_job(["node3", "node4"])
    feed_job(ctl, clock, other, {"node3": 1.0, "node4": 1.3}, slow_iters=15, seq=1)
    ctl.cycle()
    clock.advance(5)
    feed_unlocalised(ctl, clock, job, ("node1", "node2"), 60.0)
    (inc,) = store.incidents(job_id=str(job))
    assert inc.tier == "none" and inc.status == IncidentStatus.OPEN
    slurm.finish_job(job)
    slurm.finish_job(other)
    clock.advance(5)
    ctl.cycle()
    (inc,) = store.incidents(job_id=str(job))
    assert inc.status == IncidentStatus.RESOLVED and "job ended" in (inc.outcome or "")
    (drained,) = store.incidents(job_id=str(other))
    assert drained.tier == "requeue" and drained.status == IncidentStatus.MITIGATED


def healthy_telemetry(node: str, now: float, temp=60.0, clock_mhz=1980.0, power=650.0) -> list:
    return [
        TelemetryRecord(signal=s, value=v, unit=u, timestamp=now - 1, gpu=g)
        for g in range(2)
        for s, v, u in (
            ("gpu_temp", temp, "C"),
            ("sm_clock", clock_mhz, "MHz"),
            ("power", power, "W"),
            ("gpu_util", 99.0, "%"),
        )
    ]


def test_telemetry_without_step_impact_only_marks_pending_verification(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2", "node3", "node4"])
    actions = []
    actions = []
    for seq in (1, 2, 3):
        clock.advance(11)
        now = clock.now()
        for r, node in enumerate(["node1", "node2", "node3", "node4"]):
            tel = (
                healthy_telemetry(node, now)
                if node != "node3"
                else healthy_telemetry(node, now, temp=80.0, clock_mhz=1380.0, power=540.0)
            )
            ctl.fleet.ingest(report(node, job, [rank_report(r, now)], seq, now, tel), now)
        actions.append(ctl.cycle().actions)
    # flagged after consecutive_windows (2) windows, commented once
    assert actions == [[], [("comment", "node3")], []]
    n3 = slurm.node("node3")
    assert n3.comment.startswith("slurmguard: pending verification: gpu0") and not n3.drained
    assert store.get_node("node3").state == NodeState.SUSPECT
    assert all(not slurm.node(n).drained for n in ("node1", "node2", "node3", "node4"))


def test_a_hot_node_of_a_two_node_job_is_compared_with_the_fleet(env):
    """Every GPU of node2 runs hot and slow-clocked; its job has 2 nodes, so
    within the job half of the devices deviate and no majority says which
    node: its nodes are scored with the rest of the fleet (nodes 3 and 4,
    idle), and node2 alone is marked."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    actions = []
    for seq in (1, 2, 3):
        clock.advance(11)
        now = clock.now()
        for node in ("node1", "node2", "node3", "node4"):
            hot = node == "node2"
            tel = (
                healthy_telemetry(node, now, temp=80.0, clock_mhz=1380.0, power=540.0)
                if hot
                else (healthy_telemetry(node, now))
            )
            ranks = [rank_report(int(node[-1]) - 1, now)] if node in ("node1", "node2") else []
            ctl.fleet.ingest(
                AgentReport(
                    node=node,
                    seq=seq,
                    sent_at=now,
                    jobs=[JobReport(job_id=job, ranks=ranks)] if ranks else [],
                    telemetry=tel,
                ),
                now,
            )
        actions.append(ctl.cycle().actions)
    assert actions == [[], [("comment", "node2")], []]
    assert not any(slurm.node(n).comment for n in ("node1", "node3", "node4"))


def test_healthy_job_no_action(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    for seq in range(1, 4):
        clock.advance(11)
        feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.0}, slow_iters=0, seq=seq)
        assert ctl.cycle().actions == []
    assert store.audit_entries() == [] and store.incidents() == []


def test_admin_drained_node_is_never_touched(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    slurm.admin_drain("node2", "RMA 7")
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert not any(a == "drain" for a, _ in res.actions)
    assert slurm.node("node2").reason == "RMA 7"
    assert any("someone else" in s for s in res.suppressed)


def test_an_action_held_back_is_logged_once_while_it_lasts(env, caplog):
    """The daemon says what it holds back (here an admin's drain), once when it
    starts and again only after it ended and came back: a drain that never
    comes is explained in the log, without a line every cycle."""
    ctl, slurm, _store, clock = env
    job = slurm.start_job(["node1", "node2"])
    slurm.admin_drain("node2", "RMA 7")
    held: set[str] = set()
    caplog.set_level(logging.WARNING, logger="slurmguard.controller.daemon")
    for seq in (1, 2):
        clock.advance(1)
        feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=seq)
        held = say_held_back(ctl.cycle().suppressed, held)
    said = [r.getMessage() for r in caplog.records if "held back" in r.getMessage()]
    assert len(said) == 1 and "node2" in said[0] and "someone else" in said[0]
    assert say_held_back([], held) == set()
    say_held_back(sorted(held), set())
    assert len([r for r in caplog.records if "held back" in r.getMessage()]) == 2


def test_breaker_at_one_node_holds_second_drain_and_alerts(sqlite_store, fake_clock):
    policy = POLICY.model_copy(
        update={
            "safety": POLICY.safety.model_copy(
                update={"breaker": POLICY.safety.breaker.model_copy(update={"max_nodes": 1})}
            )
        }
    )
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(policy, sqlite_store, slurm, fake_clock)
    j1 = slurm.start_job(["node1", "node2"])
    j2 = slurm.start_job(["node3", "node4"])
    feed_job(ctl, fake_clock, j1, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    ctl.cycle()
    assert slurm.node("node2").drained_by_us
    fake_clock.advance(5)
    feed_job(ctl, fake_clock, j2, {"node3": 1.0, "node4": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert not slurm.node("node4").drained
    assert ctl.breaker_open and any(s.startswith("circuit breaker") for s in res.suppressed)
    (alert,) = sqlite_store.audit_entries(action="alert")
    assert "circuit breaker" in alert.reason and alert.node == "node4"
    (inc,) = sqlite_store.incidents(job_id=str(j2))
    assert inc.status == IncidentStatus.SUPPRESSED


def test_dry_run_audits_but_does_not_touch_slurm(sqlite_store, fake_clock):
    policy = POLICY.model_copy(update={"safety": POLICY.safety.model_copy(update={"dry_run": True})})
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(policy, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    ctl.cycle()
    assert not slurm.node("node2").drained and slurm.job(job).restarts == 0
    assert {str(e.outcome) for e in sqlite_store.audit_entries()} == {"dry_run"}


def test_stall_names_least_progress_rank(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    # no collective completed for 100 s (stall_s is 60): a stall; rank 1 progressed least
    r0 = rank_report(0, now - 100)
    r1 = rank_report(1, now - 130)
    ctl.fleet.ingest(report("node1", job, [r0], 1, now), now)
    ctl.fleet.ingest(report("node2", job, [r1], 1, now), now)
    res = ctl.cycle()
    a = res.assessments[job]
    assert a.stalled_for_s == pytest.approx(100, abs=1)
    assert [c.node for c in a.culprits] == ["node2"]
    assert ("requeue", str(job)) in res.actions


def test_quiet_below_stall_window_is_not_a_stall(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    for r, node in enumerate(["node1", "node2"]):
        ctl.fleet.ingest(report(node, job, [rank_report(r, now - 30)], 1, now), now)
    res = ctl.cycle()
    assert res.assessments[job].stalled_for_s == 0.0 and res.actions == []


def in_flight(r: RankReport, since: float | None) -> RankReport:
    """r as a hook that says what is in flight reports it (the torch hook)."""
    return r.model_copy(update={"in_flight_known": True, "in_flight_since": since})


def quiet_cycle(
    env,
    last: tuple[float, float],
    waiting: tuple[float | None, float | None],
    io: tuple[float | None, float | None] = (None, None),
    known: bool = True,
):
    """One cycle of a 2-rank job whose hooks say what is in flight (known): rank r
    completed its last collective last[r] s ago, has waited inside one for
    waiting[r] s (None: none in flight) and was last seen busy with I/O io[r] s
    ago (None: never). Returns (job, cycle result)."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    for r, node in enumerate(["node1", "node2"]):
        since = None if waiting[r] is None else now - waiting[r]
        rk = rank_report(r, now - last[r])
        if known:
            rk = in_flight(rk, since)
        if io[r] is not None:
            rk = rk.model_copy(update={"last_io": now - io[r]})
        ctl.fleet.ingest(report(node, job, [rk], 1, now), now)
    return job, ctl.cycle()


def test_a_job_between_collectives_on_every_rank_is_quiet_not_stalled(env):
    """Every rank evaluates (or saves a checkpoint) for 200 s with no collective
    and none in flight: a quiet job, no stall, nothing done. The same silence
    from hooks that cannot say what is in flight stays a stall (above)."""
    job, res = quiet_cycle(env, (200, 200), (None, None))
    assert res.assessments[job].stalled_for_s == 0.0 and res.actions == []


def test_a_stall_counts_from_when_the_ranks_began_to_wait(env):
    """After 190 s of evaluation rank 0 entered the metrics all-reduce 10 s ago;
    rank 1 still evaluates: waited 10 s, not 190, so no stall."""
    job, res = quiet_cycle(env, (190, 190), (10, None))
    assert res.assessments[job].stalled_for_s == 0.0 and res.actions == []


def test_a_stall_names_the_rank_the_others_wait_for(env):
    """Rank 0 has waited inside a collective for 100 s; rank 1, which has no
    call in flight (frozen, or stuck outside its collectives), completed its
    last collective a little after rank 0 did: it is the one named, not the
    rank with the least progress."""
    job, res = quiet_cycle(env, (101, 100.5), (100, None))
    a = res.assessments[job]
    assert a.stalled_for_s == pytest.approx(100, abs=1)
    assert [c.node for c in a.culprits] == ["node2"]


def test_rank_0_saving_while_the_others_wait_in_a_barrier_is_not_a_stall(env):
    """Plain DDP's checkpoint: rank 0 alone has written its model for 100 s
    (busy with I/O at the agents' last look, 1 s ago) while rank 1 has waited
    in the barrier since: progress, no stall. Without the I/O it was one (the
    test above), and the job was requeued at the first long save."""
    job, res = quiet_cycle(env, (100, 100), (None, 100), io=(1, None))
    assert res.assessments[job].stalled_for_s == 0.0 and res.actions == []


def test_a_save_that_ends_in_a_hang_is_a_stall_from_its_last_io(env):
    """Rank 0 wrote until 70 s ago and has done nothing since, outside any
    collective, while rank 1 waits: stalled 70 s (stall_s 60), rank 0's node named."""
    job, res = quiet_cycle(env, (100, 100), (None, 100), io=(70, None))
    a = res.assessments[job]
    assert a.stalled_for_s == pytest.approx(70, abs=1)
    assert [c.node for c in a.culprits] == ["node1"]


def test_io_of_a_rank_inside_a_collective_is_no_progress(env):
    """A rank in flight moves bytes through its sockets (gloo reads and writes
    them): rank 0, waiting inside a collective for 100 s with I/O seen 1 s ago,
    does not hide rank 1, which is stuck outside its collectives with none."""
    job, res = quiet_cycle(env, (101, 100.5), (100, None), io=(1, None))
    a = res.assessments[job]
    assert a.stalled_for_s == pytest.approx(100, abs=1)
    assert [c.node for c in a.culprits] == ["node2"]


@pytest.mark.parametrize(("io_ago", "stalled"), [(2.0, 0.0), (90.0, 90.0)])
def test_where_hooks_cannot_say_what_is_in_flight_any_ranks_io_is_progress(env, io_ago, stalled):
    """The NCCL hook: no collective for 100 s on either rank; rank 0 busy with
    I/O 2 s ago is a save (no stall), 90 s ago a stall of 90 s."""
    job, res = quiet_cycle(env, (100, 100), (None, None), io=(io_ago, None), known=False)
    assert res.assessments[job].stalled_for_s == pytest.approx(stalled, abs=1)


def test_a_stall_names_the_stopped_rank_when_every_rank_is_in_flight(env):
    """Rank 1 was frozen (SIGSTOP) inside an all-reduce: both ranks have been
    in flight for 100 s, and rank 1 completed its last collective 0.4 ms
    *after* rank 0 (measured on the cluster: the two ends are within a
    millisecond either way). Only the agent's look at the process tells them
    apart: rank 1 is named, not rank 0 with its older last progress."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    r0 = in_flight(rank_report(0, now - 100.0004), now - 99.9)
    r1 = in_flight(rank_report(1, now - 100.0), now - 99.9).model_copy(update={"stopped": True})
    ctl.fleet.ingest(report("node1", job, [r0], 1, now), now)
    ctl.fleet.ingest(report("node2", job, [r1], 1, now), now)
    res = ctl.cycle()
    a = res.assessments[job]
    assert [c.node for c in a.culprits] == ["node2"] and "stopped" in a.culprits[0].why
    assert ("drain", "node2") in res.actions and ("drain", "node1") not in res.actions


def test_a_job_whose_every_rank_is_stopped_is_paused_not_stalled(env):
    """Every rank stopped (the job's user sent SIGSTOP to the whole job, or Slurm
    suspended it a moment before the cycle read squeue) for 100 s: paused on
    purpose, no node's fault: no stall, nothing done."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    for r, node in enumerate(["node1", "node2"]):
        rk = in_flight(rank_report(r, now - 100.0), now - 99.9).model_copy(update={"stopped": True})
        ctl.fleet.ingest(report(node, job, [rk], 1, now), now)
    res = ctl.cycle()
    a = res.assessments.get(job)
    assert (a is None or a.stalled_for_s == 0.0) and res.actions == []


def suspended_job(env, suspend_s: float, *, in_flight_known: bool) -> tuple[int, RankReport, RankReport]:
    """A 2-rank job that ran 60 iterations of 1 s, was suspended by Slurm for
    suspend_s (its ranks stopped inside the all-reduce of its 61st) and was
    resumed just now: what its agents last sent, before the resume."""
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    stopped_at = clock.now() - suspend_s
    r0, r1 = rank_report(0, stopped_at - 0.5), rank_report(1, stopped_at - 0.5)
    if in_flight_known:
        r0, r1 = in_flight(r0, stopped_at - 0.3), in_flight(r1, stopped_at - 0.2)
    slurm.suspend_job(job)
    slurm.resume_job(job)
    return job, r0, r1


@pytest.mark.parametrize("in_flight_known", [False, True], ids=["nccl-hook", "torch-hook"])
def test_a_job_resumed_after_a_long_suspension_is_not_stalled(env, in_flight_known):
    """Slurm suspended the job for 200 s (stall_s is 60); in the cycle right
    after the resume the agents' last reports still show it stopped: no stall,
    nothing done. Counted from the resume it is a stall again after 60 s."""
    ctl, slurm, store, clock = env
    job, r0, r1 = suspended_job(env, 200.0, in_flight_known=in_flight_known)
    now = clock.now()
    ctl.fleet.ingest(report("node1", job, [r0], 1, now - 0.5), now)
    ctl.fleet.ingest(report("node2", job, [r1], 1, now - 0.5), now)
    res = ctl.cycle()
    a = res.assessments.get(job)  # none: no iteration since the resume to judge, no stall
    assert (a is None or a.stalled_for_s == 0.0) and res.actions == []
    clock.advance(70.0)
    now = clock.now()
    ctl.fleet.ingest(report("node1", job, [r0], 2, now), now)
    ctl.fleet.ingest(report("node2", job, [r1], 2, now), now)
    res = ctl.cycle()
    assert res.assessments[job].stalled_for_s == pytest.approx(70, abs=1)
    assert ("requeue", str(job)) in res.actions


def test_the_iteration_spanning_a_suspension_is_not_a_slowdown(env):
    """After the resume each rank's iteration that spans the 200 s suspension
    ends, then the job runs 20 iterations at its usual 1 s: not slow, no action.
    (Judged with that iteration, the job's step level is far above baseline.)"""
    ctl, slurm, store, clock = env
    job, r0, r1 = suspended_job(env, 200.0, in_flight_known=True)
    clock.advance(20.5)
    now = clock.now()
    for node, r in (("node1", r0), ("node2", r1)):
        t = r.steps[-1].end
        steps = [*r.steps, StepSample(end=t + 200.5, step_s=200.5, comm_s=200.3)]
        steps += [StepSample(end=t + 200.5 + i, step_s=1.0, comm_s=0.2) for i in range(1, 21)]
        r = r.model_copy(update={"steps": steps, "total_steps": len(steps), "last_progress": steps[-1].end})
        ctl.fleet.ingest(report(node, job, [in_flight(r, None)], 2, now), now)
    res = ctl.cycle()
    a = res.assessments[job]
    assert a.stalled_for_s == 0.0 and abs(a.slowdown) < 0.05 and res.actions == []


def test_opted_in_job_is_rebalanced_before_any_drain(sqlite_store, fake_clock):
    policy = POLICY.model_copy(
        update={
            "response": POLICY.response.model_copy(
                update={
                    "escalation": POLICY.response.escalation.model_copy(
                        update={
                            "rebalance_gpu_s": 0.5,
                            "drain_checkpoint_gpu_s": 1000.0,
                            "requeue_gpu_s": 2000.0,
                        }
                    )
                }
            )
        }
    )
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(policy, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"], comment="slurmguard:mitigate,microbatches=16")
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert res.actions == [("rebalance", str(job))]
    plan = ctl.plans.served(job)
    # rank 1 computes 1.1 s per 8 micro-batches, rank 0 0.8 s: the slow rank gets fewer
    assert plan["microbatches"][0] > plan["microbatches"][1] and sum(plan["microbatches"]) == 16
    assert plan["version"] == 1
    assert not slurm.node("node2").drained
    fake_clock.advance(2)
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=17, seq=2)
    assert ctl.cycle().actions == []  # one plan per incident
    # a restarted controller serves the same plan from the incident's evidence
    restarted = Controller(policy, sqlite_store, slurm, fake_clock)
    feed_job(restarted, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=18, seq=3)
    restarted.cycle()
    assert restarted.plans.served(job) == plan
    (entry,) = sqlite_store.audit_entries(action="rebalance")
    assert entry.job_id == str(job)


def test_job_without_opt_in_gets_no_plan(env):
    ctl, slurm, store, clock = env
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    ctl.cycle()
    assert ctl.plans.served(job) is None


def test_pipeline_job_gets_rebalanced_then_retopologised_then_drained(sqlite_store, fake_clock):
    """Ski-rental order for an opted-in pp=2 x dp=2 job whose ranks 0 (stage 0, replica 0)
    and 3 (stage 1, replica 1) are slow: S2 cannot help (each replica has a slow stage),
    S3 consolidates both into one stage, then the drain follows at its price."""
    from slurmguard.respond.escalation import accumulated_cost_gpu_s

    policy = POLICY.model_copy(
        update={
            "response": POLICY.response.model_copy(
                update={
                    "escalation": POLICY.response.escalation.model_copy(
                        update={
                            "rebalance_gpu_s": 10.0,
                            "retopology_gpu_s": 40.0,
                            "drain_checkpoint_gpu_s": 80.0,
                            "requeue_gpu_s": 1e6,
                        }
                    )
                }
            )
        }
    )
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(policy, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(
        ["node1", "node2", "node3", "node4"], comment="slurmguard:mitigate,microbatches=16,pp=2"
    )
    paid = []

    def cycle(seq):
        now = fake_clock.now()
        for r, node in enumerate(["node1", "node2", "node3", "node4"]):
            # stage-major ranks: 0 = stage 0/replica 0, 3 = stage 1/replica 1
            rk = rank_report(r, now, slow_factor=1.3, slow_iters=20, culprit=r in (0, 3))
            ctl.fleet.ingest(report(node, job, [rk], seq, now), now)
        res = ctl.cycle()
        (inc,) = sqlite_store.incidents(job_id=str(job))
        a = res.assessments[job]
        from dataclasses import replace

        paid.append(accumulated_cost_gpu_s(replace(a, onset=inc.onset_at.timestamp()), now))
        return res.actions

    assert cycle(1) == [] and 10 <= paid[-1] < 40  # S2 due, but the uniform split is optimal
    assert ctl.plans.served(job) is None
    while paid[-1] < 40:
        fake_clock.advance(5)
        actions = cycle(len(paid) + 1)
        if paid[-1] < 40:
            assert actions == []
    assert actions == [("retopology", str(job))]
    plan = ctl.plans.served(job)
    assert plan["action"] == "retopology" and plan["version"] == 1
    # one swap moves w3 into stage 0 beside w0 (or w0 into stage 1 beside w3)
    assert len(plan["swaps"]) == 1 and ({"w0", "w3"} & set(plan["swaps"][0]))
    while paid[-1] < 80:
        fake_clock.advance(5)
        actions = cycle(len(paid) + 1)
    assert ("drain", "node1") in actions and ("drain", "node4") in actions
    assert [e.action for e in sqlite_store.audit_entries()][:2] == ["retopology", "drain"]


def test_lifecycle_refusal_is_logged_but_a_database_outage_is_the_jobs_error(env, monkeypatch, caplog):
    """_lifecycle swallows only the lifecycle's refusal (IllegalTransition), never a DB outage."""
    from slurmguard.store import DatabaseUnavailable

    ctl, slurm, store, clock = env
    store.get_or_create_node("node2")
    store.transition("node2", NodeState.QUARANTINED, "test")
    store.transition("node2", NodeState.REMEDIATION, "test")  # remediation -> draining is refused
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert ("drain", "node2") in res.actions and res.errors == []
    assert store.get_node("node2").state == NodeState.REMEDIATION
    assert "not recorded" in caplog.text

    job2 = slurm.start_job(["node3", "node4"])

    def outage(*a, **k):
        raise DatabaseUnavailable("database at sqlite:///x unreachable")

    with monkeypatch.context() as m:
        # (class-wide: the drain's record is written on a transaction's view of the store)
        m.setattr(type(store), "transition", outage)
        clock.advance(5)
        feed_job(ctl, clock, job2, {"node3": 1.0, "node4": 1.3}, slow_iters=15, seq=2)
        res = ctl.cycle()
    assert slurm.node("node4").drained_by_us and ("drain", "node4") not in res.actions
    assert [e for e in res.errors if e.startswith(f"job {job2}: DatabaseUnavailable")], res.errors
    # the drain and its lifecycle record went together or not at all: written by the next cycle
    assert [e.node for e in store.audit_entries(action="drain")] == ["node2"]
    assert store.get_node("node4").state == NodeState.HEALTHY
    clock.advance(5)
    feed_job(ctl, clock, job2, {"node3": 1.0, "node4": 1.3}, slow_iters=20, seq=3)
    ctl.cycle()
    late = store.audit_entries(action="drain")[-1]
    assert (
        late.node == "node4"
        and late.evidence["recorded_late"]
        and len(store.audit_entries(action="drain")) == 2
    )
    assert store.get_node("node4").state == NodeState.DRAINING


def test_only_a_slow_or_watched_jobs_report_wakes_the_cycle(env):
    """Controller.wants_cycle: a healthy report waits for the next cycle; one whose
    rank ran its newest NEWEST_SLOWER_STEPS (3) iterations past the moderate bar wakes it, and
    so does any report of a job the last cycle found slow, until a cycle finds it
    healthy again."""
    ctl, slurm, _, clock = env
    job = slurm.start_job(["node1", "node2"])
    now = clock.now()
    healthy = report("node1", job, [rank_report(0, now)], 1, now)
    assert not ctl.wants_cycle(healthy)
    # two slow iterations (one outlier more) are not yet a sign; three are
    two = report("node2", job, [rank_report(1, now, slow_factor=1.3, slow_iters=2, culprit=True)], 1, now)
    three = report("node2", job, [rank_report(1, now, slow_factor=1.3, slow_iters=3, culprit=True)], 1, now)
    assert not ctl.wants_cycle(two)
    assert ctl.wants_cycle(three)
    # 9% slower, under the moderate tier's 10%: nothing to judge early
    mild = report("node2", job, [rank_report(1, now, slow_factor=1.09, slow_iters=10, culprit=True)], 1, now)
    assert not ctl.wants_cycle(mild)
    # the packed wire form reads the same
    from slurmguard.wire import StepWindow, decode_report, encode_report

    packed = decode_report(encode_report(three))
    assert isinstance(packed.jobs[0].ranks[0].steps, StepWindow)
    assert ctl.wants_cycle(packed)
    # a cycle that found the job slow (but had not yet named it long enough to act)
    # watches it: even a report whose newest iterations look fine wakes the next
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=12, seq=1)
    ctl.cycle()
    assert job in ctl.watched
    assert ctl.wants_cycle(healthy)
    clock.advance(120)
    feed_job(ctl, clock, job, {"node1": 1.0, "node2": 1.0}, slow_iters=0, seq=2)
    ctl.cycle()
    assert job not in ctl.watched
    assert not ctl.wants_cycle(report("node1", job, [rank_report(0, clock.now())], 3, clock.now()))


def test_the_cycle_waits_its_interval_from_its_start_unless_woken(fake_clock):
    """daemon.wait_for_cycle: the interval runs from the cycle's start (a 0.3 s
    cycle does not stretch a 1 s period to 1.3 s); a wake ends the wait early,
    but not before WAKE_GAP_FRACTION of the interval nor before the cycle's own
    duration again has passed; a stop ends it at once."""
    import threading
    import time

    from slurmguard.controller.daemon import WAKE_GAP_FRACTION, wait_for_cycle

    def waited(cycle_s: float, interval_s: float, wake_after: float | None = None, stop_=False) -> float:
        stop, wake = threading.Event(), threading.Event()
        began = fake_clock.monotonic()
        fake_clock.advance(cycle_s)
        if stop_:
            stop.set()
        timer = threading.Timer(wake_after, wake.set) if wake_after is not None else None
        t0 = time.monotonic()
        if timer is not None:
            timer.start()
        wait_for_cycle(fake_clock, stop, wake, began, interval_s)
        assert not wake.is_set()  # a wake is used once
        return time.monotonic() - t0

    # margins for a loaded machine; the old daemon waited the whole interval after the cycle
    assert 1.4 <= waited(1.5, 3.0) < 2.6  # 1.5 s left of the 3 s (not 3 s more)
    assert waited(3.5, 3.0) < 0.4  # longer than its interval: the next follows at once
    assert 0.9 <= waited(0.0, 4.0, wake_after=1.0) < 2.5  # woken: not the whole 4 s
    # woken at once after a short cycle: no sooner than the gap (0.8 s of 4)
    assert WAKE_GAP_FRACTION * 4.0 - 0.05 <= waited(0.0, 4.0, wake_after=0.0) < 2.0
    # woken at once after a cycle of 1 s: not before as long again
    assert 0.95 <= waited(1.0, 4.0, wake_after=0.0) < 2.5
    assert waited(0.0, 5.0, stop_=True) < 0.4


def test_a_controller_whose_port_is_taken_says_so_in_one_line(tmp_path):
    """An admin's second controller on a port in use (or a stale one still
    running) is a one-line error naming the address and the keys, exit 2."""
    import os
    import socket
    import subprocess
    import sys

    env = {**os.environ, "SLURMGUARD_DB": f"sqlite:///{tmp_path}/sg.db"}
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    secret.chmod(0o600)
    cli = [sys.executable, "-m", "slurmguard.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=env, capture_output=True, check=True, timeout=120)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        res = subprocess.run(
            [*cli, "controller", "--once", "--listen", f"127.0.0.1:{port}", "--secret-file", str(secret)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("slurmguard: error:")]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line and "--listen" in line
