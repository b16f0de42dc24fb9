"""The step-time detector: one implementation for the agent, the controller,
`slurmguard detect steptimes` and `slurmguard bench detect`.

Real step series are not a level plus Gaussian noise. Gradient accumulation or
an optimizer step every p micro-steps makes every p-th step longer; checkpoints
make one step 2.5-4x every few dozen; GC, allocator misses and data stalls give
isolated heavy-tailed outliers; a hiccup slows a few steps and returns. The
detector therefore works in three layers:

1. Profile (`learn_profile`). After `warmup` steps, the first `learn` steps give
   the step pattern: the period p (1 = none, up to `max_period`) whose per-phase
   medians explain the series best, the per-phase offsets (the "shape"), the
   baseline level and the robust noise scale (1.4826 MAD). Every later sample is
   compared like with like: z = log(step) - shape[phase], so a long optimizer
   step is not a slowdown and a 10% shift is the same +0.095 whatever the step.
2. Candidates: BOCD (Adams-MacKay, `BatchBocd`, MAP run-length drop rule) on z,
   winsorised around the current level, so one checkpoint cannot drag the
   model far; the MAP run also locates the change (the onset).
3. Verification (Greyhound 4.2's check, made sequential and robust): the
   median of the samples since the candidate against the current level, with
   its standard error from the learned noise. A slowdown is accepted once it
   is >= `verify_min_change` x 3/4 and significantly above the level, and the
   latest samples still hold it; it is rejected as soon as it is clearly below
   the bar or `verify_window` x 4 samples pass undecided. A median needs most of
   its samples moved (all of the first four, 60% after a window), so an outlier
   or a checkpoint never starts or ends an
   episode, and a change needs `verify_min_after` samples.
4. Intermittent slowdowns. A CPU quota throttles the iterations that cross
   its period and not the others; a link drops in and out: 15-50% of the
   iterations 2-5x slower, the rest as before. The median never moves (or
   moves, then "recovers" whenever a few fast ones come in a row), while the
   job loses a third of its throughput or more. So the mean is watched too,
   over TEXTURE_PARTS verify windows, against the series' healthy mean (its
   own outliers and checkpoints counted, following its healthy samples): a
   slowdown whose every part holds a slowed sample and one at the baseline,
   and whose mean without its slowest part clears 3/4 of the bar by
   `significance` standard errors, is an episode at its mean level until that
   mean is back within half the bar. A median verified slowdown whose median
   returns while such a mean holds stays open, as an intermittent one.

Episodes: while the level is at least `verify_min_change` above the baseline, a
slowdown stays open; a further rise is a second (compound) slowdown inside it;
a return to within half the bar of the baseline is the recovery, judged against
the baseline, not against the slow level, so a short excursion that returns is
an episode with its recovery, never an open slowdown. A faster level that does
not return to the baseline is reported as a faster change, not a recovery. A
speed-up while healthy moves the baseline once it has held FASTER_HOLD_S
seconds (4 verify windows in the start-up).

All series of a batch advance together (the bench runs thousands); the rare
work (learning, verification) runs per series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from slurmguard.config import BocdPolicy, Policy
from slurmguard.detect.bocd import BatchBocd, ChangePoint, feed_columns
from slurmguard.detect.stepfile import MAX_STEP_S

#: Relative noise floor: a constant series still has a defined scale (0.2%).
SIGMA_FLOOR = 0.002
#: Median efficiency: s.e. of a median of m samples is about 1.25 sigma / sqrt(m).
MEDIAN_SE = 1.2533
#: Winsorise BOCD's input at this many noise scales (at least WINSOR_MIN in log).
WINSOR_K = 5.0
WINSOR_MIN = math.log(1.15)
#: An intermittent slowdown (a CPU quota that throttles some iterations and
#: not others, a link that drops in and out) raises the mean step and leaves
#: the median where it was. It is judged over TEXTURE_PARTS x verify_window
#: samples: each of those parts must hold a moved sample, and TEXTURE_MOVED
#: of them in all, so a run of outliers in one part, or a burst of them, is not one.
TEXTURE_PARTS = 4
TEXTURE_MOVED = 4
#: The healthy mean step that reference is measured against follows the
#: healthy samples (those older than the texture window, while no slowdown is
#: open) with this memory, in samples: a job's own outliers and checkpoints
#: (5% of steps 2x and a 3x checkpoint every 25 steps put the mean 14% above
#: the median) are its healthy mean, not a slowdown.
HEALTHY_MEMORY = 256
#: A faster level found while healthy becomes the baseline only once it has
#: held this long (seconds of the series' own steps, and at least 4 verify
#: windows), unless it starts inside the start-up (the first warm-up + 2 x
#: learn samples, where a job settling is expected). A healthy job on a busy
#: host runs spells of 5-10 s some 15% faster than usual; a baseline moved to
#: one reads the rest of the run as a slowdown.
FASTER_HOLD_S = 30.0


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the step-time detector (all from the policy).

    warmup: steps skipped at the start of a series (agent.warmup_steps).
    learn: healthy steps that set the baseline and the step pattern
      (agent.baseline_steps); a period needs 3 samples per phase, so patterns
      up to min(max_period, learn // 3) are recognised (32 steps: up to 8).
    max_period: longest step pattern recognised (detection.bocd.max_period).
    """

    bocd: BocdPolicy
    warmup: int = 5
    learn: int = 32
    max_period: int = 8
    significance: float = 2.0

    @classmethod
    def from_policy(cls, policy: Policy | None = None) -> DetectorConfig:
        p = policy or Policy()
        return cls.from_parts(p.detection.bocd, p.agent.warmup_steps, p.agent.baseline_steps)

    @classmethod
    def from_parts(cls, bocd: BocdPolicy, warmup_steps: int, baseline_steps: int) -> DetectorConfig:
        """The same config from the policy sections the agent holds."""
        return cls(
            bocd=bocd,
            warmup=warmup_steps,
            learn=baseline_steps,
            max_period=bocd.max_period,
            significance=bocd.significance,
        )


@dataclass(frozen=True)
class Profile:
    """A series' healthy step pattern. shape: log offset of each phase (mean 0);
    level: log of the deseasonalised median step; scale: robust s.d. of log steps."""

    period: int
    shape: np.ndarray
    level: float
    scale: float

    @property
    def mean_factor(self) -> float:
        """Period-mean step / exp(level): turns a z-level into seconds per step."""
        return float(np.mean(np.exp(self.shape)))

    def seconds(self, z_level: float) -> float:
        """Mean step time over one period (seconds) at z-level `z_level`."""
        return float(math.exp(z_level) * self.mean_factor)


