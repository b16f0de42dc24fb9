"""The step detector on series with the texture of real jobs, bad input, and the
online paths (agent analyzer, controller judgement) that run the same code."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from slurmguard.config import Policy
from slurmguard.detect.steps import DetectorConfig, StepDetector, detect_steps, learn_profile


def _pattern(n: int, period: int, long: float, base: float = 0.4) -> np.ndarray:
    """Every `period`-th step `long` x the others (gradient accumulation)."""
    x = np.full(n, base)
    if period > 1:
        x[period - 1 :: period] *= long
    return x


def _noisy(rng, x: np.ndarray, cv: float) -> np.ndarray:
    return x * (1.0 + rng.normal(0.0, cv, x.size))


@pytest.mark.parametrize("period", [2, 3, 5, 8])
def test_step_pattern_is_learned_not_mistaken_for_noise(period):
    rng = np.random.default_rng(period)
    y = np.log(_noisy(rng, _pattern(32, period, 1.6), 0.02))
    pr = learn_profile(y, 8)
    assert pr.period == period
    assert pr.scale == pytest.approx(0.02, rel=0.5)
    # pure noise has no pattern
    assert learn_profile(np.log(_noisy(rng, np.ones(32), 0.03)), 8).period == 1


@pytest.mark.parametrize("period,shift", [(2, 0.10), (3, 0.12), (7, 0.15)])
def test_moderate_shift_under_a_step_pattern_is_found_located_and_timed(period, shift):
    rng = np.random.default_rng(10 + period)
    x = _noisy(rng, _pattern(300, period, 1.8), 0.01)
    x[150:] *= 1.0 + shift
    det = detect_steps(x)
    (ep,) = det.episodes
    assert det.profile.period == period
    assert abs(ep.onset - 150) <= 1 and ep.open
    assert ep.onset <= ep.detected_at <= 150 + 5
    assert ep.slowdown == pytest.approx(shift, abs=0.03)
    assert [c.direction for c in det.change_points] == ["slower"]
    assert det.change_points[0].detected_at == ep.detected_at


def test_checkpoints_outliers_and_heavy_tails_start_and_end_nothing():
    rng = np.random.default_rng(20)
    n_eps = 0
    for trial in range(20):
        x = _noisy(rng, _pattern(400, 3, 1.5, base=rng.uniform(0.05, 5)), rng.uniform(0.005, 0.04))
        every = int(rng.integers(20, 201))
        x[every::every] *= rng.uniform(2.5, 4.0)  # checkpoint pauses
        hit = rng.random(400) < 0.05  # isolated outliers
        x[hit] *= rng.uniform(1.3, 3.0, hit.sum())
        x *= np.exp(0.01 * np.clip(rng.standard_t(3, 400), -8, 8))  # heavy tail
        eps = detect_steps(x).episodes
        # at most a run of outliers that returns (an episode with its recovery),
        # never a slowdown left open or one that lasts
        assert all(not e.open and e.recovery - e.onset <= 8 for e in eps), (trial, eps)
        n_eps += len(eps)
    assert n_eps <= 1


def test_short_excursion_is_nothing_or_an_episode_with_its_recovery_never_open():
    rng = np.random.default_rng(30)
    for length in (1, 2, 3, 5, 8):
        x = _noisy(rng, _pattern(200, 2, 1.4), 0.015)
        x[120 : 120 + length] *= 1.8
        eps = detect_steps(x).episodes
        assert all(not e.open for e in eps), length
        if length <= 3:
            assert eps == [], length
        for e in eps:
            assert 118 <= e.onset <= 121 and 120 + length - 1 <= e.recovery <= 120 + length + 1
            assert e.recovered_at >= e.recovery


def test_only_slowing_is_never_a_recovery():
    rng = np.random.default_rng(40)
    # slows by 20%, then by 30% more: two slower changes, one open episode
    x = _noisy(rng, np.ones(300), 0.02)
    x[120:] *= 1.2
    x[200:] *= 1.3
    det = detect_steps(x)
    assert [c.direction for c in det.change_points] == ["slower", "slower"]
    (ep,) = det.episodes
    assert ep.open and ep.slowdown == pytest.approx(1.2 * 1.3 - 1, abs=0.05)
    # slows by 50%, then improves to +25%: faster, but still slow: not a recovery
    y = _noisy(rng, np.ones(300), 0.01)
    y[100:] *= 1.5
    y[200:] /= 1.2
    det = detect_steps(y)
    (ep,) = det.episodes
    assert ep.open and ep.level_s == pytest.approx(1.25, rel=0.03)
    # a job that gets faster while healthy has a new baseline, no episode
    z = _noisy(rng, np.ones(300), 0.01)
    z[150:] *= 0.7
    det = detect_steps(z)
    assert det.episodes == [] and [c.direction for c in det.change_points] == ["faster"]


def test_a_faster_spell_of_a_healthy_job_does_not_move_its_baseline_a_lasting_one_does():
    """A healthy DDP restart on the shared host ran spells of 5-10 s at 36 ms
    against its usual 42 ms; its baseline moved to one 47 s in, and the rest of
    the run read as a string of +15% slowdowns. A faster level while healthy
    becomes the baseline only once it has held FASTER_HOLD_S seconds."""
    from slurmguard.detect.steps import FASTER_HOLD_S

    rng = np.random.default_rng(21)
    x = _noisy(rng, np.full(4000, 0.042), 0.02)
    for lo, hi in ((1200, 1400), (2000, 2250), (3000, 3150)):  # 8.4, 10.5 and 6.3 s
        x[lo:hi] *= 36 / 42
    det = detect_steps(x)
    assert det.change_points == [] and det.episodes == [], det.change_points
    # a faster level that holds is the job getting faster: a new baseline once
    # it has held FASTER_HOLD_S, and what follows is judged against it
    y = _noisy(rng, np.full(4000, 0.042), 0.02)
    y[1200:] *= 36 / 42
    y[3500:] *= 1.3  # then a slowdown, against the new baseline
    det = detect_steps(y)
    first, second = det.change_points
    assert first.direction == "faster" and abs(first.index - 1200) <= 2
    held = float(np.sum(y[first.index : first.detected_at + 1]))
    assert FASTER_HOLD_S <= held <= FASTER_HOLD_S + 1.0
    assert first.level_after == pytest.approx(0.036, rel=0.03)
    assert second.direction == "slower" and abs(second.index - 3500) <= 2
    (ep,) = det.episodes
    assert ep.open and ep.baseline == pytest.approx(0.036, rel=0.03)
    # the start-up settling (a faster level inside warm-up + 2 x learn samples)
    # is the baseline after the usual wait, not FASTER_HOLD_S
    z = _noisy(rng, np.full(400, 0.042), 0.02)
    z[:50] *= 1.4
    det = detect_steps(z)
    assert [c.direction for c in det.change_points] == ["faster"]
    assert det.change_points[0].detected_at < 100 and det.episodes == []


def test_bad_samples_are_gaps_and_degenerate_series_give_defined_results():
    rng = np.random.default_rng(50)
    x = _noisy(rng, np.ones(200), 0.01)
    x[100:] *= 1.3
    clean = detect_steps(x)
    dirty = x.copy()
    holes = [20, 60, 130]
    dirty[holes] = [np.nan, 0.0, -1.0]
    dirty = np.insert(dirty, [80, 170], [np.inf, 1e9])
    d = detect_steps(dirty)
    assert d.ignored == 5 and d.samples == 202
    assert [(c.direction) for c in d.change_points] == [c.direction for c in clean.change_points]
    # shorter than warm-up + learning: nothing, and a note saying why
    short = detect_steps(x[:20])
    assert short.change_points == [] and short.episodes == [] and "needs" in short.note
    assert detect_steps([]).change_points == []
    # one constant value, tiny or huge: a baseline, no change
    for v in (1e-6, 2.5, 5e4):
        c = detect_steps(np.full(100, v))
        assert c.change_points == [] and c.profile.seconds(c.profile.level) == pytest.approx(v)
    # all invalid
    assert detect_steps([np.nan] * 50).profile is None


def test_online_feeding_matches_offline_and_reports_detected_at():
    rng = np.random.default_rng(60)
    x = _noisy(rng, _pattern(250, 4, 1.7), 0.02)
    x[140:] *= 1.25
    offline = detect_steps(x).change_points
    det = StepDetector(1, DetectorConfig.from_policy(Policy()))
    online = []
    for t, v in enumerate(x):
        for cp in det.update(np.array([v])):
            assert cp.detected_at == t  # reported on the sample at which it was known
            online.append(cp)
    assert online == offline
    assert det.baseline_s() == pytest.approx(x[40:140].mean(), rel=0.03)
    assert det.level_s() == pytest.approx(1.25 * det.baseline_s(), rel=0.03)


def test_known_baseline_judges_a_window_that_starts_slow():
    """The controller's view: the report window starts after the onset."""
    rng = np.random.default_rng(70)
    x = _noisy(rng, _pattern(60, 2, 1.5), 0.01) * 1.3
    det = StepDetector(1, baseline_s=np.array([_pattern(2, 2, 1.5).mean()]), warmup=0)
    det.run(x[None, :])
    ep = det.open_episode()
    assert ep is not None and ep.onset == 0 and ep.slowdown == pytest.approx(0.3, abs=0.03)
    healthy = StepDetector(1, baseline_s=np.array([_pattern(2, 2, 1.5).mean()]), warmup=0)
    healthy.run(_noisy(rng, _pattern(60, 2, 1.5), 0.01)[None, :])
    assert healthy.open_episode() is None
    assert healthy.level_s() == pytest.approx(healthy.baseline_s())


