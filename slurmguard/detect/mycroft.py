"""Mycroft's trigger and root-cause rules (Mycroft 4.3 and 5.2).

Triggers (Algorithm 1), on a few sampled ranks over the last window:
- stall: ops in flight and no op completed in the window -> failure trigger;
- straggler: throughput halves or the op interval doubles against the rank's
  own earlier baseline.
Root cause (Algorithm 2):
- stall: in the communicator the stalled ops wait on, the rank that made the
  least progress (issued the fewest ops on it) is named;
- straggler: a rank whose collectives start (or end) later than its peers' by
  more than `late_threshold_s` in most instances ("constant late starts or
  ends", 1 s by default) is named.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from slurmguard.config import MycroftPolicy
from slurmguard.detect.records import JobLayout, RankOps

#: share of a window's collective instances a rank must be late in
LATE_FRACTION = 0.8
#: instances needed before "constantly late" means anything
MIN_INSTANCES = 3
#: a window within this factor of normal updates the normal throughput/interval
NORMAL_BAND = 0.8


@dataclass(frozen=True)
class Stall:
    """A failure trigger and its root cause. since_ns: last completion seen."""

    comm: int
    culprit: int
    waiting: tuple[int, ...]
    progress: dict[int, int]
    since_ns: int


@dataclass(frozen=True)
class StragglerTrigger:
    rank: int
    throughput_ratio: float   # recent / baseline bytes per second
    interval_ratio: float     # recent / baseline mean op interval
    reason: str


@dataclass(frozen=True)
class LateRank:
    rank: int
    comm: int
    which: str                # "start" or "end"
    median_late_s: float
    fraction: float
    instances: int


def sample_ranks(layout: JobLayout, dp_comm: dict[int, int] | None = None,
                 policy: MycroftPolicy | None = None) -> list[int]:
    """At most max_sampled_ranks ranks, at least one per DP group when known,
    then spread over nodes (Mycroft 4.3)."""
    p = policy or MycroftPolicy()
    chosen: list[int] = []
    if dp_comm:
        for g in sorted(set(dp_comm.values())):
            members = sorted(r for r, c in dp_comm.items() if c == g)
            if members and len(chosen) < p.max_sampled_ranks:
                chosen.append(members[0])
    for node in layout.nodes:
        if len(chosen) >= p.max_sampled_ranks:
            break
        on = [r for r in layout.ranks_on(node) if r not in chosen]
        if on and not any(layout.node_of(c) == node for c in chosen):
            chosen.append(on[0])
    return sorted(chosen)


def _members(ops: list[RankOps]) -> dict[int, list[int]]:
    m: dict[int, list[int]] = defaultdict(list)
    for ro in ops:
        for c in np.unique(ro.comm):
            m[int(c)].append(ro.rank)
    return m


def find_stall(ops: list[RankOps], now_ns: int, policy: MycroftPolicy | None = None,
               sampled: list[int] | None = None) -> Stall | None:
    """Failure trigger: sampled ranks have ops in flight and none completed in
    the last stall_window_s. Names the least-progress rank of the communicator
    the oldest in-flight op waits on."""
    p = policy or MycroftPolicy()
    window_ns = int(p.stall_window_s * 1e9)
    by_rank = {ro.rank: ro for ro in ops}
    look = [by_rank[r] for r in (sampled or list(by_rank)) if r in by_rank]
    waiting_ops: list[tuple[int, int, int]] = []  # (start, rank, comm)
    for ro in look:
        done = ro.end_ns[ro.completed]
        last_done = int(done.max()) if done.size else 0
        infl = np.nonzero(~ro.completed)[0]
        if infl.size == 0 or now_ns - last_done < window_ns:
            continue
        i = int(infl[0])
        waiting_ops.append((int(ro.start_ns[i]), ro.rank, int(ro.comm[i])))
    if not waiting_ops:
        return None
    _, _, comm = min(waiting_ops)
    members = _members(ops)[comm]
    progress = {r: int(np.sum(by_rank[r].comm == comm)) for r in members}
    culprit = min(progress, key=lambda r: (progress[r], r))
    waiting = tuple(sorted(r for r in members if (~by_rank[r].completed[by_rank[r].comm == comm]).any()))
    last = max((int(by_rank[r].end_ns[by_rank[r].completed].max()) for r in members
                if by_rank[r].completed.any()), default=0)
    return Stall(comm, culprit, waiting, progress, last)


def window_rates(ro: RankOps, now_ns: int, window_s: float) -> tuple[float, float] | None:
    """(bytes/s completed, mean interval between op starts in s) over the last window."""
    w = int(window_s * 1e9)
    done = ro.completed & (ro.end_ns >= now_ns - w) & (ro.end_ns <= now_ns)
    starts = ro.start_ns[(ro.start_ns >= now_ns - w) & (ro.start_ns <= now_ns)]
    if starts.size < 2:
        return None
    return float(ro.nbytes[done].sum()) / window_s, float(np.mean(np.diff(starts))) / 1e9


class StragglerTriggers:
    """Mycroft Algorithm 1's straggler trigger, stateful per sampled rank.

    Each `check` measures the last window; a rank triggers when its throughput
    falls to `throughput_drop` of its normal value or its op interval grows by
    `interval_growth`. The normal values are updated only by windows that did
    not trigger and stay within NORMAL_BAND of it, so a lasting slowdown keeps
    triggering.
    """

    def __init__(self, policy: MycroftPolicy | None = None, window_s: float = 10.0) -> None:
        self.policy = policy or MycroftPolicy()
        self.window_s = window_s
        self.normal: dict[int, tuple[float, float]] = {}

    def check(self, ops: list[RankOps], now_ns: int, sampled: list[int] | None = None) -> list[StragglerTrigger]:
        p = self.policy
        out = []
        for ro in ops:
            if sampled is not None and ro.rank not in sampled:
                continue
            cur = window_rates(ro, now_ns, self.window_s)
            if cur is None:
                continue
            base = self.normal.get(ro.rank)
            if base is None:
                self.normal[ro.rank] = cur
                continue
            tr = cur[0] / base[0] if base[0] > 0 else 1.0
            ir = cur[1] / base[1] if base[1] > 0 else 1.0
            reasons = []
            if tr <= p.throughput_drop:
                reasons.append(f"throughput at {tr:.0%} of normal")
            if ir >= p.interval_growth:
                reasons.append(f"op interval x{ir:.1f}")
            if reasons:
                out.append(StragglerTrigger(ro.rank, tr, ir, "; ".join(reasons)))
            elif tr >= NORMAL_BAND and ir <= 1.0 / NORMAL_BAND:
                # only a window that looks normal moves "normal": a window that
                # straddles the onset must not drag the baseline halfway
                self.normal[ro.rank] = cur
        return out


def late_ranks(ops: list[RankOps], policy: MycroftPolicy | None = None,
               since_ns: int = 0) -> list[LateRank]:
    """Ranks that start (or end) collectives later than their peers by more than
    late_threshold_s in most instances. The k-th op of a communicator on every
    member is one instance; instances are aligned from the most recent."""
    p = policy or MycroftPolicy()
    thr = p.late_threshold_s * 1e9
    by_comm: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = defaultdict(dict)
    for ro in ops:
        sel = ro.start_ns >= since_ns
        for c in np.unique(ro.comm[sel]):
            m = sel & (ro.comm == c)
            by_comm[int(c)][ro.rank] = (ro.start_ns[m], ro.end_ns[m])
    found: dict[int, LateRank] = {}
    for comm, per in by_comm.items():
        if len(per) < 2:
            continue
        ranks = sorted(per)
        n = min(v[0].size for v in per.values())
        if n < MIN_INSTANCES:
            continue
        S = np.stack([per[r][0][-n:] for r in ranks]).astype(np.float64)
        E = np.stack([per[r][1][-n:] for r in ranks]).astype(np.float64)
        E[E == 0] = np.nan
        for which, M in (("start", S), ("end", E)):
            med = np.nanmedian(M, axis=0)
            late = M - med[None, :]
            valid = np.isfinite(late).sum(axis=1)
            frac = np.where(valid > 0, (late > thr).sum(axis=1) / np.maximum(valid, 1), 0.0)
            for i, r in enumerate(ranks):
                if valid[i] >= MIN_INSTANCES and frac[i] >= LATE_FRACTION:
                    lr = LateRank(r, comm, which, float(np.nanmedian(late[i]) / 1e9),
                                  float(frac[i]), int(valid[i]))
                    if r not in found or lr.median_late_s > found[r].median_late_s:
                        found[r] = lr
    return sorted(found.values(), key=lambda x: -x.median_late_s)


def name_places(ranks: list[int], layout: JobLayout) -> list[tuple[int, str, int | None]]:
    """(rank, node, gpu) for reporting."""
    return [(r, layout.node_of(r), layout.gpu_of(r)) for r in ranks]
