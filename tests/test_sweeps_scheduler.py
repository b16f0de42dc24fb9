"""The sweep scheduler's state machine on FakeSlurm + SQLite with a FakeClock.

Sweep jobs are "run" by the test: it starts the submitted job in FakeSlurm, writes the
result the workload would write (tests/fixtures/sweeps.py documents, known numbers) to
the path the scheduler chose, and ends the job in the state under test.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slurmguard.config import SweepPolicy, TriagePolicy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import ActionStatus, NodeState, SweepKind, TriageRung, Verdict
from slurmguard.sweeps.episode import load_episode
from slurmguard.sweeps.resultfiles import LocalResultFiles
from slurmguard.sweeps.scheduler import SweepScheduler, job_name
from tests.fixtures.sweeps import node_doc, pair_doc

CLASS = "h100"
POL = SweepPolicy(bootstrap_min_nodes=2, time_limit_min=5, start_timeout_min=3)


class Rig:
    def __init__(
        self,
        store,
        clock,
        tmp_path,
        *,
        sweeps: SweepPolicy = POL,
        triage: TriagePolicy | None = None,
        runner=None,
    ) -> None:
        self.store, self.clock = store, clock
        self.fake = FakeSlurm(clock=clock, features=(f"hwclass={CLASS}",))
        self.executor = ActionExecutor(self.fake, store)
        self.files = LocalResultFiles(tmp_path / "results")
        self.sweeps, self.triage, self.runner = sweeps, triage or TriagePolicy(), runner
        for n in self.fake.nodes():
            store.get_or_create_node(n.name, partitions=list(n.partitions))
        self.sched = self.new_scheduler()

    def new_scheduler(self) -> SweepScheduler:
        """A fresh scheduler on the same database and Slurm: a controller restart."""
        return SweepScheduler(
            self.sweeps,
            self.triage,
            self.store,
            self.fake,
            self.clock,
            self.executor,
            files=self.files,
            runner=self.runner,
        )

    def tick(self, seconds: float = 1.0):
        self.clock.advance(seconds)
        res = self.sched.tick()
        assert not res.errors, res.errors
        return res

    def drain(self, node: str, reason: str = "slurmguard: step time +12% vs peers") -> None:
        """What the controller does on the drain tier."""
        self.executor.drain(node, reason)
        self.store.transition(node, NodeState.DRAINING, f"drained: {reason}")

    def seed(self, node: str, kind: str = "both", finished: float | None = None) -> None:
        """A passed sweep of a healthy node (baseline sample, trusted reference), a day old
        by default: inside the baseline's age, outside any same-window peer window."""
        if finished is None:
            finished = self.clock.now() - 86400.0
        if kind in ("node", "both"):
            s = self.store.add_sweep(node, SweepKind.ONE_NODE, hw_class=CLASS)
            self.store.update_sweep(
                s.id,
                verdict=Verdict.PASS,
                metrics={
                    "outcome": "pass",
                    "runtime_s": 60.0,
                    "node_count": 1,
                    "result": node_doc(node, hw_class=CLASS, finished=finished),
                },
            )
        if kind in ("pair", "both"):
            ref = "node4" if node != "node4" else "node3"
            s = self.store.add_sweep(node, SweepKind.TWO_NODE, reference_node=ref, hw_class=CLASS)
            self.store.update_sweep(
                s.id,
                verdict=Verdict.PASS,
                metrics={
                    "outcome": "pass",
                    "runtime_s": 60.0,
                    "node_count": 2,
                    "result": pair_doc(node, ref, hw_class=CLASS, finished=finished),
                },
            )

    def pending(self, node: str):
        return load_episode(self.store, node).pending()

    def run_job(
        self,
        node: str,
        *,
        state: str = "COMPLETED",
        doc: dict | None = None,
        text: str | None = None,
        write: bool = True,
    ):
        """Start the node's pending sweep job, write its result, end it in `state`."""
        s = self.pending(node)
        assert s is not None and s.slurm_job_id is not None
        jid = int(s.slurm_job_id)
        job = self.fake.job(jid)
        self.fake._jobs[jid] = replace(job, state="RUNNING", start_time=self.clock.now())
        self.fake._refresh_alloc()
        kind = "node" if s.kind is SweepKind.ONE_NODE else "pair"
        out, _ = self.files.paths(node, s.id, kind)
        if doc is None and text is None and state == "COMPLETED" and write:
            doc = (
                node_doc(node, hw_class=CLASS, finished=self.clock.now() + 30)
                if kind == "node"
                else pair_doc(node, s.reference_node, hw_class=CLASS, finished=self.clock.now() + 30)
            )
        if doc is not None:
            doc = {**doc, "job_id": str(jid)}
            text = json.dumps(doc)
        if text is not None:
            with open(out, "w") as fh:
                fh.write(text)
        self.clock.advance(30)
        self.fake.finish_job(jid, state)
        return s

    def calls(self, kind: str) -> list[tuple]:
        return [c for c in self.fake.calls if c[0] == kind]