def test_controller_reads_patterns_checkpoints_and_hiccups_like_the_detector():
    from slurmguard.controller.assess import assess_job
    from slurmguard.wire import RankReport, StepSample

    pol = Policy()

    def rank(rank: int, x: np.ndarray, base: float) -> RankReport:
        t, steps = 1000.0, []
        for v in x:
            t += v
            steps.append(StepSample(end=t, step_s=float(v), comm_s=0.1 * float(v)))
        return RankReport(
            rank=rank,
            baseline_step_s=base,
            baseline_compute_s=0.9 * base,
            steps=steps,
            total_steps=len(x) + 500,
            last_progress=t,
        )

    rng = np.random.default_rng(80)
    x = _noisy(rng, _pattern(200, 3, 2.0, base=0.5), 0.01)
    x[100::40] *= 3.5  # checkpoints
    x[190:193] *= 1.8  # a hiccup in the last steps: not a slowdown yet
    base = _pattern(3, 3, 2.0, base=0.5).mean()
    now = rank(0, x, base).last_progress + 1.0
    a = assess_job(1, ("n1", "n2"), [("n1", rank(0, x, base)), ("n2", rank(1, x, base))], {}, pol, now=now)
    # the last five steps' median would say +50% or more; the detector says healthy
    assert a.slowdown == pytest.approx(0.0, abs=0.02) and a.onset is None
    y = x.copy()
    y[190:193] /= 1.8
    y[150:] *= 1.15
    now = rank(0, y, base).last_progress + 1.0
    a = assess_job(1, ("n1", "n2"), [("n1", rank(0, y, base)), ("n2", rank(1, y, base))], {}, pol, now=now)
    r = rank(0, y, base)
    assert a.slowdown == pytest.approx(0.15, abs=0.03)
    assert a.onset == pytest.approx(r.steps[150].end - r.steps[150].step_s, abs=1.0)