def _med(a: np.ndarray) -> float:
    """Median of a short 1-D array (np.median's overhead dominates at this size)."""
    srt = np.sort(a)
    m = srt.size
    return float(0.5 * (srt[(m - 1) // 2] + srt[m // 2]))


def _mad(a: np.ndarray) -> float:
    """Robust s.d.: 1.4826 x the median absolute deviation."""
    return 1.4826 * _med(np.abs(a - _med(a)))


def _loo_medians(v: np.ndarray) -> np.ndarray:
    """For each element, the median of the others (v has >= 2 elements)."""
    order = np.argsort(v, kind="stable")
    srt = v[order]
    m = v.size
    j = np.empty(m, np.int64)
    j[order] = np.arange(m)  # sorted position of each element
    L = m - 1

    def pick(k: int) -> np.ndarray:  # k-th of the others, sorted
        return np.where(k < j, srt[k], srt[min(k + 1, m - 1)])

    if L % 2:
        return pick(L // 2)
    return 0.5 * (pick(L // 2 - 1) + pick(L // 2))


def learn_profile(y: np.ndarray, max_period: int = 8, phase0: int = 0) -> Profile:
    """Profile of log step times `y` whose first sample has phase `phase0`.

    For each period p the residual of a sample is its distance from the median
    of the *other* samples of its phase (leave one out: with four samples a
    phase the in-sample median fits one exactly, which would favour long
    periods). A period's score is the mean absolute residual, each residual
    capped at 6 noise scales: a median-based scale would not see a pattern in
    which one phase of eight is long (it is a minority, like outliers), while
    the cap keeps checkpoints and outliers from deciding. The period is the
    smallest p scoring within 10% of the best, provided the best is at least 15%
    below the score without a pattern (a weak pattern under heavy noise is
    noise). Needs >= 3 samples per phase, so p <= len(y) // 3.
    """
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    if n == 0:
        raise ValueError("no samples to learn a profile from")
    idx0 = np.arange(phase0, phase0 + n)
    cap = 6.0 * max(_mad(y), SIGMA_FLOOR)
    scores: dict[int, float] = {}
    resid: dict[int, np.ndarray] = {}
    for p in range(1, max(1, min(max_period, n // 3)) + 1):
        ph = idx0 % p
        r = np.empty(n)
        for k in range(p):
            sel = ph == k
            r[sel] = y[sel] - _loo_medians(y[sel])
        resid[p] = r
        scores[p] = float(np.mean(np.minimum(np.abs(r), cap)))
    best = min(scores.values())
    period = 1
    if best < 0.85 * scores[1]:
        period = min(p for p, sc in scores.items() if sc <= 1.10 * best + 1e-12)
    ph = idx0 % period
    med = np.array([_med(y[ph == k]) for k in range(period)])
    shape = med - med.mean()
    z = y - shape[ph]
    # The noise scale: from the leave-one-out residuals (in-sample ones are too
    # small: a median of three fits one of them exactly), less the spread the
    # other samples' median adds (a median of g - 1 has variance ~1.57 s^2 / (g - 1));
    # or, when smaller, from same-phase differences, which a level shift inside
    # the window does not inflate.
    g = n / period
    loo = _mad(resid[period]) / math.sqrt(1.0 + 1.57 / max(g - 1.0, 1.0))
    scale = min(loo, _noise_scale(y, period))
    return Profile(period, shape, float(_med(z)), max(scale, SIGMA_FLOOR))


def _noise_scale(y: np.ndarray, period: int) -> float:
    """Noise s.d. of log steps from differences of consecutive same-phase steps:
    the step pattern cancels, and a level shift inside the window moves only
    `period` of the differences (the residuals of a one-level fit would all
    move). The mean absolute difference after dropping the largest 20%
    (outliers and checkpoints move two differences each) estimates the
    s.d.: for Gaussian noise it is 0.790 sigma."""
    d = np.abs(y[period:] - y[:-period])
    if d.size < 3:
        return _mad(y)
    k = max(1, int(math.floor(0.8 * d.size)))
    return float(np.mean(np.sort(d)[:k]) / 0.790)


@dataclass(frozen=True)
class Episode:
    """A slowdown of one series (sample indices; seconds per step over a period).

    onset: located first slow sample; detected_at: the sample at which the
    detector knew; slowdown: deepest level / baseline - 1; level_s: the level
    now (the last verified one); recovery: first sample back at the baseline
    (None while open); recovered_at: the sample at which the recovery was known.
    """

    onset: int
    detected_at: int
    slowdown: float
    baseline: float
    level_s: float
    recovery: int | None = None
    recovered_at: int | None = None
    series: int = 0

    @property
    def open(self) -> bool:
        return self.recovery is None

    @property
    def current_slowdown(self) -> float:
        return self.level_s / self.baseline - 1.0 if self.open else 0.0

    def to_dict(self) -> dict:
        return {
            "onset": self.onset,
            "detected_at": self.detected_at,
            "slowdown": round(self.slowdown, 4),
            "baseline_s": round(self.baseline, 6),
            "level_s": round(self.level_s, 6),
            "recovery": self.recovery,
            "recovered_at": self.recovered_at,
        }


@dataclass
class _Series:
    """Per-series state that only the rare paths touch."""

    learn_y: list = field(default_factory=list)
    profile: Profile | None = None
    episodes: list = field(default_factory=list)  # closed and open Episode objects
    open: Episode | None = None


LEARNING, HEALTHY, SLOW = 0, 1, 2


def valid_steps(x: np.ndarray) -> np.ndarray:
    """Mask of samples that are a step time: finite, > 0 and <= MAX_STEP_S seconds."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.isfinite(x) & (x > 0) & (x <= MAX_STEP_S)


class StepDetector:
    """Online detector over `n_series` step-time series (seconds per step).

    Feed one sample per series per `update` (NaN, inf, zero, negative or more
    than MAX_STEP_S = no sample for that series this time; it waits). Returns
    the change points verified by this sample; `episodes(i)` gives series i's
    slowdowns so far, `baseline_s(i)` / `level_s(i)` its healthy and current
    step time (seconds, mean over one period of its step pattern).

    baseline_s: optional known healthy step time per series (seconds; NaN =
    unknown). Given it, the step pattern is learned from the first `learn`
    samples but the level comes from the baseline, and those samples are then
    judged against it: the controller's view of a report window that may
    start inside a slowdown. baseline_mean_s: with it, the healthy mean step
    (seconds, outliers and checkpoints counted; baseline_mean_s() of the
    detector that learned the baseline) that an intermittent slowdown is
    measured against; NaN or absent: the baseline. warmup / learn override the config's lengths
    (a report window that does not start at the job's start has no warm-up).
    """

    def __init__(
        self,
        n_series: int = 1,
        config: DetectorConfig | None = None,
        *,
        baseline_s: np.ndarray | None = None,
        baseline_mean_s: np.ndarray | None = None,
        warmup: int | None = None,
        learn: int | None = None,
    ) -> None:
        if n_series < 1:
            raise ValueError("n_series must be >= 1")
        cfg = config or DetectorConfig.from_policy()
        self.cfg = cfg
        b = cfg.bocd
        self.n = n_series
        self.warmup = cfg.warmup if warmup is None else max(0, int(warmup))
        self.learn = cfg.learn if learn is None else max(3, int(learn))
        self.bocd = BatchBocd(n_series, b)
        self.W = b.verify_window
        self.max_wait = 4 * b.verify_window
        self.min_after = b.verify_min_after
        self.acc = math.log1p(0.75 * b.verify_min_change)  # a change must reach 3/4 of the bar
        self.half = 0.5 * self.acc
        self.rec = math.log1p(0.5 * b.verify_min_change)  # back within half the bar = recovered
        self.k = cfg.significance
        self.given = (
            np.full(n_series, np.nan)
            if baseline_s is None
            else np.asarray(baseline_s, dtype=np.float64).reshape(n_series)
        )
        P = cfg.max_period
        self.seen = np.zeros(n_series, np.int64)  # valid samples (incl. warm-up)
        self.state = np.zeros(n_series, np.int8)
        self.period = np.ones(n_series, np.int64)
        self.hshape = np.zeros((n_series, P))  # healthy per-phase log offsets
        self.shape = np.zeros((n_series, P))  # offsets of the current level
        self.base = np.zeros(n_series)  # healthy level (log, healthy shape)
        self.base_s = np.full(n_series, np.nan)  # healthy step time, seconds
        self.ref = np.zeros(n_series)  # current verified level (log, current shape)
        self.vlevel = np.zeros(n_series)  # level a slow episode was verified at
        self.peak = np.zeros(n_series)  # deepest slowdown of the episode's earlier levels
        self.sigma = np.full(n_series, SIGMA_FLOOR)
        self.regime = np.zeros(n_series, np.int64)  # first sample of the current level
        self.pending = np.full(n_series, -1, np.int64)  # candidate change, -1 = none
        self.rejected = np.full(n_series, -1, np.int64)
        self.fast_s = np.zeros(n_series)  # seconds a faster level has held while healthy
        self.fast_n = np.full(n_series, -1, np.int64)  # sample up to which fast_s counts
        self.fast_c = np.full(n_series, -1, np.int64)  # first sample of that faster spell
        self.refine = np.ones(n_series, bool)  # False: the level is a given baseline
        self.relearned = np.zeros(n_series, bool)  # the profile was learned a second time
        self.changed = np.zeros(n_series, bool)  # a change was verified
        self.T = TEXTURE_PARTS * self.W  # samples an intermittent slowdown is judged over
        self.tex = np.zeros(n_series, bool)  # the open episode is an intermittent slowdown
        self.base_mean = np.ones(n_series)  # healthy mean step / level (its own outliers), >= 1
        self.hsum = np.zeros(n_series)  # healthy mean's running sum and weight (HEALTHY_MEMORY)
        self.hcnt = np.zeros(n_series)
        self.quiet = np.ones(n_series, bool)  # no intermittent slowdown in the making (base_mean follows)
        self.given_mean = (
            np.full(n_series, np.nan)
            if baseline_mean_s is None
            else np.asarray(baseline_mean_s, dtype=np.float64).reshape(n_series)
        )
        self.hcap = max(4 * self.W, 8 * P, self.learn + 2, self.T + 2)
        self.z = np.full((n_series, self.hcap), np.nan)  # log step - current shape
        self.zh = np.full((n_series, self.hcap), np.nan)  # log step - healthy shape
        self.x = np.full((n_series, self.hcap), np.nan)  # the step times, seconds
        self._s = [_Series() for _ in range(n_series)]

    # ------------------------------------------------------------------ views
    def profile(self, i: int = 0) -> Profile | None:
        """The healthy step pattern as learned (None while learning)."""
        return self._s[i].profile

    def _sec(self, i: int, z_level: float, shape: np.ndarray | None = None) -> float:
        p = int(self.period[i])
        sh = (self.shape if shape is None else shape)[i, :p]
        return float(math.exp(z_level) * np.mean(np.exp(sh)))

    def baseline_s(self, i: int = 0) -> float | None:
        """Healthy step time (seconds, mean over a period), None while learning."""
        return None if self.state[i] == LEARNING else float(self.base_s[i])

    def baseline_mean_s(self, i: int = 0) -> float | None:
        """Healthy mean step time (seconds; outliers and checkpoints counted), None while learning."""
        return None if self.state[i] == LEARNING else float(self.base_s[i] * self.base_mean[i])

    def level_s(self, i: int = 0) -> float | None:
        """Current verified step time (seconds, mean over a period)."""
        return None if self.state[i] == LEARNING else self._sec(i, float(self.ref[i]))

    def episodes(self, i: int = 0) -> list[Episode]:
        s = self._s[i]
        return list(s.episodes) + ([s.open] if s.open is not None else [])

    def open_episode(self, i: int = 0) -> Episode | None:
        return self._s[i].open

    def learned(self, i: int = 0) -> bool:
        return bool(self.state[i] != LEARNING)

    # ------------------------------------------------------------------ feed
    def run(self, series: np.ndarray) -> list[ChangePoint]:
        """Feed a (n_series, T) matrix column by column; all verified changes."""
        return feed_columns(self.update, self.n, series)

    def update(self, x: np.ndarray) -> list[ChangePoint]:
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if x.shape != (self.n,):
            raise ValueError(f"expected {self.n} samples, got shape {x.shape}")
        ok = valid_steps(x)
        out: list[ChangePoint] = []
        learning = ok & (self.state == LEARNING)
        for i in np.nonzero(learning)[0]:
            out.extend(self._learn_sample(int(i), float(x[i])))
        live = ok & ~learning
        if live.any():
            out.extend(self._step(np.where(live, x, 1.0), live))
        return out

    # ------------------------------------------------------------------ learning
    def _learn_sample(self, i: int, x: float) -> list[ChangePoint]:
        s = self._s[i]
        self.seen[i] += 1
        if self.seen[i] <= self.warmup:
            return []
        s.learn_y.append(math.log(x))
        if len(s.learn_y) < self.learn:
            return []
        y = np.asarray(s.learn_y)
        s.learn_y = []
        n0 = int(self.seen[i]) - y.size
        pr = learn_profile(y, self.cfg.max_period, n0)
        given = self.given[i]
        known = bool(np.isfinite(given) and given > 0)
        if known:
            pr = Profile(pr.period, pr.shape, math.log(given) - math.log(pr.mean_factor), pr.scale)
        s.profile = pr
        p = pr.period
        self.period[i] = p
        self.shape[i, :p] = self.hshape[i, :p] = pr.shape
        self.base[i] = self.ref[i] = pr.level
        self.base_s[i] = pr.seconds(pr.level)
        self.sigma[i] = pr.scale
        self.state[i] = HEALTHY
        if not known:
            # the learned samples are the first level: keep them, start BOCD on them
            z = y - pr.shape[np.arange(n0, n0 + y.size) % p]
            pos = np.arange(n0, n0 + y.size) % self.hcap
            self.z[i, pos] = self.zh[i, pos] = z
            self.x[i, pos] = np.exp(y)
            self.regime[i] = n0
            j = self._split(z)
            if j is not None:
                lvl_a, lvl_b = _med(z[:j]), _med(z[j:])
                if lvl_b < lvl_a:
                    # faster inside the window (a warm-up longer than `warmup`):
                    # the later level is the baseline
                    self.base[i] = self.ref[i] = lvl_b
                    self.regime[i] = n0 + j
                    self.base_s[i] = self._sec(i, lvl_b)
                    z = z[j:]
                elif j >= 8:
                    # slower inside the window: the baseline is the level before,
                    # and the change is a candidate like any other
                    self.base[i] = self.ref[i] = lvl_a
                    self.base_s[i] = self._sec(i, lvl_a)
                    self.pending[i] = n0 + j
                    z = z[:j]
            self._set_base_mean(i, z - self.base[i])
            self.bocd.restart(np.array([i]), self._winsor(i, z)[None, :])
            return []
        # known baseline: BOCD starts from it, then the window is judged against it
        self.refine[i] = False
        gm = self.given_mean[i]
        self.base_mean[i] = max(1.0, float(gm / given)) if np.isfinite(gm) and gm > 0 else 1.0
        self.hsum[i], self.hcnt[i] = self.base_mean[i] * self.T, float(self.T)
        pseudo = pr.level + pr.scale * np.array([-1.0, 1.0] * 4)
        self.bocd.restart(np.array([i]), pseudo[None, :])
        self.seen[i] = n0
        self.regime[i] = n0 - pseudo.size
        out: list[ChangePoint] = []
        live = np.zeros(self.n, bool)
        live[i] = True
        for yy in y:
            xs = np.ones(self.n)
            xs[i] = math.exp(yy)
            out.extend(self._step(xs, live))
        return out

    def _split(self, z: np.ndarray) -> int | None:
        """A level change inside the learning window: the split whose two sides'
        medians differ by at least 3/4 of the bar, with most samples on each side
        on their own side of the midpoint; None if there is none."""
        n = z.size
        k = self.min_after
        best, best_j = 0.0, None
        for j in range(k, n - k + 1):
            a, b = _med(z[:j]), _med(z[j:])
            d = abs(b - a)
            if d < self.acc:
                continue
            mid = 0.5 * (a + b)
            hi_b = b > a
            wrong = np.sum((z[:j] > mid) == hi_b) + np.sum((z[j:] > mid) != hi_b)
            if wrong > 0.15 * n:
                continue
            stat = d * math.sqrt(j * (n - j) / n)
            if stat > best:
                best, best_j = stat, j
        return best_j

    def _winsor(self, i: int, z: np.ndarray) -> np.ndarray:
        c = max(WINSOR_K * self.sigma[i], WINSOR_MIN)
        return self.ref[i] + np.clip(z - self.ref[i], -c, c)

    # ------------------------------------------------------------------ one step
    def _step(self, x: np.ndarray, live: np.ndarray) -> list[ChangePoint]:
        rows = np.nonzero(live)[0]
        n_i = self.seen[rows]
        ph = n_i % self.period[rows]
        lx = np.log(x[rows])
        z = lx - self.shape[rows, ph]
        pos = n_i % self.hcap
        self.z[rows, pos] = z
        self.zh[rows, pos] = lx - self.hshape[rows, ph]
        self.x[rows, pos] = x[rows]
        self.seen[rows] += 1
        # the healthy mean follows the samples that left the texture window while
        # healthy (a slowdown not yet verified is still inside it), and not while
        # that window holds slowed samples in most of its parts: an intermittent
        # slowdown too sparse to be verified yet must not become the healthy mean
        # (judged once a verify window, for the window's samples then absorbed)
        h = rows[(self.state[rows] == HEALTHY) & ~self.tex[rows]]
        old = self.seen[h] - 1 - self.T
        keep = old >= self.regime[h]
        h, old = h[keep], old[keep]
        due = h[self.seen[h] % self.W == 0]
        if due.size:
            _, mv = self._recent_parts(due)
            self.quiet[due] = mv.any(axis=2).sum(axis=1) < TEXTURE_PARTS - 1
        h, old = h[self.quiet[h]], old[self.quiet[h]]
        zo = self.zh[h, old % self.hcap]
        h, zo = h[np.isfinite(zo)], zo[np.isfinite(zo)]
        if h.size:
            lam = 1.0 - 1.0 / HEALTHY_MEMORY
            self.hsum[h] = lam * self.hsum[h] + np.exp(zo - self.base[h])
            self.hcnt[h] = lam * self.hcnt[h] + 1.0
            self.base_mean[h] = np.maximum(1.0, self.hsum[h] / self.hcnt[h])
        c = np.maximum(WINSOR_K * self.sigma[rows], WINSOR_MIN)
        y = self.ref.copy()
        y[rows] = self.ref[rows] + np.clip(z - self.ref[rows], -c, c)
        self.bocd.advance(y.astype(self.bocd.dtype), ~live)
        age = self.seen - self.regime
        fire, jstar = self.bocd.candidates(age)
        fire &= live & ~self.tex  # an intermittent slowdown is followed by its mean
        if fire.any():
            fr = np.nonzero(fire)[0]
            cand = (self.seen[fr] - 1) - jstar[fr]
            good = (cand - self.regime[fr] >= 3) & (cand != self.rejected[fr])
            # a later change the posterior now believes replaces a pending one
            # that has not been decided (so a noise candidate cannot hold a real
            # change back until it times out)
            good &= (self.pending[fr] < 0) | (cand > self.pending[fr] + self.min_after)
            self.pending[fr[good]] = cand[good]
        # a slow series also watches for its return to the baseline directly, so
        # a recovery the BOCD posterior is slow to name is not missed
        for i in np.nonzero(live & (self.state == SLOW) & (self.pending < 0) & ~self.tex)[0]:
            c0 = self._return_start(int(i))
            if c0 is not None and c0 != self.rejected[i]:
                self.pending[i] = c0
        # a new level is first known from a few samples; its estimate (and its
        # step pattern) keeps improving until it is 3 windows / 4 periods old
        age = self.seen - self.regime
        young = np.nonzero(
            live
            & (self.pending < 0)
            & self.refine
            & ~self.tex
            & (age > self.min_after)
            & (age <= np.maximum(3 * self.W, 4 * self.period))
        )[0]
        for i in young:
            self._refine(int(i))
        # once more healthy samples are in, learn the pattern again from the
        # latest ones: a warm-up longer than `warmup` (compilation, caches)
        # would otherwise stay in the profile and its noise scale
        again = np.nonzero(
            live
            & ~self.relearned
            & (self.seen >= self.warmup + 2 * self.learn)
            & (self.state == HEALTHY)
            & (self.pending < 0)
            & ~self.changed
            & self.refine
        )[0]
        for i in again:
            self._relearn(int(i))
        out: list[ChangePoint] = []
        ready = np.nonzero(
            live & (self.pending >= 0) & ~self.tex & (self.seen - self.pending >= self.min_after)
        )[0]
        for i in ready:
            cp = self._verify(int(i))
            if cp is not None:
                out.append(cp)
        for i in np.nonzero(live & self.tex)[0]:
            cp = self._follow_texture(int(i))
            if cp is not None:
                out.append(cp)
        # an intermittent slowdown is looked for only when a sample moved (a
        # healthy series' samples seldom do, so this costs little at scale)
        moved = np.zeros(self.n, bool)
        moved[rows] = lx - self.hshape[rows, ph] - self.base[rows] >= self.acc
        for i in self._may_be_texture(np.nonzero(moved & (self.state == HEALTHY))[0], True):
            cp = self._open_texture(int(i))
            if cp is not None:
                out.append(cp)
        # a slowdown its median verified whose mean says more: slowed in turns,
        # its median a mix of slowed and unslowed iterations; its level is the mean
        upgrade = np.nonzero(moved & (self.state == SLOW) & ~self.tex & (self.pending < 0))[0]
        for i in self._may_be_texture(upgrade, False):
            held = self._texture_holds(int(i), verified=True)
            if held is not None and held[0] > math.exp(float(self.ref[i] - self.base[i]) + self.half):
                cp = self._to_texture(int(i))
                if cp is not None:
                    out.append(cp)
        return out

    def _may_be_texture(self, cand: np.ndarray, every_part: bool) -> np.ndarray:
        """The rows of `cand` whose last T samples pass _texture_holds' counts
        (a sample back in every part, TEXTURE_MOVED moved, and one in every part
        when every_part), all at once: the per-row check is for those only."""
        cand = cand[self.seen[cand] >= self.T]
        if not cand.size:
            return cand
        d, mv = self._recent_parts(cand)
        ok = np.all(np.any(d <= self.rec, axis=2), axis=1) & (mv.sum(axis=(1, 2)) >= TEXTURE_MOVED)
        if every_part:
            ok &= np.all(np.any(mv, axis=2), axis=1)
        return cand[ok]

    def _moved_bar(self, rows: np.ndarray | int) -> np.ndarray | float:
        """How far (log) above the baseline a sample has moved, for the
        intermittent check: 3/4 of the bar and 3 noise scales."""
        return np.maximum(self.acc, 3.0 * self.sigma[rows])

    def _recent_parts(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For rows with T samples or more: their last T samples' log distances
        from the baseline, in the healthy step pattern, as (rows, TEXTURE_PARTS,
        verify_window), and which of them moved (_moved_bar)."""
        d = self.zh[rows[:, None], (self.seen[rows, None] - self.T + np.arange(self.T)) % self.hcap]
        d = (d - self.base[rows, None]).reshape(rows.size, TEXTURE_PARTS, -1)
        return d, d >= np.asarray(self._moved_bar(rows))[:, None, None]

    # ------------------------------------------------------------------ intermittent
    def _set_base_mean(self, i: int, d: np.ndarray) -> None:
        """A new healthy level: its mean step over the level (base_mean) from its
        samples' log distances `d` from it, every one counted; at least 1, and
        1 under 8 samples. Healthy samples move it from then on (_step)."""
        d = d[np.isfinite(d)]
        self.hsum[i], self.hcnt[i] = float(np.sum(np.exp(d))), float(d.size)
        self.base_mean[i] = max(1.0, self.hsum[i] / self.hcnt[i]) if d.size >= 8 else 1.0

    def _texture_stats(
        self, i: int, span: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Over the last `span` samples (default T), in the healthy step pattern:
        (each one's step over the healthy mean, which moved beyond 3/4 of the
        bar and 3 noise scales, which are back within half the bar); None with
        fewer samples."""
        n, span = int(self.seen[i]), span or self.T
        if n < span:
            return None
        d = self._window(i, n - span, n, self.zh) - self.base[i]
        if d.size < span or not np.all(np.isfinite(d)):
            return None
        moved = d >= self._moved_bar(i)
        return np.exp(d) / self.base_mean[i], moved, d <= self.rec

    def _texture_holds(self, i: int, verified: bool = False) -> tuple[float, int] | None:
        """(mean step over the healthy mean, first moved sample) when the last T
        samples are an intermittent slowdown: each of their TEXTURE_PARTS parts
        holds a moved sample and one back at the baseline (a level slowed by the
        bar has none there, however noisy), TEXTURE_MOVED moved in all, the
        moved ones' median 1.5 bars above the others' (two levels); and the
        mean of the parts but the slowest clears 3/4 of the bar, and half of it
        by `significance` standard errors (a burst of slow steps, a hiccup, is
        one part's); else None. verified: a slowdown already verified (its
        median's) need not have a moved sample in every part to go on."""
        st = self._texture_stats(i)
        if st is None:
            return None
        r, moved, back = (a.reshape(TEXTURE_PARTS, -1) for a in st)
        if (not verified and int(moved.sum(axis=1).min()) < 1) or int(moved.sum()) < TEXTURE_MOVED:
            return None
        if int(back.sum(axis=1).min()) < 1:
            return None
        if float(np.median(r[moved])) < float(np.median(r[back])) * math.exp(2.0 * self.acc):
            return None  # one level, noisy (its high and low samples close), not two
        rest = np.delete(r, int(np.argmax(r.mean(axis=1))), axis=0).ravel()
        m = float(np.mean(rest))
        se = float(np.std(rest, ddof=1)) / math.sqrt(rest.size)
        if m < math.exp(self.acc) or m - self.k * se < math.exp(self.half):
            return None
        return float(np.mean(r)), int(self.seen[i]) - self.T + int(np.argmax(st[1]))

    def _open_texture(self, i: int) -> ChangePoint | None:
        """A healthy series whose last T samples are an intermittent slowdown:
        an episode from its first moved sample, at the mean level."""
        held = self._texture_holds(i)
        if held is None:
            return None
        m, c = held
        self.pending[i] = -1
        self.shape[i] = self.hshape[i]
        self.z[i] = self.zh[i]
        self.ref[i] = float(self.base[i])
        cp = self._accept(i, c, int(self.seen[i]), float(self.base[i]) + math.log(m), "slower")
        self.tex[i] = True
        return cp

    def _to_texture(self, i: int) -> ChangePoint | None:
        """A slowdown verified on its median whose median went back while its
        mean did not: followed from now on as an intermittent slowdown (its
        recovery, should its mean be back already)."""
        self.tex[i] = True
        self.pending[i] = -1
        self.shape[i] = self.hshape[i]
        self.z[i] = self.zh[i]
        return self._follow_texture(i, anew=True)

    def _follow_texture(self, i: int, anew: bool = False) -> ChangePoint | None:
        """An intermittent slowdown's level (its mean step since it began) and
        its end: the mean over the last 2 T samples (as many as the history
        holds) back within half the bar of the healthy mean. Its slowed samples
        may be one in five: over T alone, a lull of one slowed sample in 32 comes
        every few hundred samples and would be called a recovery. anew: the
        episode's deepest level restarts from this one (a median verified on a
        few slowed samples)."""
        st = self._texture_stats(i, min(2 * self.T, self.hcap))
        if st is None:
            return None
        m, moved = float(np.mean(st[0])), st[1]
        n = int(self.seen[i])
        if m <= math.exp(self.rec):
            # back from the sample after the last moved one
            c = n - moved.size + (int(np.nonzero(moved)[0][-1]) + 1 if moved.any() else 0)
            self.tex[i] = False
            return self._accept(i, min(c, n - 1), n, float(self.base[i]), "recovery")
        # its level: the mean since it began, as far back as the history goes
        # (the last T alone would wander with where the slowed iterations fell),
        # in seconds: a step pattern learned from a window already slowed in
        # turns is not the healthy one
        lo = max(int(self.regime[i]), n - self.hcap + 1)
        xs = self._window(i, lo, n, self.x)
        xs = xs[np.isfinite(xs)]
        if xs.size > moved.size:
            m = float(np.mean(xs)) / float(self.base_s[i] * self.base_mean[i])
        a = float(self.base[i]) + math.log(max(m, 1e-9))
        self.ref[i] = a
        e = self._s[i].open
        if e is not None:
            la = self._sec(i, a)
            deepest = la / e.baseline - 1.0 if anew else max(e.slowdown, la / e.baseline - 1.0)
            self._s[i].open = Episode(e.onset, e.detected_at, deepest, e.baseline, la, series=i)
        return None

    def _relearn(self, i: int) -> None:
        self.relearned[i] = True
        n = int(self.seen[i])
        xs = self._window(i, n - self.learn, n, self.x)
        y = np.log(xs)
        n0 = n - y.size
        pr = learn_profile(y, self.cfg.max_period, n0)
        self._s[i].profile = pr
        p = pr.period
        self.period[i] = p
        self.shape[i] = self.hshape[i] = 0.0
        self.shape[i, :p] = self.hshape[i, :p] = pr.shape
        self.base[i] = self.ref[i] = pr.level
        self.base_s[i] = pr.seconds(pr.level)
        self.sigma[i] = pr.scale
        pos = np.arange(n0, n) % self.hcap
        self.z[i] = self.zh[i] = np.nan
        self.z[i, pos] = self.zh[i, pos] = y - pr.shape[np.arange(n0, n) % p]
        self.regime[i] = n0
        self.rejected[i] = -1
        self._set_base_mean(i, self.z[i, pos] - pr.level)
        self.bocd.restart(np.array([i]), self._winsor(i, self.z[i, pos])[None, :])

    def _window(self, i: int, lo: int, hi: int, arr: np.ndarray | None = None) -> np.ndarray:
        a = self.z if arr is None else arr
        lo = max(lo, int(self.seen[i]) - self.hcap)
        if hi <= lo:
            return np.empty(0)
        return a[i, np.arange(lo, hi) % self.hcap]

    def _refine(self, i: int) -> None:
        lo, n = int(self.regime[i]), int(self.seen[i])
        p = int(self.period[i])
        if p > 1 and n - lo >= 3 * p:
            # The step pattern itself may have changed: a slower link adds the
            # same seconds to every step, which shrinks the long phase's share.
            # Re-learn the per-phase offsets from this level's own samples.
            xs = self._window(i, lo, n, self.x)
            ph = np.arange(n - xs.size, n) % p
            med = np.array([_med(np.log(xs[ph == k])) for k in range(p)])
            self.shape[i, :p] = med - med.mean()
            self.z[i, np.arange(n - xs.size, n) % self.hcap] = np.log(xs) - self.shape[i, ph]
        lvl = float(_med(self._window(i, lo, n)))
        self.ref[i] = lvl
        if self.state[i] == HEALTHY:
            # a new healthy level (the job got faster): it is the baseline
            self.hshape[i] = self.shape[i]
            self.zh[i] = self.z[i]
            self.base[i] = lvl
            self.base_s[i] = self._sec(i, lvl)
            self._set_base_mean(i, self._window(i, lo, n) - lvl)
            return
        e = self._s[i].open
        assert e is not None, "a series not HEALTHY has an open episode"
        la = self._sec(i, lvl)
        self._s[i].open = Episode(
            e.onset, e.detected_at, max(self.peak[i], la / e.baseline - 1.0), e.baseline, la, series=i
        )

    def _return_start(self, i: int) -> int | None:
        """First sample of the trailing run back within `rec` of the baseline, if
        the last `min_after` samples are all there."""
        n = int(self.seen[i])
        k = self.min_after
        if n - self.regime[i] < k:
            return None
        lim = self.base[i] + self.rec
        if not np.all(self._window(i, n - k, n, self.zh) <= lim):
            return None
        j = n - k
        lo = max(int(self.regime[i]), n - self.hcap + 1)
        while j - 1 >= lo and self.zh[i, (j - 1) % self.hcap] <= lim:
            j -= 1
        return j

    def _spread(self, i: int, c: int, n: int, after: np.ndarray, ref: float) -> float:
        """Robust spread of the samples since a candidate around one level, under
        the better of two models of a change: every phase of the step pattern
        scaled alike (a slower GPU: spread of z), or the same seconds added to
        every step (a slower link: spread of the added time over the mean step)."""
        mult = 1.4826 * float(_med(np.abs(after - _med(after))))
        p = int(self.period[i])
        if p == 1:
            return mult
        xs = self._window(i, c, n, self.x)
        ph = np.arange(n - xs.size, n) % p
        lvl = np.exp(ref + self.shape[i, :p])
        u = (xs - lvl[ph]) / float(np.mean(lvl))
        return min(mult, 1.4826 * float(_med(np.abs(u - _med(u)))))

    def _locate(self, i: int, c: int, n: int, ref: float) -> int:
        """Where the level left `ref`: the split of the recent samples that
        misclassifies the fewest of them against the midpoint between `ref` and
        the level since the candidate (the earliest such split; an outlier or a
        checkpoint moves the count by one, not the split)."""
        lo = max(int(self.regime[i]), c - self.W, int(self.seen[i]) - self.hcap)
        z = self._window(i, lo, n)
        a = _med(self._window(i, c, n))
        mid = 0.5 * (a + ref)
        hi = (z > mid) if a > ref else (z < mid)
        # cost(j) = moved samples before j + unmoved samples from j on
        before = np.concatenate([[0], np.cumsum(hi)])
        after = np.concatenate([np.cumsum((~hi)[::-1])[::-1], [0]])
        cost = before + after
        last = z.size - self.min_after  # keep min_after samples after the split
        if last < 0:
            return c
        j = int(np.argmin(cost[: last + 1]))
        return lo + j

    def _verify(self, i: int) -> ChangePoint | None:
        c = int(self.pending[i])
        n = int(self.seen[i])
        ref = float(self.ref[i])
        if n - c == self.min_after:  # first look: place the candidate where the level left
            c = self._locate(i, c, n, ref)
            self.pending[i] = c
        after = self._window(i, c, n)
        m = after.size
        a = float(_med(after))
        sig = float(self.sigma[i])
        half = self.half
        if m == 0:
            self.pending[i] = -1
            return None
        # a level, not a cluster of outliers: the samples since the candidate
        # agree with each other about as well as healthy samples do
        if self._spread(i, c, n, after, ref) > max(3.0 * sig, 0.25 * abs(a - ref)):
            if m >= self.max_wait:
                self.pending[i] = -1
                self.rejected[i] = c
            return None
        se = MEDIAN_SE * max(sig, 0.5 * _mad(after) if m >= 6 else 0.0) / math.sqrt(m)
        k = self.k
        tail = after[-min(2, m) :]
        # most of the samples moved (all of the first four), not a few outliers
        need = m if m <= 4 else math.ceil((0.75 if m < 8 else 0.6) * m)
        # per sample, "moved" means beyond half the bar and beyond the noise
        mv = max(half, 1.5 * sig) if m < 8 else half
        if m >= 8:
            # past the first window the per-sample rule relaxes, and a candidate
            # has been tested several times: ask for one more standard error
            k += 1.0
        slow = self.state[i] == SLOW
        kind: str | None = None
        decided = m >= self.max_wait
        if a > ref:
            up = a - ref
            if (
                up >= self.acc
                and up - k * se >= half
                and np.all(tail >= ref + mv)
                and np.sum(after >= ref + mv) >= need
            ):
                kind = "slower"
            elif up + k * se < self.acc:
                decided = True
        else:
            down = ref - a
            held = bool(np.all(tail <= ref - mv))  # the newest samples still faster
            # a return is judged in the healthy pattern against the baseline, and
            # measured from the level the episode was verified at (a refined
            # estimate of a short excursion may have sunk under it)
            ah = self._window(i, c, n, self.zh)
            lim = float(self.base[i]) + self.rec
            top = max(ref, float(self.vlevel[i]))
            back = slow and float(_med(ah)) <= lim
            # a faster level: most samples since the candidate moved down, the
            # newest still there
            faster = down >= self.acc and down - k * se >= half and held and np.sum(after <= ref - mv) >= need
            if faster and not slow:
                self._hold_faster(i, c, n)
            else:
                self.fast_s[i] = 0.0
            if (
                back
                and top - a - k * se >= half
                and np.all(ah[-min(2, m) :] <= lim)
                and np.sum(ah <= lim) >= need
            ):
                kind = "recovery"
            elif faster and (slow or self._faster_held(i, c, m)):
                # a faster level while healthy becomes the baseline, so it must
                # hold (FASTER_HOLD_S): a healthy GPipe job on a busy host ran
                # 15% of its steps at 14 ms against its usual 24 in runs of
                # 5-20, a baseline moved on 4 of them, and the job read as
                # 1.5-2x slower for the rest of its run; a healthy DDP restart
                # ran spells of 5-10 s at 36 ms against its 42 ms, and its
                # baseline moved to one 47 s in
                kind = "faster"
            elif faster:
                decided = False  # healthy, and still held: it waits for the hold
            elif (down + k * se < self.acc and not back) or (not slow and not held):
                # clearly not faster; or, while healthy, no longer held: a pending
                # faster candidate waits only while it holds, so it never keeps
                # a slowdown that follows it from being a candidate
                decided = True
        if kind is None and not decided:
            return None
        if slow and kind in ("recovery", "faster") and self._texture_holds(i) is not None:
            # its median went back and its mean did not: slowed in turns, or a
            # noisy level that ended. Slowed iterations among those since the
            # candidate say the former; none in a verify window, the latter
            since = self._window(i, c, n, self.zh) - self.base[i]
            if np.any(since >= self._moved_bar(i)):
                return self._to_texture(i)
            if m < self.W:
                return None
        self.pending[i] = -1
        if kind is None:
            self.rejected[i] = c
            return None
        if m > self.min_after:  # more samples since the first look: place it again
            c = self._locate(i, c, n, ref)
            if kind == "faster" and not slow and 0 <= self.fast_c[i] < n - self.hcap:
                # held longer than the samples kept: it began where its hold did
                c = int(self.fast_c[i])
            a = float(_med(self._window(i, c, n)))
        return self._accept(i, c, n, a, kind)

    def _hold_faster(self, i: int, c: int, n: int) -> None:
        """Count the seconds a faster level has held while healthy, through
        samples [c, n): carried on from the last count when it ended at most a
        verification's wait ago (a later candidate inside the same faster
        spell), started again otherwise."""
        last = int(self.fast_n[i])
        if self.fast_s[i] > 0.0 and 0 <= last <= n <= last + 2 * self.min_after + 1:
            self.fast_s[i] += float(np.nansum(self._window(i, last, n, self.x)))
        else:
            self.fast_s[i] = float(np.nansum(self._window(i, c, n, self.x)))
            self.fast_c[i] = c
        self.fast_n[i] = n

    def _faster_held(self, i: int, c: int, m: int) -> bool:
        """Whether a faster level while healthy (candidate c, m samples since)
        has held long enough to be the baseline: max_wait samples, and
        FASTER_HOLD_S seconds unless it began in the start-up."""
        if m < self.max_wait:
            return False
        return c < self.warmup + 2 * self.learn or self.fast_s[i] >= FASTER_HOLD_S

    def _accept(self, i: int, c: int, n: int, a: float, kind: str) -> ChangePoint:
        s = self._s[i]
        ref = float(self.ref[i])
        before_x = self._window(i, max(int(self.regime[i]), c - self.W), c, self.x)
        after_x = self._window(i, c, n, self.x)
        lb = self._sec(i, ref)
        la = self._sec(i, a)
        base_s = float(self.base_s[i])
        self.refine[i] = True
        self.changed[i] = True
        self.regime[i] = c
        self.rejected[i] = -1
        self.fast_s[i] = 0.0
        if kind == "slower":
            if self.state[i] == HEALTHY:
                s.open = Episode(c, n - 1, la / base_s - 1.0, base_s, la, series=i)
                self.state[i] = SLOW
                self.peak[i] = 0.0
            else:
                e = s.open
                assert e is not None, "a series not HEALTHY has an open episode"
                self.peak[i] = max(self.peak[i], e.level_s / base_s - 1.0)
                s.open = Episode(
                    e.onset, e.detected_at, max(self.peak[i], la / base_s - 1.0), e.baseline, la, series=i
                )
            self.vlevel[i] = a
        elif kind == "recovery" or (self.state[i] == SLOW and la / base_s - 1.0 < math.expm1(self.rec)):
            e = s.open
            assert e is not None, "a series not HEALTHY has an open episode"
            s.episodes.append(
                Episode(e.onset, e.detected_at, e.slowdown, e.baseline, e.level_s, c, n - 1, series=i)
            )
            s.open = None
            self.state[i] = HEALTHY
            # back at the baseline it left, in the healthy step pattern
            self.refine[i] = False
            self.shape[i] = self.hshape[i]
            self.z[i] = self.zh[i]
            a = float(self.base[i])
            la = base_s
        elif self.state[i] == SLOW:  # faster, still above the bar
            e = s.open
            assert e is not None, "a series not HEALTHY has an open episode"
            self.peak[i] = max(self.peak[i], e.level_s / base_s - 1.0)
            s.open = Episode(e.onset, e.detected_at, e.slowdown, e.baseline, la, series=i)
        else:  # faster while healthy: the job got faster, a new baseline
            self.base[i] = a
            self.base_s[i] = la
            self._set_base_mean(i, self._window(i, c, n) - a)
        self.ref[i] = a
        z = self._window(i, c, n)
        self.bocd.restart(np.array([i]), self._winsor(i, z)[None, :])
        return ChangePoint(
            series=i,
            index=c,
            detected_at=n - 1,
            direction="slower" if kind == "slower" else "faster",
            mean_before=float(np.mean(before_x)) if before_x.size else lb,
            mean_after=float(np.mean(after_x)) if after_x.size else la,
            level_before=lb,
            level_after=la,
        )


@dataclass(frozen=True)
class Detection:
    """What the detector found in one series."""

    change_points: list[ChangePoint]
    episodes: list[Episode]
    profile: Profile | None
    samples: int
    ignored: int
    note: str | None = None

    def to_dict(self) -> dict:
        pr = self.profile
        return {
            "samples": self.samples,
            "ignored_samples": self.ignored,
            "note": self.note,
            "profile": None
            if pr is None
            else {
                "period": pr.period,
                "baseline_s": round(pr.seconds(pr.level), 6),
                "noise": round(pr.scale, 4),
            },
            "change_points": [c.to_dict() for c in self.change_points],
            "episodes": [e.to_dict() for e in self.episodes],
        }


def detect_steps(step_times: ArrayLike, config: DetectorConfig | None = None) -> Detection:
    """Run the detector over one series (seconds per step) and say what it found.

    Samples that are not a positive finite number of seconds are ignored (and
    counted); a series too short to learn its profile gives no change points
    and a note saying how many samples were needed.
    """
    cfg = config or DetectorConfig.from_policy()
    x = np.asarray(step_times, dtype=np.float64).reshape(-1)
    det = StepDetector(1, cfg)
    cps = det.run(x.reshape(1, -1)) if x.size else []
    bad = int(np.sum(~valid_steps(x)))
    note = None
    if det.profile(0) is None:
        note = (
            f"{x.size - bad} usable samples: the detector needs {cfg.warmup} warm-up + "
            f"{cfg.learn} to learn the step pattern before it can judge a change"
        )
    return Detection(cps, det.episodes(0), det.profile(0), int(x.size), bad, note)
