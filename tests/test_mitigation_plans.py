"""The rebalance tier's decisions (controller.plans): what a split is planned
from, when it is served, and how a served split is judged on the job's steps
under it (withdrawn when the job is not faster, re-planned otherwise).

The figures are the ddp workload's on the 2-core dev cluster (rank 1's node
capped at about 22% of a CPU): compute 72 ms (rank 0) and 220 ms (rank 1) a
step at 8/8, then 133 and 166 ms under 12/4 (tests/test_mitigation_cluster.py
printed them)."""

from __future__ import annotations

import math

import pytest

from slurmguard.config import parse_policy
from slurmguard.controller.loop import Controller
from slurmguard.controller.plans import (
    PLAN_RETRY_S,
    PLAN_SETTLE_S,
    PlanBook,
    Timings,
    propose,
    timings_since,
    uniform_counts,
)
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.wire import AgentReport, JobReport, RankReport, StepSample

JOB = 7


def ranks_of(*per_rank: list[tuple[int, float, float]], now: float = 1000.0) -> list[tuple[str, RankReport]]:
    """Ranks whose windows are segments of (iterations, step s, compute s), oldest
    first, ending at `now` (the same end times on every rank: synchronous steps)."""
    out = []
    for rank, segments in enumerate(per_rank):
        total = sum(n * step for n, step, _ in segments)
        t, steps = now - total, []
        for n, step, compute in segments:
            for _ in range(n):
                t += step
                steps.append(StepSample(end=t, step_s=step, comm_s=step - compute))
        out.append(
            (
                f"node{rank + 1}",
                RankReport(rank=rank, baseline_step_s=0.085, baseline_compute_s=0.07, steps=steps),
            )
        )
    return out


# ---------------------------------------------------------------- planning
def test_plan_from_measured_compute_gives_the_slow_rank_fewer_microbatches():
    counts, span = propose({0: 0.0715, 1: 0.2204}, (8, 8), 16)
    assert counts == (12, 4)
    assert span == pytest.approx(max(12 * 0.0715 / 8, 4 * 0.2204 / 8))


def test_no_plan_when_the_predicted_gain_is_within_the_noise():
    # 3% apart: the best split (8/8 already, or 9/7 at a predicted 1% gain) is not served
    assert propose({0: 0.100, 1: 0.103}, (8, 8), 16) is None
    # but a split the compute no longer calls for is undone (the capped node recovered)
    assert propose({0: 0.112, 1: 0.048}, (12, 4), 16)[0] == (9, 7)


def test_plan_inputs_are_the_slowed_iterations_not_the_healthy_ones_before():
    """Rank 1 computes 60 ms a step healthy and 190 ms capped (85 -> 214 ms
    steps); the plan comes 2 s after the onset, when the localisation window
    (the last 4 s) still holds 22 healthy iterations beside the 10 slowed
    ones: planned from it, the slow rank looks 1.4x slow and keeps 7 of 16
    micro-batches (the 9/7 plan under which a capped job stayed as slow as
    before); from the iterations since the onset, 12/4."""
    onset = 1000.0 - 10 * 0.214 + 1e-3  # the start of the first slowed iteration
    ranks = ranks_of([(60, 0.085, 0.07), (10, 0.214, 0.07)], [(60, 0.085, 0.06), (10, 0.214, 0.19)])
    mixed = timings_since(ranks, None)
    since = timings_since(ranks, onset)
    assert mixed is not None and since is not None and mixed.iterations == 32
    assert propose(mixed.compute_s, (8, 8), 16)[0] == (9, 7)
    assert since.iterations == 10
    assert since.compute_s[1] == pytest.approx(0.19) and since.step_s == pytest.approx(0.214)
    assert propose(since.compute_s, (8, 8), 16)[0] == (12, 4)


def test_uniform_counts_respect_pipeline_multiples():
    assert uniform_counts(16, 2) == (8, 8)
    assert uniform_counts(18, 2, pp=2) == (10, 8)


# ---------------------------------------------------------------- judging a served split
def served(book: PlanBook, before_s: float = 0.316, at: float = 100.0):
    plan = book.rebalance(JOB, {0: 0.0715, 1: 0.2204}, 16, before_s=before_s, now=at)
    assert plan is not None and plan.microbatches == (12, 4)
    return plan


def test_a_split_is_judged_only_after_it_settles_on_enough_iterations():
    book = PlanBook()
    served(book)
    assert book.judged_from(JOB) == 100.0 + PLAN_SETTLE_S
    worse = Timings(0.400, {0: 0.3, 1: 0.3}, 20)
    assert book.review(JOB, worse, 16, now=100.0 + PLAN_SETTLE_S / 2) == (None, "")
    assert book.review(JOB, Timings(0.400, {0: 0.3, 1: 0.3}, 4), 16, now=110.0) == (None, "")
    assert book.get(JOB).microbatches == (12, 4)


