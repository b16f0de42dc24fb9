"""The sweep scheduler on the real local Slurm cluster, with short CPU sweeps.

One module-wide database is seeded by a rolling sweep of node1 (an unsuspected node:
bootstrap sample of the class baseline and a trusted reference). Faults are injected
by the development tools' launcher as the sweep interpreter (sweeps.python), reading inject.json.
CPU timings on a shared 2-core machine are noisy, so the test policy uses a wide
tolerance (85%) and injects large faults (95%).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slurmguard.clock import SystemClock
from slurmguard.config import SweepPolicy, TriagePolicy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.slurm.commands import CommandSlurmClient
from slurmguard.store import (
    ActionStatus,
    NodeState,
    Store,
    SweepKind,
    TriageRung,
    Verdict,
    db,
)
from slurmguard.sweeps.episode import AFTER_SWEEP, LAST_SWEEP, load_episode
from slurmguard.sweeps.scheduler import SweepScheduler
from slurmguard_dev.sweepfaults import launcher

pytestmark = pytest.mark.slurm


def sweep_policy(tmp: Path, **kw) -> SweepPolicy:
    base = {
        "device": "cpu",
        "gemm_duration_s": 0.5,
        "gemm_dtypes": ("float32",),
        "gemm_size": 96,
        "membw_bytes": 2 << 20,
        "message_sizes_mb": (4,),
        "repeats": 5,
        "comm_timeout_s": 60.0,
        "time_limit_min": 3,
        "start_timeout_min": 2,
        "pass_tolerance": 0.85,
        "bootstrap_min_nodes": 1,
        "master_addr": "127.0.0.1",
        "workload_args": ("--threads", "1"),
        "python": str(launcher(tmp / "python-faults", tmp / "inject.json")),
        "result_dir": str(tmp / "results"),
    }
    return SweepPolicy(**(base | kw))


class Env:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.url = f"sqlite:///{tmp / 'sg.db'}"
        db.upgrade(self.url)
        self.clock = SystemClock()
        self.slurm = CommandSlurmClient(env=cluster.env, timeout_s=30)
        self.inject({})
        self.open()

    def open(self, sweeps: SweepPolicy | None = None, triage: TriagePolicy | None = None) -> None:
        """(Re)start the 'controller': a new Store and scheduler on the same database."""
        self.store = Store.open(self.url, self.clock)
        self.executor = ActionExecutor(self.slurm, self.store)
        self.sched = SweepScheduler(
            sweeps or sweep_policy(self.tmp),
            triage or TriagePolicy(),
            self.store,
            self.slurm,
            self.clock,
            self.executor,
        )

    def inject(self, faults: dict) -> None:
        (self.tmp / "inject.json").write_text(json.dumps(faults))

    def tick(self):
        res = self.sched.tick()
        assert not res.errors, res.errors
        return res

    def until(self, pred, timeout: float = 150.0, every: float = 0.5, what: str = "") -> list:
        results = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            results.append(self.tick())
            if pred():
                return results
            time.sleep(every)
        steps = [s for r in results[-3:] for s in r.steps]
        raise AssertionError(f"timed out waiting for {what}: last steps {steps}")

    def state(self, node: str) -> NodeState:
        return self.store.get_node(node).state

    def drain(self, node: str, reason: str = "slurmguard: step time +14% vs peers") -> None:
        """What the controller does on the drain tier (audited drain + lifecycle)."""
        self.reset(node)
        self.executor.drain(node, reason)
        self.store.transition(node, NodeState.DRAINING, f"drained: {reason}")

    def reset(self, node: str) -> None:
        """Admin override back to healthy (a previous test may have left the node out)."""
        rec = self.store.get_node(node)
        if rec is not None and rec.state is not NodeState.HEALTHY:
            last = max((s.id for s in self.store.sweeps(node=node)), default=0)
            self.store.transition(node, NodeState.HEALTHY, "test reset", {LAST_SWEEP: last}, force=True)

    def node(self, name: str):
        return self.slurm.node(name)

    def pending_job(self, node: str) -> tuple[int | None, str | None]:
        s = load_episode(self.store, node).pending()
        if s is None or s.slurm_job_id is None:
            return None, None
        return int(s.slurm_job_id), self.cluster.job_state(int(s.slurm_job_id))


@pytest.fixture(scope="module")
def env(devcluster, tmp_path_factory):
    """Seeded: node1 swept by a rolling sweep (bootstrap baseline, trusted reference)."""
    devcluster.wait_nodes_idle(timeout=60)
    e = Env(devcluster, tmp_path_factory.mktemp("sweepsched"))
    e.open(sweeps=sweep_policy(e.tmp, rolling_enabled=True, rolling_nodes_per_hour=3600.0))
    e.until(lambda: e.state("node1") is not NodeState.HEALTHY, what="rolling start")
    e.until(lambda: e.state("node1") is NodeState.HEALTHY, what="node1 bootstrap")
    outcomes = [(s.kind.value, s.metrics["outcome"]) for s in e.store.sweeps(node="node1")]
    assert outcomes == [("1node", "bootstrap"), ("2node", "bootstrap")], outcomes
    e.open()
    yield e
    for r in e.slurm.reservations():
        if r.name.startswith("slurmguard_"):
            devcluster.run(["scontrol", "delete", f"ReservationName={r.name}"])


@pytest.fixture
def e(env, clean_cluster):
    """Each test starts with every node healthy in the database (clean_cluster puts Slurm
    back afterwards) and a fresh scheduler, so tests do not advance each other's nodes."""
    for n in clean_cluster.node_names:
        env.reset(n)
    env.inject({})
    env.open()
    return env