@pytest.fixture
def rig(sqlite_store, fake_clock, tmp_path):
    r = Rig(sqlite_store, fake_clock, tmp_path)
    for n in ("node3", "node4"):
        r.seed(n)
    return r


def _state(rig: Rig, node: str) -> NodeState:
    return rig.store.get_node(node).state


def _to_pair_phase(rig: Rig, node: str = "node2") -> None:
    rig.drain(node)
    rig.tick()
    rig.tick()
    rig.run_job(node)
    rig.tick()  # judge: pass


def test_healthy_node_passes_both_sweeps_and_returns(rig):
    rig.drain("node2")
    rig.fake.set_comment("node2", "slurmguard: pending verification: step time +12%")
    rig.tick()
    assert _state(rig, "node2") is NodeState.QUARANTINED
    assert [r.name for r in rig.fake.reservations()] == ["slurmguard_quarantine_node2"]
    assert rig.fake.node("node2").drained_by_us  # still drained until the sweep is submitted

    rig.tick()
    n2 = rig.fake.node("node2")
    assert not n2.drained, "resumed inside the reservation for the sweep"
    s1 = rig.pending("node2")
    assert s1.kind is SweepKind.ONE_NODE and s1.slurm_job_id is not None
    job = rig.fake.job(int(s1.slurm_job_id))
    assert job.reservation == "slurmguard_quarantine_node2" and job.nodes == ("node2",)
    assert job.name == job_name(s1.id, "node2")
    script = rig.fake.scripts[job.job_id]
    assert "--reservation=slurmguard_quarantine_node2" in script and "--hw-class h100" in script

    rig.run_job("node2")
    rig.tick()
    s1 = rig.store.get_sweep(s1.id)
    assert s1.verdict is Verdict.PASS and s1.metrics["outcome"] == "pass"
    assert 30.0 <= s1.metrics["runtime_s"] <= 31.0  # measured to the tick that saw the end

    rig.tick()
    s2 = rig.pending("node2")
    assert s2.kind is SweepKind.TWO_NODE and s2.reference_node == "node3"
    resv = {r.name: r.nodes for r in rig.fake.reservations()}
    assert resv["slurmguard_sweep2_node2"] == ("node2", "node3")
    assert rig.fake.job(int(s2.slurm_job_id)).reservation == "slurmguard_sweep2_node2"

    rig.run_job("node2")
    rig.tick()  # judge
    assert rig.store.get_sweep(s2.id).verdict is Verdict.PASS
    assert [r.name for r in rig.fake.reservations()] == ["slurmguard_quarantine_node2"]
    rig.tick()  # return
    assert _state(rig, "node2") is NodeState.HEALTHY
    n2 = rig.fake.node("node2")
    assert not n2.drained and n2.comment is None and rig.fake.reservations() == []
    hist = rig.store.node_history("node2")
    assert [t.to_state.value for t in hist[-3:]] == ["draining", "quarantined", "healthy"]
    assert hist[-1].evidence["sweeps"] == [s1.id, s2.id]
    # nothing was done twice
    assert len(rig.calls("submit")) == 2 and len(rig.calls("reservation_create")) == 2
    # a quiet cluster stays quiet
    assert not rig.tick().done


def test_compute_slowdown_fails_the_node_sweep_and_enters_triage(rig):
    rig.drain("node2")
    rig.tick()
    rig.tick()
    slow = node_doc("node2", hw_class=CLASS, gemm_scale={(5, "bfloat16"): 0.82})
    rig.run_job("node2", doc=slow)
    rig.tick()
    s = rig.store.sweeps(node="node2")[-1]
    assert s.verdict is Verdict.FAIL
    assert s.failure_reason.startswith("slurmguard: sweep1 gpu5 gemm_bf16 -18% vs ")
    rig.tick()
    n2 = rig.fake.node("node2")
    assert n2.drained_by_us and n2.reason.startswith("slurmguard: sweep1 gpu5 gemm_bf16 -18%")
    assert _state(rig, "node2") is NodeState.REMEDIATION
    [a] = rig.store.triage_actions("node2")
    assert (a.rung, a.status, a.is_entry) == (TriageRung.RESWEEP, ActionStatus.PLANNED, True)
    assert rig.pending("node2") is None and len(rig.calls("submit")) == 1
    # the ladder: re-sweep -> quarantined, a new 1-node sweep in a new round
    rig.tick()
    assert _state(rig, "node2") is NodeState.QUARANTINED
    rig.tick()
    assert rig.pending("node2").kind is SweepKind.ONE_NODE and len(rig.calls("submit")) == 2


