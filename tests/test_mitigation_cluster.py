"""Worked example (issue 8): an opted-in guarded DDP job on the local cluster is
rebalanced by the controller, and its step time drops, measured in one run."""

from __future__ import annotations

import statistics
import sys

import pytest

from tests.fixtures.guard import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_rebalance_tier_reduces_step_time_of_opted_in_job(guarded):
    run = guarded
    # rebalancing is cheap, drains are priced out: only the S2 tier can act here
    run.configure(
        response={"escalation": {"rebalance_gpu_s": 0.2, "drain_checkpoint_gpu_s": 1e6, "requeue_gpu_s": 2e6}}
    )
    st = run.cluster.state_dir
    script = (
        "#!/bin/bash\n"
        f"export SLURMGUARD_CONTROLLER_URL={run.guard.controller_url}\n"
        f"srun {sys.executable} -m slurmguard_dev.devcluster.train --iters 700 --compute-ms 80 "
        f"--microbatches 16 --plan-every 5 --ckpt {st}/ckpt-$SLURM_JOB_ID "
        f"--inject-dir {run.guard.inject_dir} --log {st}/train-$SLURM_JOB_ID.jsonl\n"
    )
    job = run.cluster.sbatch(
        script,
        "-N2",
        "--ntasks-per-node=1",
        "--exclusive",
        "--straggler-guard",
        "--comment=slurmguard:mitigate,microbatches=16",
        "-o",
        f"{st}/job-%j.out",
    )
    run.wait_iters(job, 60)
    from slurmguard_dev.devcluster.scenario import Scenario

    slow = Scenario(run.guard).job_nodes(job)[-1]
    inject_at = len(run.train_log(job))
    run.guard.inject(slow, 1.5)
    wait_for(lambda: run.audit("rebalance"), 90, "the rebalance plan")
    wait_for(
        lambda: sum(1 for r in run.train_log(job) if r["plan"]) >= 60, 120, "60 iterations under the plan"
    )
    log = run.train_log(job)
    healthy = statistics.median(r["step_s"] for r in log[10:inject_at])
    slowed = statistics.median(r["step_s"] for r in log[inject_at + 5 :] if not r["plan"])
    mitigated = statistics.median(r["step_s"] for r in [r for r in log if r["plan"]][5:])
    counts = [r["microbatches"] for r in log if r["plan"]]
    print(
        f"\nstep time: healthy {healthy * 1e3:.0f} ms, slowed {slowed * 1e3:.0f} ms, "
        f"mitigated {mitigated * 1e3:.0f} ms (rank 0 now runs {counts[-1]} of 16 micro-batches)"
    )
    assert slowed > healthy * 1.25
    assert mitigated < slowed * 0.92  # planned makespan: 10 x 10 ms vs 8 x 15 ms -> -17%
    assert counts[-1] > 8  # the healthy rank took micro-batches from the slow one
    assert not run.node(slow)["drained"]
    run.cluster.run(["scancel", str(job)])