def _resv(e: Env) -> dict[str, tuple[str, ...]]:
    return {r.name: r.nodes for r in e.slurm.reservations()}


def test_healthy_node_passes_both_sweeps_and_returns_to_its_partition(e, clean_cluster):
    e.inject({})
    e.drain("node2")
    e.until(lambda: e.state("node2") is NodeState.QUARANTINED, what="quarantine")
    assert "slurmguard_quarantine_node2" in _resv(e)
    # an ordinary job asking for node2 must not start while it is under verification
    ordinary = clean_cluster.sbatch("#!/bin/sh\nhostname\n", "--nodelist=node2", "-N1", "-t1")
    e.until(lambda: e.pending_job("node2")[1] == "RUNNING", what="1-node sweep running")
    assert not e.node("node2").drained  # resumed inside its reservation
    e.until(lambda: load_episode(e.store, "node2").pending() is None, what="1-node verdict")
    s1 = e.store.sweeps(node="node2")[-1]
    assert (s1.kind, s1.verdict) == (SweepKind.ONE_NODE, Verdict.PASS), s1.metrics.get("detail")
    assert clean_cluster.job_state(ordinary) == "PENDING"

    # every possible reference busy: the scheduler waits and reserves nothing
    blocker = clean_cluster.sbatch("#!/bin/sh\nsleep 300\n", "-N3", "--nodelist=node1,node3,node4", "-t5")
    clean_cluster.wait_job(blocker, timeout=30, states=("RUNNING",))
    for _ in range(3):
        res = e.tick()
        assert res.steps[0].action == "wait" and "no free healthy reference" in res.steps[0].why, res.steps
        assert "slurmguard_sweep2_node2" not in _resv(e)
        time.sleep(0.5)
    clean_cluster.run(["scancel", str(blocker)])
    clean_cluster.wait_job(blocker, timeout=60)
    clean_cluster.wait_nodes_idle(timeout=60, nodes=["node1", "node3", "node4"])

    e.until(lambda: e.pending_job("node2")[0] is not None, what="2-node sweep submitted")
    assert _resv(e)["slurmguard_sweep2_node2"] == ("node1", "node2")
    e.store.close()
    e.open()  # controller restart while the 2-node sweep runs
    e.until(lambda: e.state("node2") is NodeState.HEALTHY, what="return to service")
    s2 = e.store.sweeps(node="node2")[-1]
    details = [s.metrics.get("detail") for s in e.store.sweeps(node="node2")]
    assert (s2.kind, s2.verdict, s2.reference_node) == (SweepKind.TWO_NODE, Verdict.PASS, "node1"), details
    n2 = e.node("node2")
    assert not n2.drained and n2.comment is None and "debug" in n2.partitions
    assert not any(name.startswith("slurmguard_") for name in _resv(e))
    assert clean_cluster.wait_job(ordinary, timeout=60) == "COMPLETED"  # back in its partition
    # results and verdicts are in the database, readable after a restart
    e.store.close()
    e.open()
    got = [
        (s.kind.value, s.verdict.value, s.metrics["result"]["node_under_test"])
        for s in e.store.sweeps(node="node2")
    ]
    assert got == [("1node", "pass", "node2"), ("2node", "pass", "node2")], details


def test_compute_slowdown_fails_the_node_sweep_and_stays_out(e, clean_cluster):
    e.inject({"node4": {"gemm_slowdown": 0.95}})
    e.drain("node4")
    e.until(lambda: e.state("node4") is NodeState.REMEDIATION, what="sweep failure")
    s = e.store.sweeps(node="node4")[-1]
    assert s.verdict is Verdict.FAIL and s.metrics["result"]["injected"], s.metrics.get("detail")
    assert s.failure_reason.startswith("slurmguard: sweep1 gpu0 gemm_fp32 -"), s.failure_reason
    n4 = e.node("node4")
    assert n4.drained_by_us and n4.reason.startswith("slurmguard: sweep1 gpu0 gemm_fp32")
    assert "slurmguard: sweep1 gpu0 gemm_fp32" in clean_cluster.run(["sinfo", "-R", "-h", "-o", "%E"]).stdout
    [a] = e.store.triage_actions("node4")
    assert (a.rung, a.is_entry) == (TriageRung.RESWEEP, True)


