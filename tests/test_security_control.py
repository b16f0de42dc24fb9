"""Issue 18.1 (controller side) and 18.4: what a job owner can make the control cycle do.

FakeSlurm + a real SQLite store + a FakeClock, reports built as agents build
them (tests/test_controller_loop.py). The attacker owns one job and controls
what its ranks report and its own job comment; the victim is another user's job.
"""

from __future__ import annotations

import pytest

from slurmguard.controller import assess as assess_mod
from slurmguard.controller.loop import Controller
from slurmguard.controller.plans import MAX_MICROBATCHES, OptIn, job_options
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import IncidentStatus
from tests.test_controller_loop import POLICY, feed_job, rank_report, report


def _policy(**breaker):
    return POLICY.model_copy(
        update={
            "safety": POLICY.safety.model_copy(
                update={"breaker": POLICY.safety.breaker.model_copy(update=breaker)}
            )
        }
    )


def test_ranks_claimed_from_outside_the_jobs_allocation_are_dropped(sqlite_store, fake_clock):
    """Attack (18.1): rings in the attacker's job claimed the victim's job id, with slow
    records; the attacker's node was drained and the victim requeued."""
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    victim = slurm.start_job(["node1", "node2"], user="victim")
    slurm.start_job(["node3"], user="mallory")
    now = fake_clock.now()
    feed_job(ctl, fake_clock, victim, {"node1": 1.0, "node2": 1.0}, slow_iters=0, seq=1)
    # node3 runs mallory's job only, but its report names the victim's job, one slow rank
    fake = rank_report(2, now, slow_factor=1.5, slow_iters=15, culprit=True)
    ctl.fleet.ingest(report("node3", victim, [fake], 1, now), now)
    res = ctl.cycle()
    assert res.actions == [] and res.foreign_ranks == 1
    assert ctl.fleet.foreign_ranks == 1
    assert slurm.job(victim).restarts == 0 and not slurm.node("node3").drained
    assert res.assessments[victim].culprits == ()


def test_each_requeue_passes_the_job_action_breaker(sqlite_store, fake_clock):
    """Attack (18.1): after one drain, later requeues needed no new drain and so skipped
    the drain limit: a new victim was requeued every cycle."""
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(_policy(max_job_actions=1), sqlite_store, slurm, fake_clock)
    first = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, first, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert ("requeue", str(first)) in res.actions and slurm.node("node2").drained_by_us
    # more jobs slow on the node slurmguard already drained: no new drain is needed...
    seq = 2
    for victim_nodes in (["node2", "node3"], ["node2", "node4"]):
        victim = slurm.start_job(victim_nodes)
        fake_clock.advance(5)
        feed_job(ctl, fake_clock, victim, {victim_nodes[1]: 1.0, "node2": 1.3}, slow_iters=15, seq=seq)
        seq += 1
        res = ctl.cycle()
        # ...but each requeue is checked itself: the breaker holds it and alerts
        assert ("requeue", str(victim)) not in res.actions
        assert slurm.job(victim).restarts == 0
        assert any("requeue(s)/signal(s)" in s for s in res.suppressed)
    assert len(sqlite_store.audit_entries(action="requeue")) == 1


def test_checkpoint_signal_only_for_jobs_that_asked(sqlite_store, fake_clock):
    """Issue 12.3 / 18.1: a moderate fake slowdown sent SIGUSR1 to any job's steps."""
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    plain = slurm.start_job(["node1", "node2"])
    asked = slurm.start_job(["node3", "node4"], comment="slurmguard:signal=USR2")
    for seq, iters in ((1, 10), (2, 40)):
        feed_job(ctl, fake_clock, plain, {"node1": 1.0, "node2": 1.12}, slow_iters=iters, seq=seq)
        feed_job(ctl, fake_clock, asked, {"node3": 1.0, "node4": 1.12}, slow_iters=iters, seq=seq)
        res = ctl.cycle()
        fake_clock.advance(30)
    assert ("drain", "node2") in res.actions and ("drain", "node4") in res.actions
    assert slurm.signals == [(asked, "USR2")]
    assert slurm.job(plain).state == "RUNNING" and slurm.job(plain).restarts == 0
    (inc,) = sqlite_store.incidents(job_id=str(plain))
    assert inc.status == IncidentStatus.MITIGATED and "did not ask for a checkpoint signal" in inc.outcome


def test_a_bad_comment_or_a_failing_job_does_not_stop_the_cycle(sqlite_store, fake_clock, monkeypatch):
    """Attack (18.4): `--comment=slurmguard:mitigate,microbatches=5,pp=2` raised in the
    planner inside the cycle; the controller died, and again on every restart."""
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
    bad = slurm.start_job(["node1", "node2"], comment="slurmguard:mitigate,microbatches=5,pp=2")
    good = slurm.start_job(["node3", "node4"], comment="slurmguard:mitigate,microbatches=16")
    feed_job(ctl, fake_clock, bad, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    feed_job(ctl, fake_clock, good, {"node3": 1.0, "node4": 1.3}, slow_iters=15, seq=1)
    res = ctl.cycle()
    assert res.actions == [("rebalance", str(good))] and res.errors == []
    (inc,) = sqlite_store.incidents(job_id=str(bad))
    assert inc.evidence["opt_in_problems"] == ["mitigate: microbatches=5 is not a multiple of pp=2"]
    # any other error inside one job's assessment: recorded in that job's incident, once
    real = assess_mod.assess_job

    def broken(job_id, *a, **k):
        if job_id == bad:
            raise ZeroDivisionError("boom")
        return real(job_id, *a, **k)

    monkeypatch.setattr("slurmguard.controller.loop.assess_job", broken)
    for seq in (2, 3):
        fake_clock.advance(2)
        feed_job(ctl, fake_clock, bad, {"node1": 1.0, "node2": 1.3}, slow_iters=17, seq=seq)
        feed_job(ctl, fake_clock, good, {"node3": 1.0, "node4": 1.3}, slow_iters=17, seq=seq)
        res = ctl.cycle()
        assert res.errors == [f"job {bad}: ZeroDivisionError: boom"]
        assert good in res.assessments
    (inc,) = sqlite_store.incidents(job_id=str(bad))
    assert inc.evidence["error"] == "ZeroDivisionError: boom"


@pytest.mark.parametrize(
    "comment, mitigate, signal, problem",
    [
        ("slurmguard:mitigate,microbatches=16,pp=2,signal", OptIn(16, 2), "USR1", None),
        ("slurmguard:signal=SIGTERM", None, "TERM", None),
        ("slurmguard:signal=KILL", None, None, "signal must be one of"),
        ("slurmguard:mitigate,microbatches=99999999999999", None, None, "expected an integer 1..65536"),
        (f"slurmguard:mitigate,microbatches={MAX_MICROBATCHES + 1}", None, None, "expected an integer"),
        ("slurmguard:mitigate,microbatches=8,pp=0", None, None, "pp=0: expected an integer 1..1024"),
        ("slurmguard:mitigate,microbatches=-8", None, None, "expected an integer"),
        ("slurmguard:mitigate", None, None, "needs microbatches=M"),
        ("slurmguard:rm -rf,x=1", None, None, "unknown item"),
        ("my own note slurmguard:signal", None, "USR1", None),
        ("nothing for us", None, None, None),
    ],
)
def test_opt_in_values_are_bounded_and_checked(comment, mitigate, signal, problem):
    o = job_options(comment)
    assert (o.mitigate, o.signal) == (mitigate, signal)
    if problem is None:
        assert o.problems == ()
    else:
        assert any(problem in p for p in o.problems), o.problems
