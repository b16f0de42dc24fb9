"""Baselines of Greyhound Tables 3-4, and the scoring shared by the benchmark.

SlidingWindow: "reports a fail-slow if there's a >10% performance change in the
sliding window from the current median" (Greyhound 7.2): the median of the last
`window` step times against the median of the `window` before them.
Plain BOCD is `BatchBocd(verify=False)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slurmguard.detect.scenarios import Scenario


@dataclass(frozen=True)
class Alarm:
    """A reported slowdown: the estimated start and the sample that reported it."""

    index: int
    detected_at: int


def sliding_window_alarms(x: np.ndarray, window: int = 8, threshold: float = 0.10) -> list[Alarm]:
    """Alarms of the sliding-window baseline on one series (slowdowns only)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 2 * window:
        return []
    # medians of every window of `window` samples, vectorised
    win = np.lib.stride_tricks.sliding_window_view(x, window)
    med = np.median(win, axis=1)            # med[i] = median(x[i:i+window])
    cur = med[window:]                      # window ending at t
    ref = med[:-window]                     # the window before it
    ratio = cur / ref - 1.0
    out: list[Alarm] = []
    t = 0
    while t < ratio.size:
        if ratio[t] > threshold:
            end = t + 2 * window - 1        # sample index that completed the current window
            out.append(Alarm(index=t + window, detected_at=end))
            t += 2 * window                 # re-arm once both windows moved past the change
        else:
            t += 1
    return out


@dataclass
class Score:
    """Scenario-level accuracy in the style of Greyhound Tables 3-4."""

    name: str
    negatives: int = 0
    false_pos: int = 0            # negative scenarios with a slowdown alarm
    positives: int = 0
    false_neg: int = 0            # faulty scenarios with an onset not reported in time
    correct: int = 0
    spurious: int = 0             # extra alarms inside faulty scenarios
    delays: list[int] = field(default_factory=list)
    recoveries: int = 0
    recoveries_found: int = 0

    @property
    def total(self) -> int:
        return self.negatives + self.positives

    @property
    def fpr(self) -> float:
        return self.false_pos / max(self.negatives, 1)

    @property
    def fnr(self) -> float:
        return self.false_neg / max(self.positives, 1)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)

    @property
    def median_delay(self) -> float:
        return float(np.median(self.delays)) if self.delays else float("nan")


def score(name: str, scenarios: list[Scenario], alarms: list[list[Alarm]],
          recoveries: list[list[int]] | None = None, max_delay: int = 10) -> Score:
    """Match alarms to labelled onsets.

    An onset is found when an alarm is reported within `max_delay` samples after
    it (delay = detected_at - onset, 0 = on the first slow sample). Any other
    alarm is false: it makes a healthy scenario a false positive and a faulty
    one incorrect. A recovery is found when a report (sample index of the
    faster change's detection) lands within `max_delay` after it.
    """
    s = Score(name)
    for i, (sc, al) in enumerate(zip(scenarios, alarms)):
        used: set[int] = set()
        missed = 0
        for o in sc.onsets:
            hit = None
            for a_i, a in enumerate(al):
                if a_i not in used and o <= a.detected_at <= o + max_delay:
                    hit = a_i
                    break
            if hit is None:
                missed += 1
            else:
                used.add(hit)
                s.delays.append(al[hit].detected_at - o)
        extra = len(al) - len(used)
        if sc.faulty:
            s.positives += 1
            s.false_neg += missed > 0
            s.spurious += extra
            s.correct += missed == 0 and extra == 0
        else:
            s.negatives += 1
            s.false_pos += extra > 0
            s.correct += extra == 0
        if recoveries is not None:
            for r in sc.recoveries:
                s.recoveries += 1
                s.recoveries_found += any(r <= d <= r + max_delay for d in recoveries[i])
    return s