@pytest.mark.parametrize(
    "state,text,expect",
    [
        ("NODE_FAIL", None, "slurmguard: sweep1 crashed (NODE_FAIL)"),
        ("TIMEOUT", None, "slurmguard: sweep1 timed out"),
        (
            "COMPLETED",
            '{"schema": "slurmguard.sweep", "version": 1, "kind": "no',
            "slurmguard: sweep1 bad result",
        ),
        ("COMPLETED", None, "slurmguard: sweep1 no result"),
    ],
)
def test_crash_timeout_or_bad_result_is_a_fail(rig, state, text, expect):
    rig.drain("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2", state=state, text=text, write=False)
    rig.tick()
    s = rig.store.sweeps(node="node2")[-1]
    assert s.verdict is Verdict.ERROR and s.failure_reason.startswith(expect)
    rig.tick()
    assert rig.fake.node("node2").reason.startswith(expect)
    assert _state(rig, "node2") is NodeState.REMEDIATION


def test_sweep_killed_by_slurm_is_recorded_and_retried_then_fails(rig):
    """Cancelled or preempted from outside: no evidence about the node, so the sweep is
    recorded and submitted again (killed_retries = 2); a third kill fails the sweep."""
    rig.drain("node2")
    rig.tick()
    rig.tick()
    ids = []
    for state in ("CANCELLED", "PREEMPTED"):
        s = rig.run_job("node2", state=state, write=False)
        ids.append(s.id)
        rig.tick()
        got = rig.store.get_sweep(s.id)
        assert got.metrics["outcome"] == "killed" and got.metrics["job_state"] == state
        assert got.failure_reason == f"slurmguard: sweep1 killed by Slurm ({state}), retrying"
        assert _state(rig, "node2") is NodeState.QUARANTINED
        assert rig.tick(31).done and rig.pending("node2").id > s.id  # resubmitted after the back-off
    assert not any(a.is_entry for a in rig.store.triage_actions("node2"))  # no triage entry
    rig.run_job("node2", state="CANCELLED", write=False)
    rig.tick()
    assert rig.store.sweeps(node="node2")[-1].failure_reason == "slurmguard: sweep1 crashed (CANCELLED)"
    rig.tick()
    assert _state(rig, "node2") is NodeState.REMEDIATION


def test_vanished_job_with_its_own_valid_result_is_judged(rig, monkeypatch):
    from slurmguard.slurm.errors import UnknownJob

    _to_pair_phase(rig)
    rig.tick()
    s2 = rig.run_job("node2")
    real_job = rig.fake.job

    def gone(jid):
        if jid == int(s2.slurm_job_id):
            raise UnknownJob(f"unknown job {jid}")
        return real_job(jid)

    monkeypatch.setattr(rig.fake, "job", gone)
    rig.tick()
    assert rig.store.get_sweep(s2.id).verdict is Verdict.PASS  # valid result written by this job


def test_vanished_job_without_a_result_is_a_fail(rig, monkeypatch):
    from slurmguard.slurm.errors import UnknownJob

    rig.drain("node2")
    rig.tick()
    rig.tick()
    s = rig.run_job("node2", state="COMPLETED", write=False)

    def gone(jid):
        raise UnknownJob(f"unknown job {jid}")

    monkeypatch.setattr(rig.fake, "job", gone)
    rig.tick()
    got = rig.store.get_sweep(s.id)
    assert got.verdict is Verdict.ERROR and "VANISHED" in got.failure_reason


