"""`slurmguard bench detect` runs end to end on a small suite and prints every figure;
the suite is labelled as documented and the scoring counts what it says."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from slurmguard_dev.bench.detect_baselines import Alarm, Report, score, sliding_window, sliding_window_alarms
from slurmguard_dev.bench.detect_scenarios import (
    INTERMITTENT,
    KINDS,
    MIN_DURATION,
    MIN_SHIFT,
    make_intermittent_suite,
    make_scenario,
    make_suite,
)


def test_bench_detect_small_run_prints_tables_baselines_and_throughput():
    from slurmguard.cli import cli

    res = CliRunner().invoke(
        cli, ["bench", "detect", "--scenarios", "40", "--length", "200", "--series", "300", "--steps", "10"]
    )
    assert res.exit_code == 0, res.output
    out = res.output
    for needle in (
        "SlidingWindow",
        "plain BOCD",
        "step detector",
        "delay med/p90",
        "loc med/p90",
        "per texture",
        "periodic",
        "checkpoints",
        "second seed family (seed 1000)",
        "samples/s",
        "R=500",
        "iteration time from the ACF period",
        # the real workloads' series of tests/data/steptimes, by default
        "recorded series (",
        "per class of recorded series",
        "ddp-shift.csv",
        "intermittent slowdowns (seed 2000",
        "lasting ones open at the end",
    ):
        assert needle in out, needle


def test_intermittent_suite_is_labelled_by_its_mean_cost():
    """Half healthy, half intermittent; an intermittent series is slowed only from
    its onset, on a share of its iterations, and is a positive exactly when that
    costs 10% of the mean step or more."""
    suite = make_intermittent_suite(60, 400, seed=3)
    again = make_intermittent_suite(60, 400, seed=3)
    assert all(np.array_equal(x.x, y.x) for x, y in zip(suite, again))
    slowed = [s for s in suite if s.onsets]
    assert len(slowed) == 30 and all(s.kind == INTERMITTENT for s in slowed)
    assert all(s.kind == "healthy" and not s.positives for s in suite if not s.onsets)
    for s in slowed:
        share, factor = s.notes["share"], s.notes["factor"]
        assert 0.15 <= share <= 0.7 and 1.3 <= factor <= 5.0
        assert s.severity == pytest.approx(share * (factor - 1.0), rel=0.01)  # notes are rounded
        assert bool(s.positives) == (s.severity >= MIN_SHIFT)
    wide = [s for s in make_intermittent_suite(400, 200, seed=5) if s.onsets]
    assert {bool(s.positives) for s in wide} == {True, False}  # both sides of the bar drawn


def test_suite_is_deterministic_labelled_and_draws_widely():
    a, b = make_suite(30, 200, seed=4), make_suite(30, 200, seed=4)
    assert all(np.array_equal(x.x, y.x) for x, y in zip(a, b))
    suite = make_suite(400, 300, seed=1)
    assert {s.kind for s in suite} == set(KINDS)
    base = [s.notes["base"] for s in suite]
    assert min(base) < 0.1 and max(base) > 3.0
    periods = {s.notes.get("period") for s in suite} - {None}
    assert periods == set(range(2, 9))
    for s in suite:
        assert np.all(np.isfinite(s.x)) and np.all(s.x > 0)
        for o in s.positives:
            end = next((r for r in s.recoveries if r > o), s.x.size)
            assert end - o >= MIN_DURATION
        if s.kind in ("shift", "transient"):
            assert s.severity >= MIN_SHIFT and s.positives == s.onsets
        if s.kind == "small_shift":
            assert 0.05 <= s.severity < MIN_SHIFT and not s.positives
        if s.kind == "hiccup":
            assert s.excursions and all(1 <= b - a <= 8 for a, b in s.excursions)
    # a labelled shift is really there: the median after the onset is higher by about the severity
    rng = np.random.default_rng(0)
    sc = make_scenario(rng, "shift", 400)
    o = sc.onsets[0]
    p = sc.notes.get("period", 1)
    k = (min(60, o, sc.x.size - o) // p) * p
    ratio = sc.x[o : o + k].mean() / sc.x[o - k : o].mean() - 1.0
    assert abs(ratio - sc.severity) < 0.5 * sc.severity + 0.05


def test_scoring_counts_fp_fn_delay_location_and_recoveries():
    rng = np.random.default_rng(1)
    healthy = make_scenario(rng, "healthy", 200)
    faulty = make_scenario(rng, "transient", 300)
    o, r = faulty.onsets[0], faulty.recoveries[0]
    s = score(
        "t", [healthy, faulty], [Report([Alarm(50, 52)]), Report([Alarm(o + 1, o + 3)], [Alarm(r, r + 4)])]
    )
    assert (s.false_pos, s.negatives, s.false_neg, s.positives) == (1, 1, 0, 1)
    assert s.delays == [3] and s.loc_err == [1]
    assert (s.recoveries_found, s.recoveries, s.false_recoveries) == (1, 1, 0)
    # reported too late: a miss; a recovery reported where the series only slowed: false
    shift = make_scenario(rng, "shift", 300)
    o = shift.onsets[0]
    s = score(
        "t",
        [faulty, shift],
        [Report([Alarm(o, faulty.onsets[0] + 30)]), Report([Alarm(o, o + 2)], [Alarm(o + 40, o + 44)])],
    )
    assert s.false_neg == 1 and s.false_recoveries == 1


def test_hiccup_reported_with_its_recovery_is_not_a_false_positive_but_left_open_is():
    rng = np.random.default_rng(2)
    h = make_scenario(rng, "hiccup", 300)
    a, b = h.excursions[0]
    closed = Report([Alarm(a, a + 3)], [Alarm(b, b + 3)], open_at_end=False)
    left_open = Report([Alarm(a, a + 3)], open_at_end=True)
    assert score("t", [h], [Report()]).false_pos == 0
    assert score("t", [h], [closed]).false_pos == 0
    s = score("t", [h], [left_open])
    assert s.false_pos == 1 and s.hiccups_closed == 0


def test_sliding_window_baseline_finds_a_sustained_step_late_and_its_return():
    x = np.r_[np.ones(50), np.full(50, 1.3), np.ones(50)]
    (a,) = sliding_window_alarms(x, 8, 0.10)
    assert 50 + 3 <= a.detected_at <= 50 + 8
    rep = sliding_window(x, 8, 0.10)
    assert len(rep.faster) == 1 and 100 <= rep.faster[0].detected_at <= 108
