"""Which link of a job is slow, from the NCCL profiler plugin's per-link
transfer times (RankReport.links): each link's network time per proxy step
against the job's other links of the same direction (Mycroft, Table 4: a
slow link shows as time on the network; a slow peer as sends waiting for
its clear-to-send, or receives for its data, not as network time). Rings
without the plugin carry no links, and nothing is said then.
"""

from __future__ import annotations

import numpy as np

from slurmguard.config import Policy
from slurmguard.reports import RankReport


def slow_links(ranks: list[tuple[str, RankReport]], policy: Policy) -> list[str]:
    """Links whose network time per step exceeds the median of the job's
    links of the same direction by more than detection.cross_group
    .median_excess, judged only among at least cross_group.min_groups links
    of that direction; as 'node/rank -> peer P: X ms/step on the network vs
    median Y', slowest first. Empty when nothing stands out."""
    cg = policy.detection.cross_group
    out: list[tuple[float, str]] = []
    for sent in (True, False):
        rows = [(n, r.rank, lk.peer, lk.net_s / lk.steps) for n, r in ranks for lk in r.links
                if lk.sent == sent and lk.steps > 0]
        if len(rows) < cg.min_groups:
            continue
        med = float(np.median([x for *_, x in rows]))
        arrow = "->" if sent else "<-"
        for node, rank, peer, per_step in rows:
            if per_step > med * (1.0 + cg.median_excess):
                text = (f"{node}/{rank} {arrow} peer {peer}: {per_step * 1e3:.3g} ms/step on the "
                        f"network vs median {med * 1e3:.3g}")
                out.append((per_step, text))
    return [text for _, text in sorted(out, key=lambda pt: (-pt[0], pt[1]))]