def test_link_slowdown_blames_the_node_under_test_not_the_trusted_reference(rig):
    _to_pair_phase(rig)
    rig.tick()
    s2 = rig.pending("node2")
    assert s2.reference_node == "node3"
    rig.run_job("node2", doc=pair_doc("node2", "node3", hw_class=CLASS, send_scale=0.6))
    rig.tick()
    got = rig.store.get_sweep(s2.id)
    assert got.verdict is Verdict.FAIL and got.failure_reason.startswith("slurmguard: sweep2 gpu")
    assert "send" in got.failure_reason and "-40%" in got.failure_reason
    rig.tick()
    assert rig.fake.node("node2").drained_by_us and _state(rig, "node2") is NodeState.REMEDIATION
    n3 = rig.fake.node("node3")
    assert not n3.drained and _state(rig, "node3") is NodeState.HEALTHY
    assert rig.fake.reservations() == [
        r for r in rig.fake.reservations() if r.name == "slurmguard_quarantine_node2"
    ]


def test_untrusted_reference_gives_inconclusive_and_another_reference_is_asked(rig):
    # node1 failed its own last sweep: untrusted; node3 busy, node4 busy -> node1 is the only one
    s = rig.store.add_sweep("node1", SweepKind.ONE_NODE, hw_class=CLASS)
    rig.store.update_sweep(
        s.id,
        verdict=Verdict.FAIL,
        failure_reason="slurmguard: sweep1 x",
        metrics={"outcome": "fail", "result": node_doc("node1", hw_class=CLASS, finished=900.0)},
    )
    _to_pair_phase(rig)
    j3 = rig.fake.start_job(["node3"])
    j4 = rig.fake.start_job(["node4"])
    rig.tick()
    s2 = rig.pending("node2")
    assert s2.reference_node == "node1"
    rig.run_job("node2", doc=pair_doc("node2", "node1", hw_class=CLASS, send_scale=0.6))
    rig.tick()
    got = rig.store.get_sweep(s2.id)
    assert got.metrics["outcome"] == "inconclusive" and got.verdict is Verdict.ERROR
    rig.tick()
    assert "no free healthy reference" in rig.sched.tick().steps[0].why  # node1 excluded, 3/4 busy
    rig.fake.finish_job(j3)
    rig.fake.finish_job(j4)
    rig.tick()
    assert rig.pending("node2").reference_node == "node3"
    assert _state(rig, "node2") is NodeState.QUARANTINED and not rig.fake.node("node2").drained


def test_a_busy_reference_is_never_taken(rig, monkeypatch):
    _to_pair_phase(rig)
    jobs = [rig.fake.start_job([n]) for n in ("node1", "node3", "node4")]
    for _ in range(3):
        res = rig.tick()
        assert res.steps[0].action == "wait" and "no free healthy reference" in res.steps[0].why
    assert [r.name for r in rig.fake.reservations()] == ["slurmguard_quarantine_node2"]
    rig.fake.finish_job(jobs[2])  # node4 free
    # ... but a job lands on it between the scheduler's look and its reservation
    real = rig.fake.create_reservation

    def racing(name, nodes, **kw):
        if name.startswith("slurmguard_sweep2_"):
            rig.fake.start_job([nodes[1]], name="racer")
        return real(name, nodes, **kw)

    monkeypatch.setattr(rig.fake, "create_reservation", racing)
    res = rig.tick()
    assert "became busy" in res.done[0]
    assert rig.pending("node2") is None
    assert [r.name for r in rig.fake.reservations()] == ["slurmguard_quarantine_node2"]
    assert len(rig.calls("submit")) == 1


def test_ordinary_jobs_cannot_use_the_quarantine_reservation(rig):
    """In FakeSlurm terms: the sweep job is the only one submitted into the reservation,
    and the node is resumed only after the reservation exists."""
    rig.drain("node2")
    rig.tick()
    rig.tick()
    order = [c[0] for c in rig.fake.calls if c[0] in ("reservation_create", "resume")]
    assert order == ["reservation_create", "resume"]


def test_third_triage_entry_within_seven_days_goes_straight_to_terminal(rig):
    now = rig.clock.now()
    for days_ago in (6.0, 2.0):
        rig.store.add_triage_action(
            "node2", TriageRung.RESWEEP, is_entry=True, status=ActionStatus.DONE, at=now - days_ago * 86400
        )
    rig.drain("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2", state="NODE_FAIL")
    rig.tick()
    rig.tick()
    a = rig.store.triage_actions("node2")[-1]
    assert (a.rung, a.is_entry, a.evidence["entry_count"]) == (TriageRung.TERMINAL, True, 3)
    rig.tick()
    assert _state(rig, "node2") is NodeState.TERMINAL
    n2 = rig.fake.node("node2")
    assert n2.drained_by_us and "replace" in n2.reason
    assert rig.fake.reservations() == []
    for _ in range(3):
        assert not rig.tick().done  # stays out, nothing more happens


