"""Simulator and metrics on hand-built 1F1B traces with known answers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from slurmguard.whatif.analysis import (
    Counterfactual,
    ScenarioRunner,
    analyse,
    idealised_durations,
    simulation_durations,
)
from slurmguard.whatif.model import build_model
from slurmguard.whatif.simulate import simulate, simulate_naive
from slurmguard.whatif_policy import WhatIfPolicy
from tests.fixtures.whatif import (
    Durations,
    closed_form_1f1b,
    load_case,
    make_trace,
    noisy_compute,
    scaled_compute,
)

DP, PP, MB, STEPS = 2, 4, 4, 2


def test_uniform_trace_has_no_slowdown_and_matches_1f1b_closed_form():
    d = Durations()
    t = load_case(*make_trace(DP, PP, MB, STEPS, d))
    r = analyse(t)
    expected = closed_form_1f1b(PP, MB, 1.0, 2.0, d)
    assert r.t_ideal == pytest.approx(expected, rel=1e-12)
    assert r.t_original == pytest.approx(expected, rel=1e-12)
    assert r.t_actual == pytest.approx(expected, rel=1e-12)
    assert r.slowdown == pytest.approx(1.0, abs=1e-12)
    assert r.waste == pytest.approx(0.0, abs=1e-12)
    assert all(v == pytest.approx(1.0) for v in r.by_optype.values())
    np.testing.assert_allclose(r.worker_slowdown, 1.0)
    assert r.mw == 0.0 and r.ms == 0.0
    assert r.diagnosis.pattern == "none"


def test_single_slow_worker_is_named_and_explains_the_slowdown():
    # worker (dp 1, stage 1) runs every compute op twice as long
    d = Durations(compute=scaled_compute(lambda st, q, s, mb: 2.0 if (q, s) == (1, 1) else 1.0))
    t = load_case(*make_trace(DP, PP, MB, STEPS, d))
    r = analyse(t)
    # ideal compute = mean over the 8 workers: 9/8 of the base durations
    ideal = closed_form_1f1b(PP, MB, 9 / 8, 2 * 9 / 8, d)
    assert r.t_ideal == pytest.approx(ideal, rel=1e-12)
    # the dependency model reproduces the recorded timeline exactly
    assert r.discrepancy == pytest.approx(0.0, abs=1e-12)
    assert r.slowdown == pytest.approx(r.t_actual / ideal, rel=1e-12)
    assert r.slowdown > 1.15
    assert int(np.argmax(r.by_dp_rank)) == 1 and int(np.argmax(r.by_stage)) == 1
    assert r.by_dp_rank[0] == pytest.approx(1.0, abs=1e-9)
    assert [(w.dp_rank, w.stage, w.rank) for w in r.top_workers] == [(1, 1, 3)]
    # fixing that worker to the (higher than base) mean recovers more than the gap
    assert r.mw >= 1.0
    assert r.diagnosis.pattern == "worker"
    assert r.by_optype["forward-compute"] > 1.03 and r.by_optype["backward-compute"] > 1.03
    assert r.by_optype["params-all-gather"] == pytest.approx(1.0)


def test_slow_last_stage_is_attributed_to_the_last_stage():
    d = Durations(compute=scaled_compute(lambda st, q, s, mb: 1.5 if s == PP - 1 else 1.0))
    t = load_case(*make_trace(DP, PP, MB, STEPS, d))
    r = analyse(t)
    assert r.discrepancy == pytest.approx(0.0, abs=1e-12)
    assert int(np.argmax(r.by_stage)) == PP - 1
    assert r.by_stage[PP - 1] > 1.1 and r.by_stage[: PP - 1].max() < 1.0
    # every DP rank has the same slow stage: no DP rank stands out
    assert r.by_dp_rank.max() - r.by_dp_rank.min() < 1e-9
    assert r.ms >= 1.0
    assert r.diagnosis.pattern == "last-stage"
    assert r.diagnosis.affected_workers == DP


def test_uniform_noise_blames_no_worker():
    d = Durations(compute=noisy_compute(seed=7, spread=0.4), p2p=0.01)
    t = load_case(*make_trace(4, 2, 8, 3, d))
    r = analyse(t, WhatIfPolicy(straggling_slowdown=1.0))
    assert r.discrepancy == pytest.approx(0.0, abs=1e-12)
    assert r.slowdown > 1.02
    assert r.mw < 0.5
    assert r.diagnosis.pattern in ("widespread", "mixed")
    assert r.diagnosis.pattern == "widespread"
    # the DP ranks share the blame
    excess = r.by_dp_rank - 1.0
    assert excess.min() > 0.25 * excess.max()


def test_vectorised_simulator_matches_the_per_op_event_loop():
    d = Durations(compute=noisy_compute(seed=3, spread=0.5), p2p=0.02)
    t = load_case(*make_trace(3, 3, 5, 3, d))
    model = build_model(t)
    dur = simulation_durations(t, model)
    fast = simulate(model, dur[:, None]).step_time[0]
    slow = simulate_naive(model, dur)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast, t.actual_step_times(), rtol=0, atol=1e-9)


def test_two_lane_dp_attribution_equals_full_lane_simulation():
    d = Durations(compute=noisy_compute(seed=5, spread=0.5), p2p=0.01)
    t = load_case(*make_trace(4, 2, 4, 2, d))
    model = build_model(t)
    orig = simulation_durations(t, model)
    runner = ScenarioRunner(t, model, orig, idealised_durations(t, orig), memory_mb=64)
    lanes = runner.run_dp_ranks([0, 1, 2, 3])
    full = []
    for q in range(4):
        wm = np.zeros((2, 4), dtype=bool)
        wm[:, q] = True
        full.append(Counterfactual(np.ones(t.n_slots, dtype=bool), wm))
    np.testing.assert_allclose(lanes, runner.run(full), rtol=0, atol=1e-12)


def test_chunking_does_not_change_results():
    d = Durations(compute=noisy_compute(seed=11, spread=0.3))
    t = load_case(*make_trace(2, 4, 4, 2, d))
    big = analyse(t, WhatIfPolicy(memory_mb=256))
    tiny = analyse(t, WhatIfPolicy(memory_mb=16))
    assert big.slowdown == tiny.slowdown
    np.testing.assert_array_equal(big.by_dp_rank, tiny.by_dp_rank)
    assert big.by_optype == tiny.by_optype


def test_unrecorded_launch_delay_shows_as_discrepancy():
    # 2 s of data loading before each step's first forward is not in the trace
    d = Durations(first_forward_delay=2.0)
    t = load_case(*make_trace(DP, PP, MB, STEPS, d))
    r = analyse(t)
    base = closed_form_1f1b(PP, MB, 1.0, 2.0, d)
    assert r.t_actual == pytest.approx(base + 2.0, rel=1e-12)
    assert r.discrepancy == pytest.approx(2.0 / (base + 2.0), rel=1e-9)
    assert not r.diagnosis.fidelity_ok


def test_transfer_duration_excludes_blocking_and_ideal_uses_median():
    # a slow stage-3 makes stage 2's backward-recv wait; its transfer-duration stays p2p
    d = Durations(compute=scaled_compute(lambda st, q, s, mb: 3.0 if s == 3 else 1.0), p2p=0.05)
    t = load_case(*make_trace(1, 4, 4, 1, d))
    model = build_model(t)
    dur = simulation_durations(t, model)
    recv = t.slots_of(2, "backward-recv")
    assert t.duration[recv].max() > 1.0
    np.testing.assert_allclose(dur[recv], 0.05, atol=1e-12)
    ideal = idealised_durations(t, dur)
    fwd = t.slot_optype == "forward-compute"
    assert ideal[fwd][0] == pytest.approx(t.duration[fwd].mean())
    assert ideal[recv][0] == pytest.approx(0.05)


def test_exact_worker_slowdown():
    d = Durations(compute=scaled_compute(lambda st, q, s, mb: 2.0 if (q, s) == (1, 1) else 1.0))
    t = load_case(*make_trace(DP, PP, MB, STEPS, d))
    r = analyse(t, exact_workers=True)
    ex = r.worker_slowdown_exact
    assert ex is not None and ex.shape == (PP, DP)
    assert np.unravel_index(np.argmax(ex), ex.shape) == (1, 1)
    # everyone else runs faster than the ideal (which includes the slow worker's share)
    assert np.delete(ex.ravel(), 1 * DP + 1).max() <= 1.0 + 1e-12
    # the DP-rank approximation keeps the rest of dp rank 1 at their fast durations
    assert ex[1, 1] >= r.by_dp_rank[1] - 1e-12
    # one DP rank: a worker is its stage, so the exact S_w equals S_w of the stage
    t1 = load_case(*make_trace(1, PP, MB, STEPS, d))
    r1 = analyse(t1, exact_workers=True)
    np.testing.assert_allclose(r1.worker_slowdown_exact[:, 0], r1.by_stage, rtol=0, atol=1e-12)


def test_two_lane_single_worker_scenarios_equal_full_lanes():
    d = Durations(compute=noisy_compute(seed=9, spread=0.5), p2p=0.01)
    t = load_case(*make_trace(3, 3, 3, 2, d))
    model = build_model(t)
    orig = simulation_durations(t, model)
    runner = ScenarioRunner(t, model, orig, idealised_durations(t, orig), memory_mb=64)
    cells = [(s, q) for s in range(3) for q in range(3)]
    lanes = runner.run_dp_ranks([q for _, q in cells], [t.slot_stage == s for s, _ in cells])
    full = []
    for s, q in cells:
        wm = np.zeros((3, 3), dtype=bool)
        wm[s, q] = True
        full.append(Counterfactual(np.ones(t.n_slots, dtype=bool), wm))
    np.testing.assert_allclose(lanes, runner.run(full), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "shape, axis",
    [((7,), None), ((6,), None), ((0,), None), ((5, 4, 3), (1, 2)), ((4, 6), 1), ((4, 6), -2), ((3, 0), 1)],
)
def test_median_is_numpys_without_numpy_ma(shape, axis):
    from slurmguard.whatif.tensor import median

    rng = np.random.default_rng(len(shape) * 10 + (0 if axis is None else 1))
    a = rng.normal(size=shape)
    if a.size > 3:
        a.flat[3] = np.nan  # NaN anywhere on the reduced axes makes the result NaN, as np.median
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 'mean of empty slice'
        want = np.median(a, axis=axis)
    got = median(a, axis=axis)
    np.testing.assert_array_equal(got, want)
    if axis is None:
        assert isinstance(got, float)