def _intermittent(rng, n: int, onset: int, share: float, factor: float, end: int | None = None) -> np.ndarray:
    """A CPU quota's texture from `onset` (to `end`): `share` of the iterations,
    drawn at random, `factor` x slower and the rest as before."""
    x = _noisy(rng, _pattern(n, 2, 1.3, base=0.03), 0.02)
    hit = np.zeros(n, bool)
    hit[onset:end] = rng.random((end or n) - onset) < share
    x[hit] *= factor
    return x


@pytest.mark.parametrize(("share", "factor"), [(0.2, 4.0), (0.35, 2.5), (0.45, 1.8)])
def test_an_intermittent_slowdown_is_one_open_episode_at_its_mean(share, factor):
    """Under half the iterations slowed: the median does not move, the mean
    does (by share x (factor - 1), the throughput lost). The old detector saw
    nothing, or episodes that opened and "recovered" in turns; now one stays
    open at the mean step, reported within 80 iterations of the onset."""
    rng = np.random.default_rng(90)
    for _ in range(4):
        x = _intermittent(rng, 500, 200, share, factor)
        eps = detect_steps(x).episodes
        assert all(e.onset >= 190 for e in eps), eps  # nothing before it
        (ep,) = [e for e in eps if e.open]
        assert ep.detected_at <= 280, eps
        lost = float(np.mean(x[300:]) / np.mean(x[:200]))
        assert ep.level_s / ep.baseline == pytest.approx(lost, rel=0.15)
        assert len(eps) <= 2, eps  # at most one early "recovery" of the median's


