"""A phase without collectives is not a stall, on the guarded local cluster.

A DDP job (slurmguard.workloads) that evaluates for 20 s every 60 steps,
with no collective while it does (forward passes of each rank's replica on
held-out batches, as a validation pass does), under a stall window of 8 s:
its ranks' hooks say they have nothing in flight, so the controller sees a
quiet job, not a stalled one, and does nothing. Before the hooks said so, the
same silence read as a stall: the job was requeued and a node drained.

A DDP job whose rank 0 alone saves the model for 20 s every 60 steps while
the other rank waits in a barrier (plain DDP's torch.save on rank 0), under
the same window: the waiting rank is in flight, rank 0 is not but is busy
writing (its agent reads /proc/PID/io), so the job is progressing, not
stalled. Before, rank 0's node was drained and the job requeued at the first
save.
About 3 minutes.
"""

from __future__ import annotations

import pytest

from slurmguard_dev.devcluster.scenario import Scenario
from tests.fixtures.guard import nothing_happened, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EVAL_EVERY = 60  # steps: after the agents' warm-up and baseline (25 steps)
EVAL_S = 20.0
SAVE_EVERY = 60
SAVE_S = 20.0


def _two_phases(run, key: str, what: str, *args: str) -> tuple[Scenario, int, list[dict]]:
    """A guarded ddp job with these arguments under an 8 s stall window, run
    until two of its phases (log entries with `key`) and 10 steps after the
    second, the controller's cycles over them: (scenario, job, rank 0's entries)."""
    run.configure(response={"tiers": {"stall_s": 8.0}})
    sc = Scenario(run.guard, say=print, workload="ddp")
    job = sc.submit(steps=100000, ckpt_every=0, args=args)

    def phases():
        return [e for e in sc.log(job) if e.get(key)]

    try:
        wait_for(lambda: len(phases()) >= 2, 300, f"two {what}")
    except AssertionError as exc:
        # what the controller did instead (a requeue restarts the job's count)
        acts = [(e.action, e.node, e.reason) for e in run.audit()]
        raise AssertionError(f"{exc}; audit: {acts}") from None
    done = len(sc.log(job))
    wait_for(lambda: len(sc.log(job)) >= done + 10, 60, f"steps after the second of the {what}")
    return sc, job, phases()


def test_an_evaluation_longer_than_the_stall_window_is_not_a_stall(guarded):
    run = guarded
    sc, job, evals = _two_phases(
        run, "eval_s", "evaluations", "--eval-every", str(EVAL_EVERY), "--eval-s", str(EVAL_S)
    )
    assert all(e["eval_s"] >= EVAL_S and e["eval_batches"] > 0 for e in evals), evals
    print(f"\nevaluations at steps {[e['iter'] for e in evals]}, {[e['eval_s'] for e in evals]} s each")
    nothing_happened(run)
    assert sc.job_nodes(job) and not run.audit("requeue")


def test_rank_0_saving_longer_than_the_stall_window_is_not_a_stall(guarded):
    run = guarded
    sc, job, saves = _two_phases(
        run,
        "rank0_save_s",
        "rank-0 saves",
        *("--rank0-save-every", str(SAVE_EVERY), "--rank0-save-s", str(SAVE_S), "--rank0-save-mbps", "20"),
    )
    assert all(e["rank0_save_s"] >= SAVE_S for e in saves), saves
    rank1 = [e for e in sc.log(job, rank=1) if e.get("rank0_save_s")]
    # rank 1 waited in the barrier as long as rank 0 wrote
    assert len(rank1) >= 2 and all(e["rank0_save_s"] >= SAVE_S - 1 for e in rank1), rank1
    print(
        f"\nrank-0 saves at steps {[e['iter'] for e in saves]}: "
        f"{[e['rank0_save_s'] for e in saves]} s, {[e['rank0_save_mb'] for e in saves]} MB"
    )
    nothing_happened(run)
    assert sc.job_nodes(job) and not run.audit("requeue")
