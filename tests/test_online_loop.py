"""The online loop's policy and safety behaviour on the real local cluster: a
guarded DDP training job (slurmguard.workloads ddp, gloo) and a real fault from
outside the job (a cgroup CPU cap on one node, plus sim telemetry where a test
needs it); what slurmguard did is checked in Slurm and in its audit log.

Detection and response per workload shape (healthy, moderate, severe) are in
tests/test_workloads_loop.py.
"""

from __future__ import annotations

import signal
import time

import pytest

from slurmguard.devcluster.scenario import SEVERE, Scenario
from tests.fixtures.guard import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BASELINE_STEPS = 40  # warm-up + baseline window of the agents, with margin


def start(run, steps: int) -> tuple[Scenario, int, str, str]:
    """Submit a guarded DDP job; return (scenario, job, healthy node, node to slow)."""
    sc = Scenario(run.guard, say=print, workload="ddp")
    job = sc.submit(steps=steps)
    sc.wait_steps(job, BASELINE_STEPS)
    first, second = sc.job_nodes(job)
    return sc, job, first, second


def test_telemetry_fault_without_step_impact_only_comments(guarded):
    run = guarded
    sc, job, ok, slow = start(run, 200)
    run.guard.set_sim_profiles({slow: "thermal_throttle"})
    wait_for(lambda: (run.node(slow)["comment"] or "").startswith(
        "slurmguard: pending verification"), 60, "pending-verification comment")
    assert not run.node(slow)["drained"]
    assert run.audit("drain") == [] and run.audit("requeue") == []
    assert run.cluster.wait_job(job, timeout=300) == "COMPLETED"


def test_admin_drained_node_is_never_resumed_or_re_reasoned(guarded):
    run = guarded
    sc, job, ok, slow = start(run, 100000)
    run.cluster.run(["scontrol", "update", f"NodeName={slow}", "State=DRAIN", "Reason=admin: RMA 1234"])
    sc.inject(slow, SEVERE)
    time.sleep(25)
    assert run.node(slow)["reason"] == "admin: RMA 1234"
    assert run.audit("drain") == [] and run.audit("resume") == [] and run.audit("requeue") == []
    run.cluster.run(["scancel", str(job)])


def test_breaker_at_one_node_holds_second_drain_and_alerts(guarded):
    run = guarded
    run.configure(safety={"breaker": {"max_nodes": 1, "max_partition_percent": 100.0}})
    sc1, j1, _, slow1 = start(run, 100000)
    sc2, j2, _, slow2 = start(run, 100000)
    sc1.inject(slow1, SEVERE)
    sc2.inject(slow2, SEVERE)
    wait_for(lambda: run.audit("alert"), 90, "breaker alert")
    drained = {e.node for e in run.audit("drain")}
    assert len(drained) == 1 and drained <= {slow1, slow2}
    other = ({slow1, slow2} - drained).pop()
    time.sleep(5)
    assert not run.node(other)["drained"]
    (alert, *_) = run.audit("alert")
    assert alert.reason.startswith("circuit breaker") and alert.node == other
    import urllib.request

    metrics = urllib.request.urlopen(run.guard.controller_url + "/metrics", timeout=5).read().decode()
    assert "slurmguard_breaker_open 1.0" in metrics


def test_controller_sigkilled_mid_incident_takes_no_duplicate_action(guarded):
    run = guarded
    # drain early, requeue only after the slowdown has cost more: a window to kill in
    run.configure(response={"escalation": {"drain_checkpoint_gpu_s": 0.5, "requeue_gpu_s": 6.0}})
    sc, job, ok, slow = start(run, 400)
    sc.inject(slow, 1.5)
    wait_for(lambda: run.audit("drain"), 60, "drain")
    assert run.audit("requeue") == []
    run.cluster.stop_service("sg-controller", signal.SIGKILL)
    assert run.cluster.service_pid("sg-controller") is None
    run.guard.start_controller()
    wait_for(lambda: run.audit("requeue"), 90, "requeue after restart")
    sc.clear(slow)
    time.sleep(6)
    assert len(run.audit("drain")) == 1
    assert len(run.audit("signal")) == 1
    assert len(run.audit("requeue")) == 1
    assert run.cluster.wait_job(job, timeout=400) == "COMPLETED"
