"""Cross-group comparison (Greyhound 4.3).

Communicator groups that carry the same op with the same message size form a
"comparable cluster"; their op durations should match. A group whose typical
duration exceeds the cluster median by more than `median_excess` holds a
straggler. The suspects are the (node, GPU) places of the slow groups' ranks
that do not also sit in a healthy group of the same cluster, and the node
pairs a slow group crosses (the links its ring uses).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from slurmguard.config import CrossGroupPolicy
from slurmguard.detect.records import JobLayout, RankOps


@dataclass(frozen=True)
class GroupTime:
    comm: int
    op: int
    nbytes: int
    ranks: tuple[int, ...]
    seconds: float          # mean op duration of the group (over members and ops)
    samples: int


@dataclass(frozen=True)
class SlowGroup:
    comm: int
    op: int
    nbytes: int
    ranks: tuple[int, ...]
    seconds: float
    cluster_median: float
    excess: float           # seconds / cluster_median - 1
    cluster_size: int


def group_times(ops: list[RankOps], since_ns: int = 0) -> list[GroupTime]:
    """Mean duration per (communicator, op, bytes) over completed ops after since_ns,
    over all its members.

    A collective's duration on a rank includes waiting for the others. A slow
    member often makes its peers wait in only the first collective after its
    compute, so a median over ops would hide it; the mean keeps it.
    """
    per: dict[tuple[int, int, int], dict[int, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
    for ro in ops:
        ok = ro.completed & (ro.start_ns >= since_ns)
        if not ok.any():
            continue
        dur = (ro.end_ns[ok] - ro.start_ns[ok]) / 1e9
        keys = np.stack([ro.comm[ok], ro.op[ok], ro.nbytes[ok]], axis=1)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        for i, key in enumerate(uniq):
            per[tuple(int(v) for v in key)][ro.rank].append(dur[inv.ravel() == i])
    out = []
    for (comm, op, nb), by_rank in per.items():
        allv = np.concatenate([np.concatenate(v) for v in by_rank.values()])
        out.append(GroupTime(comm, op, nb, tuple(sorted(by_rank)), float(allv.mean()), int(allv.size)))
    return out


def slow_groups(times: list[GroupTime], policy: CrossGroupPolicy | None = None) -> list[SlowGroup]:
    """Groups slower than their comparable cluster's median by > median_excess."""
    p = policy or CrossGroupPolicy()
    clusters: dict[tuple[int, int], list[GroupTime]] = defaultdict(list)
    for g in times:
        clusters[(g.op, g.nbytes)].append(g)
    out = []
    for (op, nb), groups in clusters.items():
        if len(groups) < p.min_groups:
            continue
        med = float(np.median([g.seconds for g in groups]))
        if med <= 0:
            continue
        for g in groups:
            ex = g.seconds / med - 1.0
            if ex > p.median_excess:
                out.append(SlowGroup(g.comm, op, nb, g.ranks, g.seconds, med, ex, len(groups)))
    return sorted(out, key=lambda s: -s.excess)


@dataclass(frozen=True)
class Suspects:
    """Places implicated by slow groups: GPUs as (node, gpu), links as node pairs."""

    gpus: tuple[tuple[str, int | None], ...]
    nodes: tuple[str, ...]
    links: tuple[tuple[str, str], ...]


def suspects(slow: list[SlowGroup], times: list[GroupTime], layout: JobLayout) -> Suspects:
    """Narrow slow groups to places: drop those that also sit in a healthy
    group of the same comparable cluster."""
    if not slow:
        return Suspects((), (), ())
    slow_keys = {(s.comm, s.op, s.nbytes) for s in slow}
    clusters = {(s.op, s.nbytes) for s in slow}
    healthy: set[tuple[str, int | None]] = set()
    for g in times:
        if (g.op, g.nbytes) in clusters and (g.comm, g.op, g.nbytes) not in slow_keys:
            healthy.update((layout.node_of(r), layout.gpu_of(r)) for r in g.ranks)
    gpus: dict[tuple[str, int | None], None] = {}
    links: dict[tuple[str, str], None] = {}
    for s in slow:
        places = [(layout.node_of(r), layout.gpu_of(r)) for r in s.ranks]
        for pl in places:
            if pl not in healthy:
                gpus.setdefault(pl, None)
        # ring order is rank order: consecutive ranks on different nodes share a link
        ring = [layout.node_of(r) for r in s.ranks]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if a != b:
                links.setdefault(tuple(sorted((a, b))), None)
    nodes = list(dict.fromkeys(n for n, _ in gpus))
    return Suspects(tuple(gpus), tuple(nodes), tuple(links))
