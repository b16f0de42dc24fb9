"""Per-rank analysis on the node: iteration period, step times, baseline, changes.

Greyhound 4.2: the iteration period comes from the ACF of the rank's op
sequence (slurmguard.detect.period); a rank whose iterations hold a single
collective (one DDP bucket) has a constant sequence with no ACF, so its
period is one op. Each iteration's time in collectives is measured too, so
the controller can tell the rank that computes slowly (its compute time
grows) from the peers that wait for it (their collective time grows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from slurmguard.agent.rings import TrackedRing
from slurmguard.config import AgentPolicy, DetectionPolicy, PeriodPolicy
from slurmguard.detect.bocd import BatchBocd
from slurmguard.detect.period import iteration_anchors
from slurmguard.detect.records import RankOps
from slurmguard.reports import ChangeReport, RankReport, StepSample


def iteration_bounds(tr: TrackedRing, detection: DetectionPolicy) -> np.ndarray | None:
    """Monotonic ns at which each iteration started (anchor op starts), or None."""
    ops = RankOps(tr.header.global_rank, tr.op, tr.comm, tr.nbytes, tr.start_ns, tr.end_ns)
    return iteration_starts(ops, detection.period)


def iteration_starts(ops: RankOps, period: PeriodPolicy) -> np.ndarray | None:
    """Start times (ns, the ops' clock) of each iteration's anchor op, or None.

    `ops` in issue order (by start time). Pure: the same logic for the
    agent's live rings and for archived traces (see
    slurmguard.detect.period.iteration_anchors).
    """
    idx = iteration_anchors(ops, period)
    return None if idx is None else ops.start_ns[idx].copy()


#: longest iteration taken as real (s); a longer "iteration" is a job
#: stopped for a day or a forged record
MAX_STEP_S = 86400.0
#: latest iteration end accepted ahead of the agent's clock (s)
FUTURE_SLACK_S = 300.0


def sane_steps(step_s: np.ndarray, comm_s: np.ndarray, end: np.ndarray,
               now: float | None = None) -> np.ndarray:
    """Mask of iteration samples that make sense: finite, 0 < step <=
    MAX_STEP_S, 0 <= comm <= step, end (Unix s) not after now + FUTURE_SLACK_S.
    Ring records come from the job, so anything else is dropped (and
    counted by the caller), never raised."""
    now = time.time() if now is None else now
    with np.errstate(invalid="ignore"):
        return (np.isfinite(step_s) & np.isfinite(comm_s) & np.isfinite(end)
                & (step_s > 0) & (step_s <= MAX_STEP_S) & (comm_s >= 0) & (comm_s <= step_s)
                & (end > 0) & (end <= now + FUTURE_SLACK_S))


@dataclass
class RankAnalyzer:
    """Keeps one rank's derived state between polls."""

    agent: AgentPolicy
    detection: DetectionPolicy
    baseline_s: float | None = None
    baseline_compute_s: float | None = None
    total_steps: int = 0
    dropped: int = 0
    """Derived samples dropped as nonsense (see sane_steps), since the rank was first seen."""
    _bocd: BatchBocd | None = None
    _fed_until_ns: int = 0
    _fed_ends: list[float] = field(default_factory=list)
    changes: list[ChangeReport] = field(default_factory=list)

    def report(self, tr: TrackedRing) -> RankReport:
        steps = self._steps(tr)
        if steps and self.baseline_s is None:
            usable = steps[self.agent.warmup_steps:]
            if len(usable) >= self.agent.baseline_steps:
                window = usable[: self.agent.baseline_steps]
                self.baseline_s = float(np.median([s.step_s for s in window]))
                self.baseline_compute_s = float(np.median([s.step_s - s.comm_s for s in window]))
        self._feed_bocd(tr, steps)
        h = tr.header
        last_end = int(tr.end_ns.max()) if tr.end_ns.size else None
        return RankReport(
            rank=h.global_rank, local_rank=h.local_rank, gpu=h.local_rank, source=h.source_name,
            baseline_step_s=self.baseline_s, baseline_compute_s=self.baseline_compute_s,
            steps=steps[-self.agent.report_steps:], total_steps=self.total_steps,
            last_progress=tr.to_unix_s(last_end) if last_end else None,
            in_flight_since=(tr.to_unix_s(tr.in_flight_since_ns)
                             if tr.in_flight_since_ns is not None else None),
            lost_records=tr.lost, changes=self.changes[-8:])

    def _steps(self, tr: TrackedRing) -> list[StepSample]:
        bounds = iteration_bounds(tr, self.detection)
        if bounds is None or bounds.size < 2:
            return []
        # time inside collectives per iteration: ops starting in [b_i, b_i+1)
        dur = (tr.end_ns - tr.start_ns).astype(np.float64)
        idx = np.searchsorted(bounds, tr.start_ns, side="right") - 1
        ok = (idx >= 0) & (idx < bounds.size - 1) & (dur >= 0)
        comm = np.bincount(idx[ok], weights=dur[ok], minlength=bounds.size - 1)[: bounds.size - 1]
        step = np.diff(bounds).astype(np.float64)
        comm = np.minimum(comm, step)
        ends = (bounds[1:].astype(np.float64) + tr.header.clock_offset_ns) / 1e9
        good = sane_steps(step / 1e9, comm / 1e9, ends)
        self.dropped += int(np.count_nonzero(~good))
        self.total_steps = max(self.total_steps, int(step.size))
        return [StepSample(end=float(e), step_s=float(s) / 1e9, comm_s=float(c) / 1e9)
                for e, s, c in zip(ends[good], step[good], comm[good])]

    def _feed_bocd(self, tr: TrackedRing, steps: list[StepSample]) -> None:
        if self.baseline_s is None:
            return
        if self._bocd is None:
            self._bocd = BatchBocd(1, self.detection.bocd)
        off_s = tr.header.clock_offset_ns / 1e9
        for s in steps:
            end_ns = int((s.end - off_s) * 1e9)
            if end_ns <= self._fed_until_ns:
                continue
            self._fed_until_ns = end_ns
            self._fed_ends.append(s.end)
            for cp in self._bocd.update(np.array([s.step_s])):
                # onset: end of the first iteration at the new level
                at = self._fed_ends[min(cp.index, len(self._fed_ends) - 1)]
                self.changes.append(ChangeReport(at=at, direction=cp.direction,
                                                 before_s=cp.level_before, after_s=cp.level_after))