def test_a_terminal_node_an_admin_resumed_in_slurm_is_swept_again_when_next_drained(rig):
    """An admin brought a terminal node back with `scontrol update state=resume`
    (not `slurmguard node resume`): its lifecycle follows, as an override, and
    when it is drained again it is quarantined and swept like any other node
    (before, the drain could not be recorded and the node stayed drained)."""
    rig.executor.drain("node2", "slurmguard: triage: replace")
    rig.store.transition("node2", NodeState.TERMINAL, "replace: 3 triage entries", force=True)
    assert not rig.tick().done and _state(rig, "node2") is NodeState.TERMINAL  # held out: stays
    rig.fake.resume("node2")  # the admin's scontrol resume
    done = rig.tick().done
    assert _state(rig, "node2") is NodeState.HEALTHY and any("outside slurmguard" in d for d in done)
    last = rig.store.node_history("node2")[-1]
    assert last.forced and "outside slurmguard" in last.cause
    rig.drain("node2")
    rig.tick()
    assert _state(rig, "node2") is NodeState.QUARANTINED
    rig.tick()
    assert rig.pending("node2") is not None


def test_entries_older_than_the_window_do_not_count(rig):
    now = rig.clock.now()
    for days_ago in (9.0, 8.0):
        rig.store.add_triage_action(
            "node2", TriageRung.RESWEEP, is_entry=True, status=ActionStatus.DONE, at=now - days_ago * 86400
        )
    rig.drain("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2", state="FAILED")
    rig.tick()
    rig.tick()
    assert rig.store.triage_actions("node2")[-1].rung is TriageRung.RESWEEP


