"""`slurmguard bench detect` runs end to end on a small suite and prints every figure."""

from __future__ import annotations

from click.testing import CliRunner

from slurmguard.detect.baselines import Alarm, score, sliding_window_alarms
from slurmguard.detect.scenarios import make_scenario, make_suite

import numpy as np


def test_bench_detect_small_run_prints_table_and_throughput():
    from slurmguard.cli import cli

    res = CliRunner().invoke(cli, ["bench", "detect", "--scenarios", "40", "--length", "200",
                                   "--series", "300", "--steps", "10"])
    assert res.exit_code == 0, res.output
    out = res.output
    for needle in ("SlidingWindow", "no verif", "BOCD+V on healthy + comm", "literal P(r_t=0)>0.9", "MAP run-length drop",
                   "samples/s", "R=500", "iteration time from the ACF period", "run-length cap"):
        assert needle in out, needle
    assert "0.004000 = hazard" in out


def test_suite_is_deterministic_and_labelled():
    a, b = make_suite(30, 200, seed=4), make_suite(30, 200, seed=4)
    assert all(np.array_equal(x.x, y.x) for x, y in zip(a, b))
    rng = np.random.default_rng(0)
    sc = make_scenario(rng, "compute", 300)
    assert len(sc.onsets) == 1 and 60 <= sc.onsets[0] < 240


def test_scoring_counts_fp_fn_and_delay():
    rng = np.random.default_rng(1)
    healthy = make_scenario(rng, "healthy", 200)
    faulty = make_scenario(rng, "compute", 200)
    o = faulty.onsets[0]
    s = score("t", [healthy, faulty], [[Alarm(50, 52)], [Alarm(o, o + 2)]])
    assert (s.false_pos, s.negatives, s.false_neg, s.positives) == (1, 1, 0, 1)
    assert s.delays == [2] and s.correct == 1
    s = score("t", [healthy, faulty], [[], [Alarm(o, o + 30)]])
    assert s.false_neg == 1 and s.spurious == 1


def test_sliding_window_baseline_finds_a_sustained_step_late():
    x = np.r_[np.ones(50), np.full(50, 1.3)]
    (a,) = sliding_window_alarms(x, 8, 0.10)
    assert 50 + 3 <= a.detected_at <= 50 + 8