def test_a_split_under_which_the_job_is_not_faster_is_withdrawn_then_retried_with_back_off():
    book = PlanBook()
    served(book, before_s=0.204)
    new, why = book.review(JOB, Timings(0.204, {0: 0.15, 1: 0.12}, 20), 16, now=110.0)
    assert new is not None and new.microbatches is None and new.version == 2
    assert "withdrew micro-batches [12, 4]" in why and "uniform" in why
    assert f"afresh from {PLAN_RETRY_S:.0f} s on" in why
    # planned afresh from the iterations since the withdrawal, not before PLAN_RETRY_S
    assert book.judged_from(JOB) == 110.0 + PLAN_SETTLE_S
    slowed = Timings(0.316, {0: 0.0715, 1: 0.2204}, 20)
    assert book.review(JOB, slowed, 16, now=110.0 + PLAN_RETRY_S - 1) == (None, "")
    again, why = book.review(JOB, slowed, 16, now=110.0 + PLAN_RETRY_S)
    assert again is not None and again.microbatches == (12, 4) and "afresh after withdrawal 1" in why
    # withdrawn a second time: the next retry waits twice as long
    t2 = 110.0 + PLAN_RETRY_S + 10
    new, why = book.review(JOB, Timings(0.400, {0: 0.3, 1: 0.3}, 20), 16, now=t2)
    assert new is not None and new.microbatches is None
    assert f"afresh from {2 * PLAN_RETRY_S:.0f} s on" in why
    assert book.review(JOB, slowed, 16, now=t2 + 2 * PLAN_RETRY_S - 1) == (None, "")
    # by then the node has recovered: nothing to gain, the uniform split stays
    assert book.review(JOB, Timings(0.085, {0: 0.07, 1: 0.071}, 20), 16, now=t2 + 2 * PLAN_RETRY_S) == (
        None,
        "",
    )
    assert book.get(JOB).microbatches is None


def test_an_adjustment_that_makes_the_job_slower_goes_back_to_the_split_before_it():
    book = PlanBook()
    served(book, before_s=0.316)
    # faster under 12/4 (262 vs 316 ms), rank 1 still the slower: 13/3
    adj, why = book.review(JOB, Timings(0.262, {0: 0.133, 1: 0.166}, 20), 16, now=110.0)
    assert adj is not None and adj.microbatches == (13, 3) and "from [12, 4]" in why
    # under 13/3 the job ran 280 ms: slower than under 12/4, which comes back
    back, why = book.review(JOB, Timings(0.280, {0: 0.14, 1: 0.14}, 20), 16, now=120.0)
    assert back is not None and back.microbatches == (12, 4) and back.version == 3
    assert "withdrew micro-batches [13, 3]" in why
    # 12/4 is not judged against 13/3's step (nothing to compare), and 13/3 is not
    # served again within its back-off
    same = Timings(0.262, {0: 0.133, 1: 0.166}, 20)
    assert book.review(JOB, same, 16, now=125.0) == (None, "")
    assert book.review(JOB, same, 16, now=120.0 + PLAN_RETRY_S - 0.1) == (None, "")
    assert book.get(JOB).microbatches == (12, 4)
    # after it, the compute still calls for 13/3: served again, and a second
    # withdrawal bars it twice as long
    again, _ = book.review(JOB, same, 16, now=120.0 + PLAN_RETRY_S)
    assert again is not None and again.microbatches == (13, 3)
    t = 120.0 + PLAN_RETRY_S + 10
    back, _ = book.review(JOB, Timings(0.280, {0: 0.14, 1: 0.14}, 20), 16, now=t)
    assert back is not None and back.microbatches == (12, 4)
    assert book.review(JOB, same, 16, now=t + 2 * PLAN_RETRY_S - 0.1) == (None, "")
    assert book.review(JOB, same, 16, now=t + 2 * PLAN_RETRY_S)[0].microbatches == (13, 3)


def test_a_recovered_node_gets_the_uniform_split_back_after_a_withdrawal_on_noise():
    """Session 10's CI failure: the cap lifted under 13/3; the re-plan 10/6 ran
    a step 1 ms slower than 13/3 had (noise on a loaded machine) and was
    withdrawn, back to 13/3, whose compute kept proposing 10/6, then barred
    for good: the job kept 13/3 on a healthy node. With the back-off, 10/6 is
    served again and the split walks back to uniform."""
    book = PlanBook()
    plan = book.rebalance(JOB, {0: 0.048, 1: 0.148}, 16, before_s=0.206, now=100.0)
    assert plan is not None and plan.microbatches == (12, 4)
    v2, _ = book.review(JOB, Timings(0.153, {0: 0.061, 1: 0.072}, 20), 16, now=105.0)
    assert v2.microbatches == (13, 3)
    # the cap is lifted: rank 0 computes 13 micro-batches at full speed, rank 1 3
    lifted = Timings(0.086, {0: 0.062, 1: 0.026}, 20)
    v3, _ = book.review(JOB, lifted, 16, now=110.0)
    assert v3.microbatches == (10, 6)
    v4, why = book.review(JOB, Timings(0.087, {0: 0.050, 1: 0.036}, 20), 16, now=115.0)
    assert v4.microbatches == (13, 3) and "withdrew micro-batches [10, 6]" in why
    now, split = 120.0, (13, 3)
    while split is not None and now < 115.0 + 60.0:
        t = (
            lifted
            if split == (13, 3)
            else Timings(0.07, {0: 0.005 * split[0] + 0.01, 1: 0.005 * split[1] + 0.01}, 20)
        )
        new, _ = book.review(JOB, t, 16, now=now)
        split = new.microbatches if new is not None else split
        now += 3.3
    assert split is None, f"still on {split} {now - 115.0:.0f} s after the withdrawal"
    assert now - 115.0 < PLAN_RETRY_S + 15