class FakeRunner:
    def __init__(self, rc: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.rc = rc

    def run(self, argv, *, timeout, check=True, env=None, input=None):
        from slurmguard.runner import CommandError, CommandResult

        self.calls.append(list(argv))
        if check and self.rc:
            raise CommandError(argv, f"{argv[0]}: exit {self.rc}", returncode=self.rc, stderr="boom")
        return CommandResult(tuple(argv), self.rc, "reimage started\n", "")


def _fail_round(rig: Rig, node: str = "node2") -> None:
    """From quarantined: the 1-node sweep crashes; ends with the node in remediation."""
    rig.tick()  # submit
    rig.run_job(node, state="FAILED")
    rig.tick()  # judge
    rig.tick()  # drain + ladder
    assert _state(rig, node) is NodeState.REMEDIATION


def test_ladder_resweep_reboot_reimage_terminal(sqlite_store, fake_clock, tmp_path):
    runner = FakeRunner()
    rig = Rig(
        sqlite_store,
        fake_clock,
        tmp_path,
        runner=runner,
        triage=TriagePolicy(reimage_command=("/usr/local/sbin/reimage", "--wipe")),
    )
    rig.drain("node2")
    rig.tick()
    _fail_round(rig)
    assert rig.store.triage_actions("node2")[-1].rung is TriageRung.RESWEEP
    rig.tick()  # resweep done -> quarantined
    _fail_round(rig)
    reboot = rig.store.triage_actions("node2")[-1]
    assert reboot.rung is TriageRung.REBOOT and not reboot.is_entry
    boot0 = 1_600_000_000.0
    rig.fake._nodes["node2"] = replace(rig.fake.node("node2"), boot_time=boot0)
    rig.tick()
    assert len(rig.fake.reboots) == 1
    node, reason, nxt = rig.fake.reboots[0]
    assert (
        node == "node2" and reason.startswith("slurmguard: triage reboot: sweep1 crashed") and nxt == "resume"
    )
    # a restarted controller does not reboot again while the reboot is in flight
    rig.sched = rig.new_scheduler()
    for _ in range(2):
        rig.tick()
    assert len(rig.fake.reboots) == 1 and _state(rig, "node2") is NodeState.REMEDIATION
    # Slurm: rebooted (new boot time, flags cleared, next state resume)
    n2 = rig.fake.node("node2")
    rig.fake._nodes["node2"] = replace(
        n2, boot_time=boot0 + 500, flags=n2.flags - {"REBOOT_REQUESTED", "DRAIN"}, reason=None
    )
    rig.tick()
    assert _state(rig, "node2") is NodeState.QUARANTINED
    assert rig.store.triage_actions("node2")[-1].status is ActionStatus.DONE
    _fail_round(rig)
    rig.tick()  # reimage runs
    assert runner.calls == [["/usr/local/sbin/reimage", "--wipe", "node2"]]
    assert _state(rig, "node2") is NodeState.QUARANTINED
    _fail_round(rig)
    assert rig.store.triage_actions("node2")[-1].rung is TriageRung.TERMINAL
    rig.tick()
    assert _state(rig, "node2") is NodeState.TERMINAL
    assert "replace" in rig.fake.node("node2").reason
    rungs = [(a.rung.value, a.status.value) for a in rig.store.triage_actions("node2")]
    assert rungs == [("resweep", "done"), ("reboot", "done"), ("reimage", "done"), ("terminal", "done")]
    states = [t.to_state.value for t in rig.store.node_history("node2")]
    assert states == ["healthy", "draining", "quarantined"] + ["remediation", "quarantined"] * 3 + [
        "remediation",
        "terminal",
    ]


def test_reboot_that_never_completes_fails_its_rung(sqlite_store, fake_clock, tmp_path):
    rig = Rig(
        sqlite_store,
        fake_clock,
        tmp_path,
        triage=TriagePolicy(ladder=("reboot", "reimage", "terminal"), reboot_timeout_s=600),
    )
    rig.drain("node2")
    rig.tick()
    _fail_round(rig)
    rig.tick()  # reboot issued
    assert len(rig.fake.reboots) == 1
    rig.tick(300)
    assert rig.store.triage_actions("node2")[-1].status is ActionStatus.RUNNING
    rig.tick(400)
    a = rig.store.triage_actions("node2")[-1]
    assert a.status is ActionStatus.FAILED and "not completed within 600s" in a.detail
    rig.tick()  # next rung planned: reimage, skipped without a command
    rig.tick()
    a = rig.store.triage_actions("node2")[-1]
    assert (a.rung, a.status) == (TriageRung.REIMAGE, ActionStatus.SKIPPED)
    assert "reimage_command is empty" in a.detail
    rig.tick()
    rig.tick()
    assert _state(rig, "node2") is NodeState.TERMINAL


def test_reboot_dropped_by_slurm_without_new_boot_time_fails(sqlite_store, fake_clock, tmp_path):
    """Slurm 22.05 returns a node that kept answering to service after ResumeTimeout
    without a new boot time: not a reboot."""
    rig = Rig(sqlite_store, fake_clock, tmp_path, triage=TriagePolicy(ladder=("reboot", "terminal")))
    rig.fake._nodes["node2"] = replace(rig.fake.node("node2"), boot_time=1_600_000_000.0)
    rig.drain("node2")
    rig.tick()
    _fail_round(rig)
    rig.tick()
    n2 = rig.fake.node("node2")
    rig.fake._nodes["node2"] = replace(n2, flags=frozenset())
    rig.tick()
    a = rig.store.triage_actions("node2")[-1]
    assert a.status is ActionStatus.FAILED and "boot time did not change" in a.detail


def test_nodes_drained_by_others_are_never_touched(rig):
    rig.fake.admin_drain("node1", "bad DIMM, ticket 4711")
    rig.store.transition("node1", NodeState.DRAINING, "drained by the controller earlier")
    for _ in range(3):
        res = rig.tick()
    assert any(s.action == "blocked" and "not ours" in s.why for s in res.steps)
    assert _state(rig, "node1") is NodeState.DRAINING
    assert rig.fake.node("node1").reason == "bad DIMM, ticket 4711"
    assert not [c for c in rig.fake.calls if "node1" in str(c)]


def test_a_node_still_running_a_job_is_not_quarantined(rig):
    jid = rig.fake.start_job(["node2"])
    rig.drain("node2")
    for _ in range(2):
        res = rig.tick()
        assert res.steps[0].action == "wait"
    assert rig.fake.reservations() == []
    rig.fake.finish_job(jid)
    rig.tick()
    assert _state(rig, "node2") is NodeState.QUARANTINED


def test_job_that_never_starts_is_cancelled_and_retried(rig):
    rig.drain("node2")
    rig.tick()
    rig.tick()
    s = rig.pending("node2")
    rig.tick(POL.start_timeout_min * 60 + 1)
    got = rig.store.get_sweep(s.id)
    assert got.metrics["outcome"] == "not_run"
    assert rig.fake.job(int(s.slurm_job_id)).state == "CANCELLED"
    assert [e.action for e in rig.store.audit_entries(node="node2")].count("cancel") == 1
    rig.tick(31)
    assert rig.pending("node2").id != s.id


def test_suspected_node_without_any_reference_is_held_not_returned(sqlite_store, fake_clock, tmp_path):
    # no seeds, no floor for the model, no peer sweeps: nothing can vouch for the node
    pol = POL.model_copy(update={"floors": (), "peer_sweeps": False, "bootstrap_min_nodes": 3})
    rig = Rig(sqlite_store, fake_clock, tmp_path, sweeps=pol)
    rig.drain("node2")
    rig.tick()
    rig.tick()
    s = rig.pending("node2")
    rig.run_job("node2")
    rig.tick()
    assert rig.store.get_sweep(s.id).metrics["outcome"] == "insufficient_baseline"
    rig.tick()
    n2 = rig.fake.node("node2")
    assert n2.drained_by_us and "no reference: class 0/3, peers 0/2, no floor" in n2.reason
    assert _state(rig, "node2") is NodeState.QUARANTINED
    # healthy nodes swept within the window become its reference: judged again, not re-swept
    rig.seed("node3", finished=fake_clock.now() - 60)
    rig.seed("node4", finished=fake_clock.now() - 60)
    res = rig.tick()
    assert any("judged again as sweep" in d and ": pass:" in d for d in res.done), res.done
    held, got = rig.store.sweeps(node="node2")[-2:]
    assert held.id == s.id and held.metrics["outcome"] == "insufficient_baseline"  # history kept
    assert got.metrics["rejudge_of"] == s.id and got.slurm_job_id == held.slurm_job_id
    assert got.metrics["basis"] == "peers" and got.metrics["basis_nodes"] == ["node3", "node4"]
    assert "same-window peers (node3,node4)" in got.metrics["reference_text"]
    assert rig.pending("node2") is None or rig.pending("node2").kind is SweepKind.TWO_NODE


def test_rolling_sweep_bootstraps_an_empty_class_and_respects_its_rate(sqlite_store, fake_clock, tmp_path):
    pol = SweepPolicy(bootstrap_min_nodes=2, rolling_enabled=True, rolling_nodes_per_hour=2.0, floors=())
    rig = Rig(sqlite_store, fake_clock, tmp_path, sweeps=pol)
    rig.fake.start_job(["node2", "node3", "node4"])
    res = rig.tick()
    assert res.done == ["node1: rolling sweep started"]
    assert _state(rig, "node1") is NodeState.QUARANTINED and not rig.fake.node("node1").drained
    rig.tick()
    rig.run_job("node1")
    rig.tick()
    assert rig.store.sweeps(node="node1")[-1].metrics["outcome"] == "bootstrap"
    # pair: every other node is busy; it waits, it does not take one
    assert rig.tick().steps[0].action == "wait"
    rig.fake.finish_job(rig.fake.jobs()[0].job_id)
    rig.tick()
    rig.run_job("node1")
    rig.tick()
    rig.tick()
    assert _state(rig, "node1") is NodeState.HEALTHY
    assert not rig.fake.node("node1").drained and rig.fake.reservations() == []
    # 2 per hour: nothing for half an hour after the last start
    rig.tick(60)
    assert all(s.action != "start_rolling" for s in rig.sched.tick().steps)
    rig.tick(1800)
    assert _state(rig, "node2") is NodeState.QUARANTINED  # the never-swept node comes next


def test_dry_run_changes_nothing(sqlite_store, fake_clock, tmp_path):
    rig = Rig(sqlite_store, fake_clock, tmp_path)
    rig.drain("node2")
    rig.executor.dry_run = True
    res = rig.tick()
    assert [s.action for s in res.steps] == ["quarantine"] and not res.done
    assert rig.fake.reservations() == [] and _state(rig, "node2") is NodeState.DRAINING


def test_results_and_verdicts_survive_a_restart(rig):
    _to_pair_phase(rig)
    rig.tick()
    rig.sched = rig.new_scheduler()
    rig.run_job("node2")
    rig.tick()
    rig.sched = rig.new_scheduler()
    rig.tick()
    assert _state(rig, "node2") is NodeState.HEALTHY
    sweeps = rig.store.sweeps(node="node2")
    assert [(s.kind.value, s.verdict.value) for s in sweeps] == [("1node", "pass"), ("2node", "pass")]
    assert sweeps[1].metrics["result"]["reference"] == "node3"


def test_cold_start_sweeps_an_idle_peer_and_judges_drained_nodes_against_it(
    sqlite_store, fake_clock, tmp_path
):
    """Fresh database: two drained nodes are judged against a healthy idle peer the
    scheduler sweeps itself in the same window (not by the loose H100 floor while a peer
    can still be swept); the busy node is never taken; the slow one fails 'vs peers', the
    healthy one returns."""
    pol = POL.model_copy(update={"bootstrap_min_nodes": 3, "peer_min_nodes": 1})
    rig = Rig(sqlite_store, fake_clock, tmp_path, sweeps=pol)
    busy = rig.fake.start_job(["node4"])
    rig.drain("node2")
    rig.drain("node3")
    res = rig.tick()
    assert "node1: peer sweep started" in res.done  # node4 is busy: never a busy node
    assert _state(rig, "node4") is NodeState.HEALTHY
    ep1 = load_episode(rig.store, "node1")
    assert ep1.rolling and not ep1.suspected
    rig.tick()  # 1-node sweeps of node1 (peer), node2, node3
    now = fake_clock.now()
    rig.run_job("node2")
    rig.run_job(
        "node3",
        doc=node_doc(
            "node3", hw_class=CLASS, finished=now + 30, gemm_scale={(i, "float32"): 0.3 for i in range(8)}
        ),
    )
    rig.tick()  # both judged: no reference yet -> held
    assert [rig.store.sweeps(node=n)[-1].metrics["outcome"] for n in ("node2", "node3")] == [
        "insufficient_baseline"
    ] * 2
    assert all("peer sweep started" not in d for d in rig.tick().done)  # one peer at a time
    rig.run_job("node1")
    rig.tick()  # peer judged (against the H100 floor); node2/node3 judged again vs the peer
    assert rig.store.sweeps(node="node1")[-1].metrics["basis"] == "floor"
    v2, v3 = rig.store.sweeps(node="node2")[-1], rig.store.sweeps(node="node3")[-1]
    assert v2.metrics["outcome"] == "pass" and v2.metrics["basis"] == "peers", v2.metrics["reason"]
    assert v2.metrics["basis_nodes"] == ["node1"]
    assert v3.metrics["outcome"] == "fail" and v3.failure_reason.startswith("slurmguard: sweep1 gpu")
    assert "gemm_fp32 -70% vs peers" in v3.failure_reason
    rig.tick()
    assert _state(rig, "node3") is NodeState.REMEDIATION
    assert "vs peers" in rig.fake.node("node3").reason
    # the triage report says which reference the verdict used
    from click.testing import CliRunner

    from slurmguard.cli import cli

    out = CliRunner().invoke(
        cli,
        [
            "--db",
            str(rig.store.engine.url),
            "triage",
            "report",
            "--node",
            "node3",
            "--offline",
            "--format",
            "json",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "[judged vs same-window peers (node1), judged again from sweep 3]" in out.output
    assert "gemm_fp32 -70% vs peers" in out.output
    # a suspected node's failed sweep never vouches for anything; node3 sweeps again (ladder)
    # node2 goes on to its 2-node sweep once a reference is free (and is judged vs the
    # peer's own 2-node sweep, also in the window)
    rig.fake.finish_job(busy)
    for _ in range(12):
        rig.tick()
        s = rig.pending("node1")
        if s is not None and s.slurm_job_id is not None:
            rig.run_job("node1")
        s = rig.pending("node2")
        if s is not None and s.slurm_job_id is not None:
            rig.run_job("node2")
        if _state(rig, "node2") is NodeState.HEALTHY:
            break
    assert _state(rig, "node1") is NodeState.HEALTHY and _state(rig, "node2") is NodeState.HEALTHY
    pair = rig.store.sweeps(node="node2", kind=SweepKind.TWO_NODE)[-1]
    assert pair.metrics["outcome"] == "pass" and pair.metrics["basis"] in ("peers", "none"), pair.metrics


def test_no_peer_can_be_swept_the_model_floor_judges(sqlite_store, fake_clock, tmp_path):
    """Every other node busy, nothing in the database: no peer can come, so the policy's
    H100 floor judges the drained node (and says so), instead of holding it for good."""
    rig = Rig(sqlite_store, fake_clock, tmp_path, sweeps=POL.model_copy(update={"bootstrap_min_nodes": 3}))
    rig.fake.start_job(["node1", "node3", "node4"])
    rig.drain("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2")
    res = rig.tick()
    assert not any("peer sweep started" in d for d in res.done)
    s = rig.store.sweeps(node="node2")[-1]
    assert s.metrics["outcome"] == "pass" and s.metrics["basis"] == "floor", s.metrics["reason"]
    assert s.metrics["reason"] == "slurmguard: sweep1 pass vs floor"
    assert s.metrics["reference_text"] == "policy floor (NVIDIA H100 80GB HBM3)"
