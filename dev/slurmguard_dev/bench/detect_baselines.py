"""Baselines of Greyhound Tables 3-4, and the scoring shared by the benchmark.

SlidingWindow: "reports a fail-slow if there's a >10% performance change in the
sliding window from the current median" (Greyhound 7.2): the median of the last
`window` step times against the median of the `window` before them.
Plain BOCD is `BatchBocd(verify=False)`: every MAP run-length drop is a change.

Every algorithm is scored from the same thing: its reported changes (a slower
change = a slowdown alarm, a faster one = a recovery report), each with the
located index and the sample at which it was reported (`detected_at`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slurmguard_dev.bench.detect_scenarios import LabelledSeries


@dataclass(frozen=True)
class Alarm:
    """A reported change: the located index and the sample that reported it."""

    index: int
    detected_at: int


@dataclass
class Report:
    """What one algorithm reported on one series."""

    slower: list[Alarm] = field(default_factory=list)
    faster: list[Alarm] = field(default_factory=list)
    #: a slowdown still open at the end of the series (None: the algorithm has no
    #: episodes; then a slowdown is open when no faster change followed it)
    open_at_end: bool | None = None

    def is_open(self) -> bool:
        if self.open_at_end is not None:
            return self.open_at_end
        if not self.slower:
            return False
        last = max(a.detected_at for a in self.slower)
        return not any(f.detected_at > last for f in self.faster)


def sliding_window_alarms(x: np.ndarray, window: int = 8, threshold: float = 0.10) -> list[Alarm]:
    """Alarms of the sliding-window baseline on one series (slowdowns only)."""
    return sliding_window(x, window, threshold).slower


def sliding_window(x: np.ndarray, window: int = 8, threshold: float = 0.10) -> Report:
    """Slower and faster changes of the sliding-window baseline on one series."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    rep = Report()
    if n < 2 * window:
        return rep
    win = np.lib.stride_tricks.sliding_window_view(x, window)
    med = np.median(win, axis=1)  # med[i] = median(x[i:i+window])
    ratio = med[window:] / med[:-window] - 1.0
    t = 0
    while t < ratio.size:
        r = ratio[t]
        if r > threshold or r < -threshold / (1.0 + threshold):
            a = Alarm(index=t + window, detected_at=t + 2 * window - 1)
            (rep.slower if r > 0 else rep.faster).append(a)
            t += 2 * window  # re-arm once both windows moved past the change
        else:
            t += 1
    return rep


def _pct(v: list[int], q: float) -> float:
    return float(np.percentile(v, q)) if v else float("nan")


@dataclass
class Score:
    """Scenario-suite accuracy in the style of Greyhound Tables 3-4, extended.

    negatives: healthy, speed-up and hiccup series. A healthy or speed-up series
      with any slowdown alarm is a false positive; a hiccup series is one when a
      slowdown is reported outside its excursions or one is left open.
    positives: labelled onsets of slowdowns >= 10% lasting >= 30 steps; one is
      found when a slowdown is reported within `max_delay` samples after it.
    delay = detected_at - onset; location error = |located index - onset|.
    """

    name: str
    negatives: int = 0
    false_pos: int = 0
    positives: int = 0
    false_neg: int = 0
    spurious: int = 0  # slowdown alarms in faulty series matching no onset
    delays: list[int] = field(default_factory=list)
    loc_err: list[int] = field(default_factory=list)
    hiccups: int = 0
    hiccups_closed: int = 0  # hiccup series with no slowdown left open
    recoveries: int = 0
    recoveries_found: int = 0
    false_recoveries: int = 0  # recovery reports in series that only slowed
    small: int = 0
    small_found: int = 0  # 5-9% shifts reported (below the bar: informational)

    @property
    def fpr(self) -> float:
        return self.false_pos / max(self.negatives, 1)

    @property
    def fnr(self) -> float:
        return self.false_neg / max(self.positives, 1)

    @property
    def median_delay(self) -> float:
        return float(np.median(self.delays)) if self.delays else float("nan")

    @property
    def p90_delay(self) -> float:
        return _pct(self.delays, 90)

    @property
    def median_loc(self) -> float:
        return float(np.median(self.loc_err)) if self.loc_err else float("nan")

    @property
    def p90_loc(self) -> float:
        return _pct(self.loc_err, 90)


def score(name: str, scenarios: list[LabelledSeries], reports: list[Report], max_delay: int = 20) -> Score:
    """Score one algorithm's reports on a labelled suite (see `Score`)."""
    s = Score(name)
    for sc, rep in zip(scenarios, reports):
        slower = sorted(rep.slower, key=lambda a: a.detected_at)
        if sc.negative:
            s.negatives += 1
            bad = False
            if sc.kind == "hiccup":
                s.hiccups += 1
                inside = [
                    any(a0 <= al.detected_at <= b0 + max_delay for a0, b0 in sc.excursions) for al in slower
                ]
                bad = not all(inside) or rep.is_open()
                s.hiccups_closed += not rep.is_open()
            else:
                bad = bool(slower)
            s.false_pos += bad
            continue
        used: set[int] = set()
        for o in sc.positives:
            s.positives += 1
            hit = next(
                (k for k, al in enumerate(slower) if k not in used and o <= al.detected_at <= o + max_delay),
                None,
            )
            if hit is None:
                s.false_neg += 1
                continue
            used.add(hit)
            s.delays.append(slower[hit].detected_at - o)
            s.loc_err.append(abs(slower[hit].index - o))
        if sc.kind == "small_shift":
            s.small += 1
            o = sc.onsets[0]
            s.small_found += any(o <= al.detected_at for al in slower)
        # alarms for the labelled onsets that are not positives (small shifts,
        # short transients) are not spurious; anything before the first onset is
        first = min(sc.onsets)
        s.spurious += sum(1 for k, al in enumerate(slower) if k not in used and al.detected_at < first)
        for r in sc.recoveries:
            s.recoveries += 1
            s.recoveries_found += any(r <= f.detected_at <= r + max_delay for f in rep.faster)
        if not sc.recoveries:
            # the series only slowed: any recovery report after the onset is false
            s.false_recoveries += any(f.detected_at >= first for f in rep.faster)
    return s
