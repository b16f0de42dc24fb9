"""A phase without collectives is not a stall, on the guarded local cluster.

A DDP job (slurmguard.workloads) that evaluates for 20 s every 60 steps,
with no collective while it does (forward passes of each rank's replica on
held-out batches, as a validation pass does), under a stall window of 8 s:
its ranks' hooks say they have nothing in flight, so the controller sees a
quiet job, not a stalled one, and does nothing. Before the hooks said so, the
same silence read as a stall: the job was requeued and a node drained.
About 1.5 minutes.
"""

from __future__ import annotations

import pytest

from slurmguard_dev.devcluster.scenario import Scenario
from tests.fixtures.guard import nothing_happened, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EVAL_EVERY = 60  # steps: after the agents' warm-up and baseline (25 steps)
EVAL_S = 20.0


def test_an_evaluation_longer_than_the_stall_window_is_not_a_stall(guarded):
    run = guarded
    run.configure(response={"tiers": {"stall_s": 8.0}})
    sc = Scenario(run.guard, say=print, workload="ddp")
    job = sc.submit(
        steps=100000, ckpt_every=0, args=("--eval-every", str(EVAL_EVERY), "--eval-s", str(EVAL_S))
    )

    def evaluated():
        return [e for e in sc.log(job) if e.get("eval_s")]

    wait_for(lambda: len(evaluated()) >= 2, 300, "two evaluations")
    done = len(sc.log(job))
    # the steps after the second evaluation, and the controller's cycles over them
    wait_for(lambda: len(sc.log(job)) >= done + 10, 60, "steps after the second evaluation")
    evals = evaluated()
    assert all(e["eval_s"] >= EVAL_S and e["eval_batches"] > 0 for e in evals), evals
    print(f"\nevaluations at steps {[e['iter'] for e in evals]}, {[e['eval_s'] for e in evals]} s each")
    nothing_happened(run)
    assert sc.job_nodes(job) and not run.audit("requeue")
