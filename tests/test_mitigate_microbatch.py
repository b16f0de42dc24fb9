"""Micro-batch planner (Greyhound Eq. 1): optimal against brute force and cvxpy."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import slurmguard.mitigate.microbatch as mb
from slurmguard.errors import InputError
from slurmguard.mitigate.microbatch import (
    continuous_bound,
    makespan,
    plan_microbatches,
    uniform_split,
)


def brute_force(times, total, pp=1):
    """Smallest makespan over every split with m_i >= pp, m_i = 0 mod pp, sum = total."""
    d = len(times)
    units = total // pp
    best = None
    for cut in itertools.combinations(range(1, units), d - 1):
        parts = [b - a for a, b in zip((0,) + cut, cut + (units,))]
        v = makespan([p * pp for p in parts], times)
        best = v if best is None else min(best, v)
    return best


def _check(plan, times, total, pp):
    assert sum(plan.m) == total
    assert all(m >= pp and m % pp == 0 for m in plan.m)
    assert plan.makespan == makespan(plan.m, times)


def test_known_answer_one_slow_group():
    # Two healthy groups at 1 s, one at 3 s: 7+7+2 gives 7 s (uniform 6,5,5 gives 18 s).
    plan = plan_microbatches([1.0, 1.0, 3.0], 16)
    assert plan.m == (7, 7, 2)
    assert plan.makespan == 7.0


def test_known_answer_pp_multiple():
    # With PP=2 every count is even: 6+6+2+2 -> 6 s.
    plan = plan_microbatches([1.0, 1.0, 2.0, 2.0], 16, pp=2)
    assert plan.m == (6, 6, 2, 2)
    assert plan.makespan == 6.0


def test_every_group_keeps_one_microbatch_even_when_very_slow():
    plan = plan_microbatches([1.0, 100.0], 10)
    assert plan.m == (9, 1)
    assert plan.makespan == 100.0


def test_equal_times_give_uniform_split_and_ties_go_to_lower_index():
    assert plan_microbatches([2.0] * 4, 10).m == (3, 3, 2, 2)
    assert uniform_split(10, 4) == (3, 3, 2, 2)


@pytest.mark.parametrize("slots_cap", [16, -1], ids=["vectorised", "heap"])
def test_matches_brute_force_on_random_small_cases(monkeypatch, slots_cap):
    monkeypatch.setattr(mb, "_MAX_SLOTS_PER_GROUP", slots_cap)
    rng = random.Random(7)
    for _ in range(400):
        d = rng.randint(1, 4)
        pp = rng.choice([1, 1, 2, 3])
        total = pp * rng.randint(d, d + 7)
        times = [rng.choice([0.5, 1.0, 2.0, 3.0, 0.01, rng.uniform(0.1, 5.0)]) for _ in range(d)]
        plan = plan_microbatches(times, total, pp)
        _check(plan, times, total, pp)
        assert plan.makespan == brute_force(times, total, pp), (times, total, pp, plan)


def test_continuous_bound_is_a_lower_bound_and_tight_for_divisible_cases():
    rng = np.random.default_rng(3)
    for _ in range(200):
        t = rng.uniform(0.1, 4.0, rng.integers(1, 40))
        total = int(t.size + rng.integers(0, 200))
        assert continuous_bound(t, total) <= plan_microbatches(t, total).makespan + 1e-12
    # 1/1 + 1/2 = 1.5 micro-batches per second; M=3 -> T=2 exactly (2 and 1 micro-batches).
    assert continuous_bound([1.0, 2.0], 3) == pytest.approx(2.0)
    assert plan_microbatches([1.0, 2.0], 3).makespan == 2.0


def test_matches_cvxpy_milp_on_larger_cases():
    pytest.importorskip("cvxpy")
    from slurmguard.mitigate.reference import plan_microbatches_milp
    from slurmguard_dev.bench.plan import make_times

    rng = np.random.default_rng(11)
    for groups, per_group, pp in [(16, 8, 1), (32, 5, 1), (48, 3, 2), (64, 4, 1)]:
        times = make_times(groups, rng).tolist()
        total = groups * per_group * pp
        exact = plan_microbatches(times, total, pp)
        ref = plan_microbatches_milp(times, total, pp)
        _check(exact, times, total, pp)
        _check(ref, times, total, pp)
        assert exact.makespan == ref.makespan, groups


def test_plan_beats_uniform_split_under_a_slow_group():
    times = [1.0] * 7 + [2.5]
    plan = plan_microbatches(times, 64)
    assert makespan(uniform_split(64, 8), times) == 20.0
    # Within 8 s the groups fit 7*8 + floor(8/2.5) = 59 < 64 micro-batches,
    # within 9 s 7*9 + 3 = 66: the optimum is 9 s, the slow group takes 3.
    assert plan.makespan == 9.0
    assert plan.m[-1] == 3 and sum(plan.m) == 64


@pytest.mark.parametrize(
    "times,total,pp,needle",
    [
        ([], 4, 1, "no DP group"),
        ([1.0, 0.0], 4, 1, "group 1"),
        ([1.0, float("nan")], 4, 1, "group 1"),
        ([1.0, -2.0], 4, 1, "group 1"),
        ([1.0, 1.0, 1.0], 2, 1, "need >= 3"),
        ([1.0, 1.0], 5, 2, "not a multiple of pp=2"),
        ([1.0, 1.0], 2, 2, "need >= 4"),
        ([1.0], 4, 0, "pp=0"),
    ],
)
def test_bad_problems_raise_one_line_input_errors(times, total, pp, needle):
    with pytest.raises(InputError) as err:
        plan_microbatches(times, total, pp)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
