"""Labelled step-time scenarios for the detector benchmark and tests.

Each scenario is one step-time series (seconds per iteration) with the indices
where a fail-slow starts (onsets) and ends (recoveries), and the textures it
carries. The generator is written from what real training jobs look like
(Greyhound 4.2 names GC, allocator cache misses and uneven sequence lengths;
issue 13 adds what the loop meets on real workloads), not from the detector:

textures, drawn independently per scenario
    base step   log-uniform 0.05-5 s
    noise       relative s.d. 0.5-4%; Gaussian, or heavy-tailed (Student t, 3 dof)
    periodic    every p-th step (p = 2..8) longer by 15-150% (gradient
                accumulation, an optimizer step every p micro-steps), sometimes a
                second long phase
    checkpoints one step 2.5-4x every 20-200 steps, sometimes a slowish step after
    outliers    0-5% of the steps 1.2-3x (or 0.7x), isolated
    seqlen      uneven sequence lengths: bounded, skewed jitter
    warmup      the first 3-15 steps slow, decaying

kinds
    healthy       only the texture
    hiccup        1-3 excursions of 1-8 steps, 1.3-2.5x, that return
    speedup       the level drops 8-40% (a faster data loader): not a fail-slow
    small_shift   a sustained slowdown of 5-9% (below the 10% fail-slow bar)
    shift         a slowdown of 10-100% that lasts to the end
    transient     a slowdown of 10-100% that lasts 30-150 steps, then recovers
    compound      a slowdown, then a second one on top 15-60 steps later

A slowdown is computational (every step x (1 + s)) or communication (every
step + s x the mean step, as a slower link adds the same time to each
iteration; congestion makes that addition noisy). Deterministic given the seed.

The intermittent suite (make_intermittent_suite) is apart, so the main suite's
draws stay as they were: healthy series and intermittent slowdowns, where from
the onset a share of 15-70% of the iterations, drawn at random, is slowed
1.3-5x and the rest is not (a CPU quota that throttles the iterations that
cross its period and not the others; a link that drops in and out). Their
median step does not move; the mean does, by share x (factor - 1), which is
the throughput lost: a positive from 10%.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slurmguard.errors import InputError

KINDS = ("healthy", "hiccup", "speedup", "small_shift", "shift", "transient", "compound")
WEIGHTS = (0.30, 0.12, 0.06, 0.07, 0.20, 0.15, 0.10)
TEXTURES = ("periodic", "checkpoints", "outliers", "heavy_tail", "seqlen", "warmup")
#: Slowdowns at or above this fraction that last at least MIN_DURATION steps
#: must be found (issue 13's targets); smaller ones are reported separately.
MIN_SHIFT = 0.10
MIN_DURATION = 30


@dataclass(frozen=True)
class LabelledSeries:
    """One labelled series. onsets/recoveries are sample indices; onset i is the
    first slow sample, recovery i the first sample back at the level before.

    positives: the onsets that must be found (>= MIN_SHIFT lasting >= MIN_DURATION).
    excursions: (start, stop) of hiccups, which may be reported only as an
    episode that recovers, or not at all.
    """

    kind: str
    x: np.ndarray
    onsets: tuple[int, ...] = ()
    recoveries: tuple[int, ...] = ()
    severity: float = 0.0
    textures: tuple[str, ...] = ()
    positives: tuple[int, ...] = ()
    excursions: tuple[tuple[int, int], ...] = ()
    notes: dict = field(default_factory=dict)

    @property
    def faulty(self) -> bool:
        return bool(self.onsets)

    @property
    def negative(self) -> bool:
        """A series where no slowdown may be reported (hiccups: none left open)."""
        return self.kind in ("healthy", "hiccup", "speedup")


def _texture(rng: np.random.Generator, n: int, base: float) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    """Healthy step times and the multiplicative noise factor (kept apart so a
    shift can scale the clean profile and the outliers stay outliers)."""
    textures: list[str] = []
    notes: dict = {"base": round(base, 4)}
    profile = np.ones(n)
    if rng.random() < 0.6:
        p = int(rng.integers(2, 9))
        amp = float(rng.uniform(0.15, 1.5))
        ph = int(rng.integers(0, p))
        shape = np.ones(p)
        shape[ph] += amp
        if p >= 4 and rng.random() < 0.3:
            shape[(ph + p // 2) % p] += float(rng.uniform(0.1, 0.6))
        profile = shape[np.arange(n) % p]
        textures.append("periodic")
        notes["period"] = p
        notes["amp"] = round(amp, 3)
    profile = profile / profile.mean()
    cv = float(rng.uniform(0.005, 0.04))
    notes["cv"] = round(cv, 4)
    if rng.random() < 0.3:
        e = rng.standard_t(3, n) / np.sqrt(3.0)
        e = np.clip(e, -6, 12)
        textures.append("heavy_tail")
    else:
        e = rng.standard_normal(n)
    noise = np.maximum(1.0 + cv * e, 0.5)
    if rng.random() < 0.3:
        j = float(rng.uniform(0.01, 0.05))
        noise *= 1.0 + j * rng.beta(2.0, 5.0, n)
        textures.append("seqlen")
    spikes = np.ones(n)
    if rng.random() < 0.55:
        every = int(rng.integers(20, 201))
        idx = np.arange(int(rng.integers(5, every + 5)), n, every)
        spikes[idx] *= rng.uniform(2.5, 4.0, idx.size)
        if rng.random() < 0.4:
            nxt = idx[idx + 1 < n] + 1
            spikes[nxt] *= rng.uniform(1.1, 1.5, nxt.size)
        textures.append("checkpoints")
        notes["ckpt_every"] = every
    if rng.random() < 0.6:
        rate = float(rng.uniform(0.002, 0.05))
        hit = rng.random(n) < rate
        mag = np.exp(rng.uniform(np.log(1.2), np.log(3.0), n))
        mag = np.where(rng.random(n) < 0.15, rng.uniform(0.6, 0.85, n), mag)
        spikes = np.where(hit, spikes * mag, spikes)
        textures.append("outliers")
        notes["outlier_rate"] = round(rate, 4)
    if rng.random() < 0.4:
        k = int(rng.integers(3, 16))
        amp = float(rng.uniform(0.3, 2.0))
        warm = np.ones(n)
        warm[:k] += amp * np.exp(-np.arange(k) / (k / 3.0))
        spikes *= warm
        textures.append("warmup")
    return base * profile, noise * spikes, textures, notes


def _slow(
    rng, clean: np.ndarray, noise: np.ndarray, base: float, lo: int, hi: int, s: float, comm: bool
) -> None:
    """Slow steps [lo, hi) by the fraction s of the mean step (in place on clean)."""
    if comm:
        m = hi - lo
        clean[lo:hi] += s * base * np.maximum(1.0 + rng.normal(0.0, 0.05, m), 0.5)
    else:
        clean[lo:hi] *= 1.0 + s


def make_scenario(rng: np.random.Generator, kind: str, n: int = 400) -> LabelledSeries:
    if kind not in KINDS:
        raise ValueError(f"unknown scenario kind {kind!r}")
    base = float(np.exp(rng.uniform(np.log(0.05), np.log(5.0))))
    clean, noise, textures, notes = _texture(rng, n, base)
    onsets: list[int] = []
    recov: list[int] = []
    positives: list[int] = []
    excursions: list[tuple[int, int]] = []
    sev = 0.0
    comm = bool(rng.random() < 0.4)
    lo_on = 50
    if kind == "hiccup":
        k = int(rng.integers(1, 4))
        starts = np.sort(rng.choice(np.arange(lo_on, n - 20), k, replace=False))
        last = -100
        for a in starts:
            if a < last + 15:
                continue
            d = int(rng.integers(1, 9))
            f = float(rng.uniform(1.3, 2.5))
            clean[a : a + d] *= f
            excursions.append((int(a), int(min(n, a + d))))
            last = a + d
        notes["hiccups"] = excursions
    elif kind == "speedup":
        at = int(rng.integers(lo_on, n - 40))
        sev = -float(rng.uniform(0.08, 0.4))
        clean[at:] *= 1.0 + sev
        notes["speedup_at"] = at
    elif kind in ("small_shift", "shift", "transient", "compound"):
        if kind == "small_shift":
            sev = float(rng.uniform(0.05, 0.09))
        else:  # log-uniform 10-100%: moderate shifts are as common as large ones
            sev = float(np.exp(rng.uniform(np.log(MIN_SHIFT), np.log(1.0))))
        onset = int(rng.integers(lo_on, n - 40))
        end = n
        if kind == "transient":
            onset = int(rng.integers(lo_on, n - 60))
            dur = int(rng.integers(MIN_DURATION, 151))
            end = min(n, onset + dur)
            if n - end < 20:  # leave room to see the recovery
                end = n
        _slow(rng, clean, noise, base, onset, end, sev, comm)
        onsets.append(onset)
        if end < n:
            recov.append(end)
        if sev >= MIN_SHIFT and end - onset >= MIN_DURATION:
            positives.append(onset)
        if kind == "compound":
            second = int(onset + rng.integers(15, 61))
            if second < n - MIN_DURATION:
                sev2 = float(np.exp(rng.uniform(np.log(0.12), np.log(0.8))))
                # the second fault slows the (already slow) step by sev2 again
                _slow(rng, clean, noise, base * (1.0 + sev), second, n, sev2, comm)
                onsets.append(second)
                positives.append(second)
                notes["second"] = (second, round(sev2, 3))
        notes["comm"] = comm
    x = clean * noise
    return LabelledSeries(
        kind, x, tuple(onsets), tuple(recov), sev, tuple(textures), tuple(positives), tuple(excursions), notes
    )


def make_suite(n_scenarios: int = 1000, length: int = 400, seed: int = 0) -> list[LabelledSeries]:
    """A mixed suite with the kind shares of WEIGHTS; deterministic given the seed."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(KINDS, size=n_scenarios, p=np.asarray(WEIGHTS) / sum(WEIGHTS))
    return [make_scenario(rng, str(k), length) for k in kinds]


