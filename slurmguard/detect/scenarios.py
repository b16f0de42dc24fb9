"""Labelled step-time scenarios for the detector benchmark and tests.

Each scenario is one step-time series (seconds per iteration) with the indices
where a fail-slow starts (onsets) and ends (recoveries). Healthy scenarios carry
only the noise a real job shows (Greyhound 4.2 names GC, allocator cache misses
and uneven sequence lengths): Gaussian jitter, sequence-length jitter, GC pauses,
periodic checkpoints and a slow warm-up, plus benign level shifts below the 10%
fail-slow bar. Fail-slows are computational (the whole step slows by the
severity) or communication (only the communication share of the step slows, and
its jitter grows with congestion), of several severities and durations, with
recoveries and compound cases (a second fault on top of the first).
Deterministic given the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KINDS = ("healthy", "benign_shift", "compute", "comm", "compound")
SEVERITIES = (0.15, 0.25, 0.5, 1.0)
DURATIONS = (4, 8, 12, 30, 100, None)  # iterations; None = until the end


@dataclass(frozen=True)
class Scenario:
    """One labelled series. onsets/recoveries are sample indices."""

    kind: str
    x: np.ndarray
    onsets: tuple[int, ...] = ()
    recoveries: tuple[int, ...] = ()
    severity: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def faulty(self) -> bool:
        return bool(self.onsets)


def _noise(rng: np.random.Generator, n: int, base: float) -> tuple[np.ndarray, dict]:
    """Healthy step times: the noise every scenario carries."""
    cv = rng.uniform(0.005, 0.04)
    x = base * (1.0 + rng.normal(0.0, cv, n))
    notes: dict = {"cv": round(cv, 4)}
    if rng.random() < 0.5:  # uneven sequence lengths: bounded, skewed
        j = rng.uniform(0.01, 0.05)
        x *= 1.0 + j * rng.beta(2.0, 5.0, n)
        notes["seqlen_jitter"] = round(j, 3)
    if rng.random() < 0.6:  # Python GC: a pause every few dozen iterations
        every = int(rng.integers(15, 60))
        idx = np.arange(int(rng.integers(0, every)), n, every)
        x[idx] += base * rng.uniform(0.1, 0.8, idx.size)
        notes["gc_every"] = every
    if rng.random() < 0.4:  # periodic checkpoint: one long iteration
        every = int(rng.integers(40, 120))
        idx = np.arange(every, n, every)
        x[idx] += base * rng.uniform(1.0, 4.0, idx.size)
        notes["ckpt_every"] = every
    if rng.random() < 0.5:  # slow warm-up (allocator, compilation caches)
        amp = rng.uniform(0.2, 1.0)
        tau = rng.uniform(2.0, 8.0)
        x *= 1.0 + amp * np.exp(-np.arange(n) / tau)
        notes["warmup"] = round(amp, 2)
    return x, notes


def make_scenario(rng: np.random.Generator, kind: str, n: int = 300) -> Scenario:
    base = float(rng.uniform(0.2, 8.0))
    x, notes = _noise(rng, n, base)
    if kind == "healthy":
        return Scenario(kind, x, notes=notes)
    if kind == "benign_shift":  # e.g. a data-loader change: < 5%, not a fail-slow
        at = int(rng.integers(60, n - 60))
        x[at:] *= 1.0 + rng.uniform(-0.05, 0.05)
        notes["shift_at"] = at
        return Scenario(kind, x, notes=notes)
    onset = int(rng.integers(60, n - 60))
    sev = float(rng.choice(SEVERITIES))
    dur = DURATIONS[int(rng.integers(0, len(DURATIONS)))]
    end = n if dur is None else min(n, onset + dur)
    recov: tuple[int, ...] = (end,) if end < n else ()
    if kind == "compute":
        x[onset:end] *= 1.0 + sev
    elif kind == "comm":
        # the communication share f of the step slows by g, so the step slows
        # by f*(g-1) = sev; congestion also makes it burstier
        f = rng.uniform(0.25, 0.6)
        g = 1.0 + sev / f
        comm = f * base * (g - 1.0)
        x[onset:end] += comm * (1.0 + rng.normal(0.0, 0.05, end - onset))
        notes["comm_share"] = round(f, 2)
    elif kind == "compound":
        # compute fault, then a communication fault on top while it lasts
        end = n
        recov = ()
        x[onset:] *= 1.0 + sev
        second = int(onset + rng.integers(15, 40))
        sev2 = float(rng.choice(SEVERITIES[:3]))
        x[second:] += base * (1.0 + sev) * sev2 * (1.0 + rng.normal(0.0, 0.05, n - second))
        notes["second"] = (second, sev2)
        return Scenario(kind, x, (onset, second), recov, sev, notes)
    else:
        raise ValueError(f"unknown scenario kind {kind!r}")
    return Scenario(kind, x, (onset,), recov, sev, notes)


def make_suite(n_scenarios: int = 1000, length: int = 300, seed: int = 0) -> list[Scenario]:
    """A mixed suite: 40% healthy, 10% benign shifts, 20% compute, 20% comm, 10% compound."""
    rng = np.random.default_rng(seed)
    weights = {"healthy": 0.4, "benign_shift": 0.1, "compute": 0.2, "comm": 0.2, "compound": 0.1}
    kinds = rng.choice(list(weights), size=n_scenarios, p=list(weights.values()))
    return [make_scenario(rng, str(k), length) for k in kinds]