def test_an_intermittent_slowdown_that_ends_is_recovered():
    rng = np.random.default_rng(91)
    for _ in range(4):
        x = _intermittent(rng, 500, 200, 0.3, 3.0, end=330)
        eps = detect_steps(x).episodes
        assert eps and not any(e.open for e in eps), eps
        last = eps[-1]
        # back after its last slowed iteration, known once they have all left the
        # recovery window (8 verify windows: a lull is not an end)
        assert 300 <= last.recovery <= 335 and last.recovered_at <= 330 + 70, last


def test_healthy_outliers_and_checkpoints_are_the_healthy_mean_not_an_intermittent_slowdown():
    """5% of the steps 1.3-3x and a 3x checkpoint every 25: a healthy mean 10-15%
    above the median, learned as the series goes, never a slowdown."""
    rng = np.random.default_rng(92)
    for _ in range(10):
        x = _noisy(rng, _pattern(600, 2, 1.3, base=0.03), 0.02)
        x[25::25] *= 3.0
        hit = rng.random(600) < 0.05
        x[hit] *= rng.uniform(1.3, 3.0, hit.sum())
        det = StepDetector(1)
        det.run(x[None, :])
        assert not any(e.open for e in det.episodes()), det.episodes()
        assert det.baseline_mean_s() > 1.05 * det.baseline_s()


def test_controller_judges_an_intermittent_slowdown_against_the_agents_healthy_mean():
    """The controller's view of a report window inside an intermittent slowdown:
    the agent's healthy mean (RankReport.baseline_mean_s) is the reference, so
    a job whose healthy mean carries its checkpoints is not slow for them."""
    from slurmguard.controller.assess import _judge_steps
    from slurmguard.wire import RankReport, StepSample

    def rank(x: np.ndarray, base: float, mean: float | None) -> RankReport:
        t, steps = 1000.0, []
        for v in x:
            t += v
            steps.append(StepSample(end=t, step_s=float(v), comm_s=0.0))
        return RankReport(
            rank=0, baseline_step_s=base, baseline_mean_s=mean, steps=steps, total_steps=len(x) + 500
        )

    rng = np.random.default_rng(93)
    base = _pattern(2, 2, 1.3, base=0.03).mean()
    slow = _intermittent(rng, 160, 0, 0.35, 3.0)
    current, onset, _ = _judge_steps([rank(slow, base, 1.02 * base)], Policy(), None)
    assert onset is not None and current / base == pytest.approx(np.mean(slow) / base, rel=0.15)
    # its own texture, learned by its agent: a quarter of its steps 2.5x (data
    # loader stalls), a healthy mean 37% above its median
    healthy = _intermittent(rng, 160, 0, 0.25, 2.5)
    current, onset, _ = _judge_steps([rank(healthy, base, 1.37 * base)], Policy(), None)
    assert onset is None and current == pytest.approx(base, rel=0.05)
    # without the agent's healthy mean, the same window is a slowdown of a third
    current, onset, _ = _judge_steps([rank(healthy, base, None)], Policy(), None)
    assert onset is not None and current / base == pytest.approx(np.mean(healthy) / base, rel=0.1)