def test_a_split_that_helps_is_kept_and_a_recovered_node_gets_the_uniform_split_back():
    book = PlanBook()
    served(book, before_s=0.316)
    # balanced under 12/4 and faster than before: kept as it is
    assert book.review(JOB, Timings(0.200, {0: 0.15, 1: 0.15}, 20), 16, now=110.0) == (None, "")
    # the cap is lifted: rank 0 now computes 12 micro-batches at full speed, rank 1 4
    first, _ = book.review(JOB, Timings(0.115, {0: 0.112, 1: 0.048}, 20), 16, now=120.0)
    assert first is not None and first.microbatches is not None and first.microbatches[0] < 12
    # the next one is (close to) balanced at the uniform split: the plan ends
    last, why = book.review(JOB, Timings(0.095, {0: 0.091, 1: 0.069}, 20), 16, now=130.0)
    assert last is not None and last.microbatches is None and "uniform split again" in why


def test_a_plan_restored_by_a_restarted_controller_is_not_withdrawn_for_lack_of_a_comparison():
    book = PlanBook()
    plan = served(book)
    restarted = PlanBook()
    restarted.put(plan)
    assert restarted.review(JOB, None, 16, now=100.0) == (None, "")  # starts its judgement now
    assert restarted.review(JOB, Timings(0.9, {0: 0.5, 1: 0.5}, 20), 16, now=110.0) == (None, "")
    assert restarted.get(JOB).microbatches == (12, 4)
    assert math.isinf(restarted._reviews[JOB].before_s)


# ---------------------------------------------------------------- in the controller cycle
POLICY = parse_policy("""
response:
  tiers: {moderate_slowdown: 0.10, severe_slowdown: 0.20, sustained_s: 20, stall_s: 60}
  escalation: {rebalance_gpu_s: 0.5, drain_checkpoint_gpu_s: 1000.0, requeue_gpu_s: 2000.0}
""")


def feed(ctl: Controller, now: float, job: int, ranks: list[tuple[str, RankReport]], seq: int) -> None:
    for node, rk in ranks:
        ctl.fleet.ingest(
            AgentReport(node=node, seq=seq, sent_at=now, jobs=[JobReport(job_id=job, ranks=[rk])]), now
        )


def with_baseline(ranks: list[tuple[str, RankReport]]) -> list[tuple[str, RankReport]]:
    return [
        (n, r.model_copy(update={"baseline_step_s": 1.0, "baseline_compute_s": 0.8, "total_steps": 60}))
        for n, r in ranks
    ]


def test_controller_withdraws_a_split_under_which_the_job_stays_slow(sqlite_store, fake_clock):
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"], comment="slurmguard:mitigate,microbatches=16")
    now = fake_clock.now()
    slow = [(45, 1.0, 0.8), (15, 1.3, 0.8)], [(45, 1.0, 0.8), (15, 1.3, 1.1)]
    feed(ctl, now, job, with_baseline(ranks_of(*slow, now=now)), 1)
    assert ctl.cycle().actions == [("rebalance", str(job))]
    assert ctl.plans.served(job)["microbatches"] == [9, 7]
    # 10 s later the job is exactly as slow as before (the split did not help)
    fake_clock.advance(10)
    now = fake_clock.now()
    still = [(45, 1.0, 0.8), (23, 1.3, 0.8)], [(45, 1.0, 0.8), (23, 1.3, 1.1)]
    feed(ctl, now, job, with_baseline(ranks_of(*still, now=now)), 2)
    assert ctl.cycle().actions == [("rebalance", str(job))]
    plan = ctl.plans.served(job)
    assert plan["microbatches"] is None and plan["version"] == 2
    first, withdrawn = sqlite_store.audit_entries(action="rebalance")
    assert withdrawn.reason.startswith(
        "withdrew micro-batches [9, 7]: step 1300 ms under them, 1300 ms before"
    )
    assert first.evidence["rank_compute_s"] == {"0": 0.8, "1": 1.1}
    # served from the incident by a restarted controller: the withdrawal, not the split
    (inc,) = sqlite_store.incidents(job_id=str(job))
    assert inc.evidence["plan"]["microbatches"] is None