def test_link_slowdown_names_the_node_under_test_not_the_reference(e, clean_cluster):
    e.inject({"node3": {"link_slowdown": 0.95}})
    e.drain("node3")
    e.until(lambda: e.state("node3") is NodeState.REMEDIATION, what="pair sweep failure")
    s1, s2 = e.store.sweeps(node="node3")[-2:]
    assert s1.verdict is Verdict.PASS, s1.metrics.get("detail")  # the link fault is invisible in 1 node
    assert s2.kind is SweepKind.TWO_NODE and s2.reference_node == "node1"
    assert s2.verdict is Verdict.FAIL and s2.failure_reason.startswith("slurmguard: sweep2 "), (
        s2.failure_reason
    )
    assert s2.metrics["result"]["node_under_test"] == "node3"
    assert e.node("node3").drained_by_us and e.node("node3").reason.startswith("slurmguard: sweep2")
    assert not e.node("node1").drained and e.state("node1") is NodeState.HEALTHY


def test_sweep_job_killed_by_slurm_is_recorded_and_retried(e, clean_cluster):
    """scancel of a running sweep: recorded (outcome killed), submitted again, no triage
    entry, the node stays quarantined (not stuck, not failed for someone else's kill)."""
    e.inject({"node2": {"hang_s": 120}})
    e.drain("node2")
    e.until(lambda: e.pending_job("node2")[1] == "RUNNING", what="sweep running")
    jid, _ = e.pending_job("node2")
    clean_cluster.run(["scancel", str(jid)])
    e.inject({})
    e.until(lambda: (e.pending_job("node2")[0] or jid) != jid, timeout=120, what="retry submitted")
    killed = [s for s in e.store.sweeps(node="node2") if s.slurm_job_id == str(jid)][0]
    assert killed.metrics["outcome"] == "killed" and killed.metrics["job_state"] == "CANCELLED"
    assert killed.failure_reason == "slurmguard: sweep1 killed by Slurm (CANCELLED), retrying"
    assert e.state("node2") is NodeState.QUARANTINED
    assert not e.store.triage_actions("node2")


def test_third_triage_entry_in_seven_days_goes_to_terminal(e, clean_cluster):
    e.reset("node4")
    now = e.clock.now()
    have = len(e.store.recent_triage_entries("node4", now - 7 * 86400))  # earlier tests count too
    for days_ago in (5.0, 1.0)[have:]:
        e.store.add_triage_action(
            "node4", TriageRung.RESWEEP, is_entry=True, status=ActionStatus.DONE, at=now - days_ago * 86400
        )
    e.inject({"node4": {"crash": True}})
    e.drain("node4")
    e.until(lambda: e.state("node4") is NodeState.TERMINAL, what="terminal")
    a = e.store.triage_actions("node4")[-1]
    assert (a.rung, a.status, a.evidence["entry_count"]) == (TriageRung.TERMINAL, ActionStatus.DONE, 3)
    n4 = e.node("node4")
    assert n4.drained_by_us and "replace" in n4.reason
    assert "slurmguard_quarantine_node4" not in _resv(e)


def test_reboot_rung_restarts_the_nodes_slurmd_and_sweeps_again(e, clean_cluster):
    from slurmguard_dev.devcluster.devreboot import adopt_restarted, install

    e.open(triage=TriagePolicy(ladder=("reboot", "terminal")))
    install(clean_cluster)
    try:
        e.drain("node3")
        e.store.transition("node3", NodeState.QUARANTINED, "test: quarantined")
        last = max((s.id for s in e.store.sweeps()), default=0)
        e.store.add_triage_action(
            "node3",
            TriageRung.REBOOT,
            is_entry=True,
            status=ActionStatus.PLANNED,
            evidence={AFTER_SWEEP: last},
        )
        e.store.transition("node3", NodeState.REMEDIATION, "test: reboot planned")
        boot0 = e.node("node3").boot_time
        e.until(lambda: e.state("node3") is NodeState.QUARANTINED, timeout=60, what="reboot done")
        adopt_restarted(clean_cluster)
        a = e.store.triage_actions("node3")[-1]
        assert (a.rung, a.status) == (TriageRung.REBOOT, ActionStatus.DONE)
        assert a.evidence["boot_time_after"] > boot0
        reboots = [x for x in e.store.audit_entries(node="node3") if x.action == "reboot"]
        assert len(reboots) == 1, reboots
        assert "slurmguard_quarantine_node3" in _resv(e)  # rebooted inside its quarantine
    finally:
        clean_cluster.set_reboot_program(None)
        adopt_restarted(clean_cluster)
        e.open()
