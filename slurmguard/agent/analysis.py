"""Per-rank analysis on the node: iteration period, step times, baseline, changes.

Greyhound 4.2: the iteration period comes from the ACF of the rank's op
sequence (slurmguard.detect.period); a rank whose iterations hold a single
collective (one DDP bucket) has a constant sequence with no ACF, so its
period is one op. Each iteration's time in collectives is measured too, so
the controller can tell the rank that computes slowly (its compute time
grows) from the peers that wait for it (their collective time grows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slurmguard.agent.rings import TrackedRing
from slurmguard.config import AgentPolicy, DetectionPolicy, PeriodPolicy
from slurmguard.detect.period import step_times
from slurmguard.detect.records import RankOps
from slurmguard.detect.steps import DetectorConfig, StepDetector
from slurmguard.reports import ChangeReport, RankReport, StepSample


def iteration_bounds(tr: TrackedRing, detection: DetectionPolicy) -> np.ndarray | None:
    """Monotonic ns at which each iteration started (anchor op starts), or None."""
    ops = RankOps(tr.header.global_rank, tr.op, tr.comm, tr.nbytes, tr.start_ns, tr.end_ns)
    return iteration_starts(ops, detection.period)


def iteration_starts(ops: RankOps, period: PeriodPolicy) -> np.ndarray | None:
    """Start times (ns, the ops' clock) of each iteration's anchor op, or None.

    Pure: the same logic for the agent's live rings and for archived traces.
    """
    n = len(ops)
    if n < 4:
        return None
    symbols = np.stack([ops.op, ops.comm, ops.nbytes], axis=1)
    # One collective per iteration (a single DDP bucket): the sequence is
    # constant and has no ACF. Start-up broadcasts and a final barrier
    # around it must not hide that, so look for the longest run of one
    # repeated symbol; when it holds most of the ops, each op is an iteration.
    same = np.concatenate([[False], (symbols[1:] == symbols[:-1]).all(axis=1), [False]])
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    if edges.size:
        starts, ends = edges[0::2], edges[1::2]
        k = int(np.argmax(ends - starts))
        lo, hi = int(starts[k]), int(ends[k]) + 1  # ops lo..hi-1 share one symbol
        if hi - lo >= max(4, n // 2):
            return ops.start_ns[lo:hi].copy()
    st = step_times(ops, period)
    if st is None:
        return None
    first = st.end_ns[0] - int(st.seconds[0] * 1e9)
    return np.concatenate([[first], st.end_ns])


@dataclass
class RankAnalyzer:
    """Keeps one rank's derived state between polls."""

    agent: AgentPolicy
    detection: DetectionPolicy
    baseline_s: float | None = None
    baseline_compute_s: float | None = None
    total_steps: int = 0
    _det: StepDetector | None = None
    _fed_until_ns: int = 0
    _fed_ends: list[float] = field(default_factory=list)
    _fed_base: int = 0               # detector index of _fed_ends[0]
    _fed_compute: list[float] = field(default_factory=list)
    changes: list[ChangeReport] = field(default_factory=list)

    def report(self, tr: TrackedRing) -> RankReport:
        steps = self._steps(tr)
        self._feed_bocd(tr, steps)
        h = tr.header
        last_end = int(tr.end_ns[-1]) if tr.end_ns.size else None
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
        ok = (idx >= 0) & (idx < bounds.size - 1)
        comm = np.bincount(idx[ok], weights=dur[ok], minlength=bounds.size - 1)[: bounds.size - 1]
        step = np.diff(bounds).astype(np.float64)
        comm = np.minimum(comm, step)
        off = tr.header.clock_offset_ns
        self.total_steps = max(self.total_steps, int(step.size))
        return [StepSample(end=(int(b) + off) / 1e9, step_s=float(s) / 1e9, comm_s=float(c) / 1e9)
                for b, s, c in zip(bounds[1:], step, comm)]

    def _feed_bocd(self, tr: TrackedRing, steps: list[StepSample]) -> None:
        """Feed new iterations to the step detector (slurmguard.detect.steps, the
        same code and thresholds as the controller, the CLI and the bench).

        The rank's baseline is the detector's: once it has learned the rank's
        step pattern (after agent.warmup_steps + agent.baseline_steps
        iterations), the mean step over one period, and the median compute time
        of those iterations. Every verified change becomes a ChangeReport:
        `at` is the end of the last iteration before it (the located onset),
        `detected_at` the end of the iteration at which the detector knew.
        """
        if self._det is None:
            cfg = DetectorConfig.from_parts(self.detection.bocd, self.agent.warmup_steps,
                                            self.agent.baseline_steps)
            self._det = StepDetector(1, cfg)
        det = self._det
        off_s = tr.header.clock_offset_ns / 1e9
        keep = det.cfg.warmup + det.cfg.learn
        for s in steps:
            end_ns = int((s.end - off_s) * 1e9)
            if end_ns <= self._fed_until_ns:
                continue
            self._fed_until_ns = end_ns
            self._fed_ends.append(s.end)
            if len(self._fed_compute) < keep:
                self._fed_compute.append(s.step_s - s.comm_s)
            for cp in det.update(np.array([s.step_s])):
                self.changes.append(ChangeReport(
                    at=self._fed_end(cp.index - 1), direction=cp.direction, before_s=cp.level_before,
                    after_s=cp.level_after, detected_at=self._fed_end(cp.detected_at)))
            if det.learned(0):
                # follows the detector: learned again after a long warm-up, or
                # moved when the job got faster
                self.baseline_s = det.baseline_s(0)
                if self.baseline_compute_s is None and self._fed_compute[det.cfg.warmup:]:
                    self.baseline_compute_s = float(np.median(self._fed_compute[det.cfg.warmup:]))
        # the detector's indices are positions in this list: keep it, but only
        # as far back as a change can be located (the detector's history)
        drop = len(self._fed_ends) - 2 * det.hcap
        if drop > 0:
            del self._fed_ends[:drop]
            self._fed_base += drop

    def _fed_end(self, k: int) -> float:
        """End time (Unix s) of the k-th iteration fed to the detector, clamped
        to the iterations still kept (k = -1, a change at the very first
        iteration: the end of the first)."""
        j = min(max(k - self._fed_base, 0), len(self._fed_ends) - 1)
        return self._fed_ends[j]