def test_cli_prints_episodes_profile_and_detected_at(tmp_path):
    from slurmguard.cli import cli

    rng = np.random.default_rng(90)
    x = _noisy(rng, _pattern(200, 2, 1.6, base=0.3), 0.01)
    x[120:123] *= 1.8  # 3-step hiccup: not an open slowdown
    x[150:] *= 1.2
    f = tmp_path / "steps.csv"
    f.write_text("step_s\n" + "\n".join(f"{v:.6f}" for v in x) + "\n")
    res = CliRunner().invoke(cli, ["detect", "steptimes", str(f)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["profile"]["period"] == 2
    (ep,) = doc["episodes"]
    assert abs(ep["onset"] - 150) <= 1 and ep["recovery"] is None and ep["detected_at"] >= ep["onset"]
    assert ep["slowdown"] == pytest.approx(0.2, abs=0.03)
    res = CliRunner().invoke(cli, ["detect", "steptimes", "--plain", str(f)])
    assert res.exit_code == 0 and json.loads(res.output)["detector"].startswith("plain BOCD")


def test_cli_bad_rows_name_the_line_or_become_gaps(tmp_path):
    from slurmguard.cli import cli

    f = tmp_path / "bad.csv"
    f.write_text("1.0\n1.1\nnan\n0\n1e9\n")
    res = CliRunner().invoke(cli, ["detect", "steptimes", str(f)])
    assert res.exit_code != 0 and f"{f}:3" in str(res.exception) and "--skip-invalid" in str(res.exception)
    res = CliRunner().invoke(cli, ["detect", "steptimes", "--skip-invalid", str(f)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output[res.output.index("{") :])
    assert doc["skipped_invalid_rows"] == 3 and doc["episodes"] == [] and "needs" in doc["note"]


def test_recorded_series_load_with_their_labels_and_score(tmp_path):
    from slurmguard.errors import InputError
    from slurmguard_dev.bench.detect import run_detector
    from slurmguard_dev.bench.detect_baselines import score
    from slurmguard_dev.bench.detect_scenarios import load_recorded, load_recorded_dir

    rng = np.random.default_rng(100)
    x = _noisy(rng, _pattern(300, 2, 1.3, base=0.09), 0.02)
    x[180:] *= 1.35
    body = "\n".join(f"{v:.6f}" for v in x)
    (tmp_path / "cpu_cap.csv").write_text(
        "# source: synthetic stand-in for a recorded DDP job, node2 CPU cap at step 180\n"
        "# kind: shift\n# onset: 180\nstep_s\n" + body + "\n"
    )
    (tmp_path / "healthy.csv").write_text("# kind: healthy\n" + "\n".join(f"{v:.6f}" for v in x[:180]) + "\n")
    sc = load_recorded(tmp_path / "cpu_cap.csv")
    assert sc.onsets == (180,) and sc.positives == (180,) and sc.severity == pytest.approx(0.35, abs=0.05)
    assert "recorded" in sc.textures
    suite = load_recorded_dir(tmp_path)
    assert [s.kind for s in suite] == ["shift", "healthy"]
    reps, _ = run_detector(suite, DetectorConfig.from_policy(Policy()))
    s = score("rec", suite, reps)
    assert (s.false_neg, s.false_pos) == (0, 0) and s.delays and s.delays[0] <= 5
    bad = tmp_path / "bad" / "x.csv"
    bad.parent.mkdir()
    bad.write_text("# onset: 900\n1.0\n1.0\n")
    with pytest.raises(InputError, match="outside the series"):
        load_recorded(bad)
