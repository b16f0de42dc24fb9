"""Worked example (issue 8) on a real workload with a real fault: an opted-in
guarded DDP job (python -m slurmguard.workloads ddp --accum 16) whose second node
is capped from outside the job (a cgroup CPU cap) is rebalanced by the
controller, and its step time drops, measured in one run. About 2-3 minutes."""

from __future__ import annotations

import statistics
import time

import pytest

from slurmguard_dev.devcluster.scenario import SEVERE, Scenario
from tests.fixtures.guard import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

MICROBATCHES = 16


def test_rebalance_tier_reduces_step_time_of_opted_in_job(guarded):
    run = guarded
    # rebalancing is cheap, drains are priced out: only the S2 tier can act here
    run.configure(
        response={"escalation": {"rebalance_gpu_s": 0.2, "drain_checkpoint_gpu_s": 1e6, "requeue_gpu_s": 2e6}}
    )
    sc = Scenario(run.guard, say=print, workload="ddp")
    job = sc.submit(steps=100000, ckpt_every=0, mitigate=MICROBATCHES)
    sc.wait_steps(job, 40, timeout=240)
    slow = sc.job_nodes(job)[-1]  # rank 1's node
    at = len(sc.log(job))
    use, cap = sc.inject(slow, SEVERE)
    # inject measures the node's CPU use for 3 s before it caps: the steps of
    # those seconds are healthy ones and must not count as slowed
    capped_at = time.time()
    wait_for(lambda: run.audit("rebalance"), 120, "the rebalance plan")

    # steps under a split that moved micro-batches to the healthy rank 0, every such
    # split counted (one the controller withdrew for not helping too)
    def rebalanced():
        return [e for e in sc.log(job) if e["plan"] is not None and e["microbatches"] > MICROBATCHES // 2]

    wait_for(lambda: len(rebalanced()) >= 40, 180, "40 steps under a rebalanced split")
    log = sc.log(job)
    sc.clear(slow)
    cleared = len(sc.log(job))
    healthy = statistics.median(e["step_s"] for e in log[10:at])
    slowed = statistics.median(
        e["step_s"] for e in log[at:] if e["t"] > capped_at + 0.5 and e["plan"] is None
    )
    planned = [e for e in log if e["plan"] is not None]
    mitigated = statistics.median(e["step_s"] for e in planned if e["microbatches"] > MICROBATCHES // 2)
    print(
        f"\n{slow} capped at {cap:.0f}% of a CPU (used {use:.2f}): step time healthy "
        f"{healthy * 1e3:.0f} ms, slowed {slowed * 1e3:.0f} ms, mitigated {mitigated * 1e3:.0f} ms "
        f"(rank 0 ran {planned[-1]['microbatches']} of {MICROBATCHES} micro-batches at the end)"
    )
    for v in sorted({e["plan"] for e in planned}):
        under = [e for e in planned if e["plan"] == v]
        print(
            f"  plan v{v}: rank 0 runs {under[0]['microbatches']}, {len(under)} steps, median "
            f"{statistics.median(e['step_s'] for e in under) * 1e3:.0f} ms"
        )
    said = run.audit("rebalance")
    for e in said:
        print(f"  audit: {e.reason}; compute per rank (s) {e.evidence.get('rank_compute_s')}")
    assert slowed > healthy * 1.25
    assert mitigated < slowed * 0.9
    # the node recovers: the split that now overloads rank 0 does not stay. It
    # comes back over several re-plans, each judged on its own iterations (5-11 s
    # here alone); a re-plan withdrawn on noise is barred for PLAN_RETRY_S (10 s)
    # and doubles at each further withdrawal, hence the margin. Session 10's CI
    # run failed here when such a bar was for good (13/3 kept 150 s)
    try:
        back = wait_for(
            lambda: [e for e in sc.log(job)[cleared:] if e["microbatches"] == MICROBATCHES // 2],
            150,
            "the uniform split back after the cap was lifted",
        )
        print(f"  uniform split back {back[0]['t'] - log[-1]['t']:.1f} s after the cap was lifted")
    finally:
        for e in run.audit("rebalance")[len(said) :]:
            print(f"  audit: {e.reason}; compute per rank (s) {e.evidence.get('rank_compute_s')}")