INTERMITTENT = "intermittent"


def make_intermittent(rng: np.random.Generator, n: int = 400) -> LabelledSeries:
    """One intermittent slowdown (see the module's docstring), on the end or
    for 60-150 iterations, over the textures of a healthy series."""
    base = float(np.exp(rng.uniform(np.log(0.05), np.log(5.0))))
    clean, noise, textures, notes = _texture(rng, n, base)
    onset = int(rng.integers(50, n - 100))
    end = n if rng.random() < 0.6 else min(n, onset + int(rng.integers(60, 151)))
    if n - end < 40:  # leave room to see the recovery
        end = n
    share = float(rng.uniform(0.15, 0.7))
    factor = float(np.exp(rng.uniform(np.log(1.3), np.log(5.0))))
    hit = np.zeros(n, bool)
    hit[onset:end] = rng.random(end - onset) < share
    clean = np.where(hit, clean * factor, clean)
    cost = share * (factor - 1.0)
    notes.update(share=round(share, 3), factor=round(factor, 3))
    positives = (onset,) if cost >= MIN_SHIFT else ()
    return LabelledSeries(
        INTERMITTENT,
        clean * noise,
        (onset,),
        (end,) if end < n else (),
        cost,
        tuple(textures),
        positives,
        (),
        notes,
    )


