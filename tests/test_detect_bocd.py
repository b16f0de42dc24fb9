"""BOCD (the candidate generator and the plain baseline) and the step detector
built on it, on constructed series with known answers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from slurmguard.config import BocdPolicy
from slurmguard.detect.bocd import ALPHA0, KAPPA0, BatchBocd, detect_changepoints
from slurmguard.detect.steps import StepDetector, detect_steps


def _series(rng, before, after, level=1.0, jump=0.15, cv=0.02):
    return np.r_[level * (1 + rng.normal(0, cv, before)), level * (1 + jump) * (1 + rng.normal(0, cv, after))]


def test_15_percent_step_is_detected_within_3_iterations():
    rng = np.random.default_rng(1)
    x = _series(rng, 120, 60, level=2.5, jump=0.15)
    cps = detect_changepoints(x)
    assert len(cps) == 1
    c = cps[0]
    assert c.direction == "slower"
    assert abs(c.index - 120) <= 1
    assert c.detected_at - 120 <= 3
    assert c.relative_change == pytest.approx(0.15, abs=0.03)
    assert c.mean_before == pytest.approx(2.5, rel=0.02)
    assert c.mean_after == pytest.approx(2.875, rel=0.02)


def test_5_percent_step_is_rejected_as_jitter():
    rng = np.random.default_rng(2)
    x = _series(rng, 120, 120, jump=0.05)
    assert detect_changepoints(x) == []
    # the same step with verification off is reported: BOCD saw it, the check rejected it
    assert any(c.index >= 115 for c in detect_changepoints(x, verify=False))


def test_gc_pauses_and_checkpoints_are_not_fail_slows():
    rng = np.random.default_rng(3)
    x = 1.0 + rng.normal(0, 0.02, 400)
    x[::37] += 0.6  # GC pauses
    x[100::100] += 3.0  # checkpoints
    x[101::100] += 0.5  # a GC right after the checkpoint
    x[:15] *= 1 + 0.8 * np.exp(-np.arange(15) / 4)  # warm-up
    assert [c for c in detect_changepoints(x) if c.direction == "slower"] == []


def test_onset_and_recovery_form_one_episode():
    rng = np.random.default_rng(4)
    x = np.r_[rng.normal(1, 0.02, 80), rng.normal(1.3, 0.02, 40), rng.normal(1, 0.02, 80)]
    det = detect_steps(x)
    assert [c.direction for c in det.change_points] == ["slower", "faster"]
    (ep,) = det.episodes
    assert abs(ep.onset - 80) <= 1 and abs(ep.recovery - 120) <= 1
    assert ep.detected_at - ep.onset <= 4 and ep.recovered_at - ep.recovery <= 4
    assert ep.slowdown == pytest.approx(0.3, abs=0.04)


def test_literal_r0_rule_never_fires_because_posterior_equals_hazard():
    rng = np.random.default_rng(5)
    x = _series(rng, 60, 60, jump=1.0).reshape(1, -1)
    det = BatchBocd(1, BocdPolicy(), rule="r0")
    assert det.run(x) == []
    assert det.max_r0 == pytest.approx(BocdPolicy().hazard, rel=1e-6)


def test_short_mass_rule_also_detects_a_clear_step():
    rng = np.random.default_rng(6)
    cps = detect_changepoints(_series(rng, 100, 50, jump=0.3), rule="short_mass")
    assert len(cps) == 1 and abs(cps[0].index - 100) <= 1


def _reference_posterior(y, R, hazard, beta0):
    """Textbook Adams-MacKay (float64, no truncation) in the same convention:
    P[j] = P(current run holds the last j+1 samples)."""
    from scipy.special import gammaln

    P = np.array([1.0])
    mu = np.array([(KAPPA0 * y[0] + y[0]) / (KAPPA0 + 1)])
    kap = np.array([KAPPA0 + 1.0])
    alp = np.array([ALPHA0 + 0.5])
    bet = np.array([beta0])
    mu0 = y[0]
    for x in y[1:]:

        def logt(m, k, a, b, x=x):
            nu = 2 * a
            s2 = b * (k + 1) / (a * k)
            return (
                gammaln((nu + 1) / 2)
                - gammaln(nu / 2)
                - 0.5 * np.log(nu * np.pi * s2)
                - (nu + 1) / 2 * np.log1p((x - m) ** 2 / (nu * s2))
            )

        g = P * np.exp(logt(mu, kap, alp, bet)) * (1 - hazard)
        c = hazard * np.exp(logt(mu0, KAPPA0, ALPHA0, beta0))
        P = np.r_[c, g]
        P /= P.sum()
        mu, kap, alp, bet = (
            np.r_[(KAPPA0 * mu0 + x) / (KAPPA0 + 1), (kap * mu + x) / (kap + 1)],
            np.r_[KAPPA0 + 1, kap + 1],
            np.r_[ALPHA0 + 0.5, alp + 0.5],
            np.r_[
                beta0 + KAPPA0 * (x - mu0) ** 2 / (2 * (KAPPA0 + 1)),
                bet + kap * (x - mu) ** 2 / (2 * (kap + 1)),
            ],
        )
    return P


def test_batched_kernel_matches_textbook_recursion():
    rng = np.random.default_rng(7)
    x = np.r_[rng.normal(1, 0.02, 12), rng.normal(1.2, 0.02, 6)]
    pol = BocdPolicy(max_run_length=64)
    det = BatchBocd(1, pol, verify=False, dtype=np.float64)
    det.pending[:] = -1
    for v in x:
        det._kernel(np.log(np.array([v])))
        det.count += 1
        if det.count[0] == 1:
            det._reset_rows(np.array([0]), np.log(np.array([[v]])))
    ref = _reference_posterior(np.log(x), 64, pol.hazard, ALPHA0 * pol.prior_cv**2)
    got = det.posterior[: ref.size, 0]
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-12)


def test_many_series_at_once_match_one_at_a_time_and_missing_samples_wait():
    rng = np.random.default_rng(8)
    X = np.stack([_series(rng, 90, 60, level=lv, jump=j) for lv, j in ((0.5, 0.2), (3.0, 0.0), (1.0, 0.5))])
    batch = StepDetector(3).run(X)
    singles = [(i, c.index, c.direction) for i in range(3) for c in detect_changepoints(X[i])]
    assert sorted((c.series, c.index, c.direction) for c in batch) == sorted(singles)
    assert {s for s, _, d in singles if d == "slower"} == {0, 2}
    # series 1 misses every other sample: NaN leaves its state untouched
    det = StepDetector(3)
    Y = X.copy()
    Y[1, ::2] = np.nan
    out = det.run(Y)
    assert det.seen.tolist() == [150, 75, 150]
    assert {c.series for c in out if c.direction == "slower"} == {0, 2}


def test_cli_steptimes_prints_verified_changes(tmp_path):
    from slurmguard.cli import cli

    rng = np.random.default_rng(9)
    x = _series(rng, 100, 50, level=1.8, jump=0.25)
    f = tmp_path / "steps.csv"
    f.write_text("step_time_s\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    res = CliRunner().invoke(cli, ["detect", "steptimes", str(f)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    (cp,) = doc["change_points"]
    assert cp["direction"] == "slower" and abs(cp["index"] - 100) <= 1
    assert cp["mean_before"] == pytest.approx(1.8, rel=0.02)
    assert cp["mean_after"] == pytest.approx(2.25, rel=0.02)


def test_cli_steptimes_bad_input_names_file_and_line(tmp_path):
    from slurmguard.cli import main

    f = tmp_path / "bad.csv"
    f.write_text("1.0\n1.1\nfast\n")
    with pytest.raises(SystemExit) as exc:
        main(["detect", "steptimes", str(f)])
    assert exc.value.code == 2
    g = tmp_path / "neg.csv"
    g.write_text("1.0\n-2\n")
    res = CliRunner().invoke(
        __import__("slurmguard.cli", fromlist=["cli"]).cli, ["detect", "steptimes", str(g)]
    )
    assert res.exit_code != 0
    assert f"{g}:2" in str(res.exception)
