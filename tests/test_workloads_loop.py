"""The online loop on real training jobs (slurmguard.workloads) with real faults
from outside the job (a cgroup CPU cap on one node), on the guarded local cluster.

Per workload, one job: a healthy start, a restart after a requeue that is not
slurmguard's, and nothing may happen (no drain, comment, incident or signal);
then a severe fault on one of its nodes: that node, and only that node, is
drained with a slurmguard reason and the job is requeued and completes on other
nodes from its checkpoint. DDP and PP also get the moderate tier: drain and the
checkpoint signal (the job asked for one with --signal), no requeue.
"""

from __future__ import annotations

import os
import time

import pytest

from slurmguard.devcluster.scenario import MODERATE, SEVERE, Scenario
from slurmguard.workloads import SHAPES
from tests.fixtures.guard import wait_for

# Not yet part of the default run (issue 12 stays open): on the dev policy, real
# workloads are still judged slow in their first iterations (e.g. "step +72% ...
# rank 0 compute 0.0229s vs same-role peers 0.0138s" on a healthy DDP job) and
# a capped pipeline stalls rather than slows. Run them with
# SLURMGUARD_WORKLOAD_LOOP=1 while that is being fixed.
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("SLURMGUARD_WORKLOAD_LOOP"),
                                 reason="issue 12: real-workload loop not yet reliable; "
                                        "SLURMGUARD_WORKLOAD_LOOP=1 runs it")]

BASELINE = 40  # steps: the agents' warm-up (5) and baseline (20) with margin


def _nothing_happened(run) -> None:
    assert [(e.action, e.node, e.reason) for e in run.audit()] == []
    for n in run.cluster.node_names:
        info = run.node(n)
        assert not info["drained"] and not info["comment"], (n, info)
    with run.store() as s:
        assert s.incidents() == []


@pytest.mark.parametrize("workload", SHAPES)
def test_healthy_then_restarted_then_severe_fault_drains_only_that_node(guarded, workload):
    run = guarded
    sc = Scenario(run.guard, say=print, workload=workload)
    job = sc.submit(steps=320, ckpt_every=25)
    sc.wait_steps(job, BASELINE)
    # a restart that is not slurmguard's (preemption, an admin): resumes from the
    # checkpoint, and its start-up is not a slowdown
    sc.requeue(job)
    resumed = sc.wait_steps(job, BASELINE, restart=1, timeout=240)
    last = max(e["iter"] for e in sc.log(job) if e["restart"] == 0)
    assert 25 <= resumed[0]["iter"] <= last + 1 and resumed[0]["iter"] % 25 == 0
    time.sleep(4)  # the last reports of the healthy runs reach the controller
    _nothing_happened(run)

    nodes = sc.job_nodes(job)
    slow = nodes[-1]
    healthy = sorted(e["step_s"] for e in resumed[10:])[len(resumed[10:]) // 2]
    use, cap = sc.inject(slow, SEVERE)  # measures the node's CPU use for 3 s first
    t_inject = time.time()
    n_before = len(sc.log(job))
    drain = wait_for(lambda: sc.drain(slow), 150, f"{slow} drained")
    t_drain = sc.epoch(drain.at)
    assert t_drain >= t_inject - 1.0, "drained before the fault was on"
    assert drain.reason.startswith("slurmguard: ")
    wait_for(lambda: run.audit("requeue"), 90, "requeue")
    sc.clear(slow)
    after = [e["step_s"] for e in sc.log(job)[n_before:] if e["t"] <= t_drain]
    assert [e.node for e in run.audit("drain")] == [slow]
    assert not any(run.node(n)["drained"] for n in run.cluster.node_names if n != slow)
    assert run.cluster.wait_job(job, timeout=400) == "COMPLETED"
    assert slow not in sc.job_nodes(job)
    assert sc.done(job)
    slowed = sorted(after)[len(after) // 2] if after else float("nan")
    print(f"\n{workload}: healthy step {healthy * 1e3:.0f} ms; {slow} capped at {cap:.0f}% "
          f"(used {use:.2f} CPUs) -> {slowed * 1e3:.0f} ms; drained {t_drain - t_inject:.1f}s / "
          f"{len(after)} steps after injection")


@pytest.mark.parametrize("workload", ["ddp", "pp"])
def test_moderate_fault_drains_and_signals_without_requeue(guarded, workload):
    run = guarded
    run.configure(response={"tiers": {"sustained_s": 6.0},
                            "escalation": {"drain_checkpoint_gpu_s": 0.5, "requeue_gpu_s": 1000.0}})
    sc = Scenario(run.guard, say=print, workload=workload)
    job = sc.submit(steps=100000, signal=True, ckpt_every=0)
    sc.wait_steps(job, BASELINE)
    nodes = sc.job_nodes(job)
    slow = nodes[-1]
    sc.inject(slow, MODERATE)
    wait_for(lambda: run.node(slow)["drained"], 150, f"{slow} drained")
    wait_for(lambda: run.audit("signal"), 60, "checkpoint signal")
    t_signal = time.time()
    # the job checkpoints on the signal (ckpt_every=0: no periodic ones)
    wait_for(lambda: any(e["ckpt_s"] > 0 for e in sc.log(job)), 60, "the checkpoint on SIGUSR1")
    time.sleep(5)
    assert run.audit("requeue") == []
    assert run.cluster.job_state(job) == "RUNNING"
    assert sc.job_nodes(job) == nodes  # running work continues on the drained node
    assert [e.node for e in run.audit("drain")] == [slow]
    sc.clear(slow)
    run.cluster.run(["scancel", str(job)])
    print(f"\n{workload}: moderate fault on {slow}: drained and signalled at {t_signal:.0f}, no requeue")