def make_intermittent_suite(n_scenarios: int = 300, length: int = 400, seed: int = 0) -> list[LabelledSeries]:
    """Healthy series and intermittent slowdowns, half each; deterministic given the seed."""
    rng = np.random.default_rng(seed)
    return [
        make_intermittent(rng, length) if k % 2 else make_scenario(rng, "healthy", length)
        for k in range(n_scenarios)
    ]


# ---------------------------------------------------------------- recorded series
def load_recorded(path: str | Path) -> LabelledSeries:
    """A recorded step series labelled with its injection (stepfile format).

    `# onset:` gives the injection step (repeat it for a second fault), `#
    recovery:` the step the fault was cleared, `# kind:` what was done
    (default: shift with an onset, healthy without). Missing steps (NaN, 0)
    are kept as gaps. The severity, when not given, is measured: median step
    over the 30 steps after the onset against the 30 before it.
    """
    from slurmguard.detect.stepfile import read_step_file

    vals, labels, _ = read_step_file(path, skip_invalid=True)
    x = np.asarray(vals, dtype=np.float64)

    def ints(key: str) -> tuple[int, ...]:
        out = []
        for v in labels.get(key, []):
            try:
                k = int(v)
            except ValueError:
                raise InputError(f"{path}: label '{key}: {v}' is not a step index") from None
            if not 0 <= k < x.size:
                raise InputError(f"{path}: label '{key}: {v}' is outside the series (0..{x.size - 1})")
            out.append(k)
        return tuple(sorted(out))

    onsets, recov = ints("onset"), ints("recovery")
    kind = (labels.get("kind") or ["shift" if onsets else "healthy"])[0]
    if kind not in KINDS:
        raise InputError(f"{path}: label 'kind: {kind}' is not one of {', '.join(KINDS)}")
    if onsets and kind in ("healthy", "hiccup", "speedup"):
        raise InputError(f"{path}: a '{kind}' series has no onset (got onset labels)")
    if "severity" in labels:
        try:
            sev = float(labels["severity"][0])
        except ValueError:
            raise InputError(f"{path}: label 'severity: {labels['severity'][0]}' is not a number") from None
    elif onsets:
        o = onsets[0]
        sev = float(np.nanmedian(x[o : o + 30]) / np.nanmedian(x[max(0, o - 30) : o]) - 1.0)
    else:
        sev = 0.0
    positives = []
    for o in onsets:
        end = next((r for r in recov if r > o), x.size)
        if sev >= MIN_SHIFT and end - o >= MIN_DURATION:
            positives.append(o)
    excursions = []
    for v in labels.get("excursion", []):
        try:
            a, b = (int(t) for t in v.replace("-", " ").split())
        except ValueError:
            raise InputError(f"{path}: label 'excursion: {v}' is not 'START-STOP'") from None
        excursions.append((a, b))
    tex = tuple(t.strip() for t in (labels.get("textures") or [""])[0].split(",") if t.strip())
    return LabelledSeries(
        kind,
        x,
        onsets,
        recov,
        sev,
        ("recorded",) + tex,
        tuple(positives),
        tuple(excursions),
        {"file": str(path), "source": (labels.get("source") or [""])[0]},
    )


def load_recorded_dir(directory: str | Path) -> list[LabelledSeries]:
    """Every *.csv under `directory` (sorted), as labelled scenarios."""
    return [load_recorded(p) for p in sorted(Path(directory).glob("*.csv"))]
