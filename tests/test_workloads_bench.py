"""`slurmguard bench loop` pieces that need no cluster: the --fault grammar, the
offline detector baseline on a step series, the median/worst cells, and the
cap calibration rule."""

from __future__ import annotations

import click
import numpy as np
import pytest

from slurmguard_dev.bench.loop import _fmt, _offline_delays, parse_fault, target_s
from slurmguard_dev.devcluster.fault import FaultError, cap_for_slowdown
from slurmguard_dev.devcluster.scenario import _next_cap


def test_fault_grammar():
    assert parse_fault("cpu:20") == ("percent", 20.0)
    assert parse_fault("cpu:x2.5") == ("factor", 2.5)
    for bad in ("cpu:0.5", "cpu:x1", "cpu:", "gpu:20", "cpu:abc", "20"):
        with pytest.raises(click.BadParameter, match="cpu:PERCENT"):
            parse_fault(bad)


def test_offline_baseline_finds_a_step_change_soon_after_onset():
    rng = np.random.default_rng(3)
    healthy = 0.1 + rng.normal(0, 0.004, 80)
    slow = 0.25 + rng.normal(0, 0.01, 40)
    bocd, window = _offline_delays(list(healthy) + list(slow), 80)
    assert bocd is not None and 0 <= bocd <= 5
    assert window is not None and 0 <= window <= 10
    # no change: nothing after the (pretend) onset
    assert _offline_delays(list(healthy) + list(0.1 + rng.normal(0, 0.004, 40)), 80)[0] is None


def test_cells_say_median_worst_and_misses():
    assert _fmt([2.0, 4.0, 3.0], "s") == "3.0/4.0s"
    assert _fmt([5, None, 7]) == "6/7 (1 missed)"
    assert _fmt([None, None]) == "none"


def test_the_drain_target_adds_the_price_a_severe_slowdown_pays_while_running():
    """Issue 12's severe target at the dev policy (reports every 1 s, drain at
    0.3 GPU-s): a 2-rank job slowed 38 -> 107 ms pays 2 x 69 ms of rent a
    107 ms step, so the price takes 0.23 s: 3 x 0.107 + 2 + 0.23 s. Four ranks
    pay it twice as fast. Under 2x the moderate target (60 s); no step under
    the fault, no target."""
    price_s = 0.3 / (2 * 0.069 / 0.107)
    assert target_s(0.038, 0.107, 2) == pytest.approx(3 * 0.107 + 2 + price_s)
    assert target_s(0.038, 0.107, 4) == pytest.approx(3 * 0.107 + 2 + price_s / 2)
    assert target_s(0.04, 0.05, 2) == 60.0
    assert np.isnan(target_s(0.04, float("nan"), 2))


def test_cap_for_slowdown():
    assert cap_for_slowdown(0.8, 2.0) == pytest.approx(40.0)
    assert cap_for_slowdown(0.01, 4.0) == 1.0  # the kernel's minimum quota
    with pytest.raises(FaultError, match="above 1"):
        cap_for_slowdown(0.5, 1.0)


def test_calibration_follows_a_flat_response_to_the_target():
    # the CI run that left a pipeline at 1.16x: 54% -> 1.14x, 48% -> 1.16x for 1.3x
    assert _next_cap([(54.0, 1.14)], 1.3) == pytest.approx(54.0 * 1.14 / 1.3)
    # the secant wants 12%, far past the proportional step (48 -> 42.8): at most twice it
    nxt = _next_cap([(54.0, 1.14), (48.0, 1.16)], 1.3)
    assert nxt == pytest.approx(48.0 - 2 * (48.0 - 48.0 * 1.16 / 1.3))
    # a steep response: the secant's smaller step, at least half the proportional one
    steep = _next_cap([(60.0, 1.08), (54.0, 1.22)], 1.3)
    prop = 54.0 - 54.0 * 1.22 / 1.3
    assert 54.0 - 2 * prop <= steep <= 54.0 - 0.5 * prop
    assert steep == pytest.approx(54.0 - (1.3 - 1.22) * 6.0 / 0.14)
    # noise that slopes the wrong way (a tighter cap, faster steps): proportional
    assert _next_cap([(54.0, 1.20), (48.0, 1.15)], 1.3) == pytest.approx(48.0 * 1.15 / 1.3)
    # past the tier (40% -> 1.81x for 1.3x): loosened, proportionally
    assert _next_cap([(40.0, 1.81)], 1.3) == pytest.approx(40.0 * 1.81 / 1.3)
    # never below the kernel's minimum quota
    assert _next_cap([(2.0, 1.01)], 3.0) == 1.0
