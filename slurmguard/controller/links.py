"""Which link of a job is slow, from the NCCL profiler plugin's per-link
transfer times (RankReport.links): each link's network time per proxy step
against the job's other links of the same direction (Mycroft, Table 4: a
slow link shows as time on the network; a slow peer as sends waiting for
its clear-to-send, or receives for its data, not as network time). Rings
without the plugin carry no links, and nothing is said then.

Which node the slow links point at (link_verdict): every link is seen from
both ends (the sender's proxy times its sends, the receiver's its
receives), each end reported by the rank on its own node. A node whose NIC
or cable is slow slows every link through it: it reports slow ends in both
directions (it sends slowly to its next ring neighbour and receives slowly
from its previous one), and its neighbours each report the other end of
one of those links. That node is the one common to the slow links, and it
is named; one slow link alone (a sender and a receiver, each one way), or
slow links with no common node, point at no single node (the switch, a
cable between two nodes, or congestion), and that is said instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from slurmguard.config import Policy
from slurmguard.wire import RankReport


@dataclass(frozen=True)
class LinkVerdict:
    """What the slow links say: `links` as slow_links words them; `node`
    the one node common to them (None: no single node); `ranks` that node's
    ranks with slow link ends; `why` one sentence for the incident."""

    links: tuple[str, ...]
    node: str | None
    ranks: tuple[int, ...]
    why: str


def slow_links(ranks: list[tuple[str, RankReport]], policy: Policy) -> list[str]:
    """Links whose network time per step exceeds the median of the job's
    links of the same direction by more than detection.cross_group
    .median_excess, judged only among at least cross_group.min_groups links
    of that direction; as 'node/rank -> peer P: X ms/step on the network vs
    median Y', slowest first. Empty when nothing stands out."""
    return [text for _, text, *_ in _slow_ends(ranks, policy)]


def _slow_ends(ranks: list[tuple[str, RankReport]], policy: Policy) -> list[tuple]:
    """(net s per step, text, node, rank, sent) of each slow link end, slowest first."""
    cg = policy.detection.cross_group
    out: list[tuple] = []
    for sent in (True, False):
        rows = [
            (n, r.rank, lk.peer, lk.net_s / lk.steps)
            for n, r in ranks
            for lk in r.links
            if lk.sent == sent and lk.steps > 0
        ]
        if len(rows) < cg.min_groups:
            continue
        med = float(np.median([x for *_, x in rows]))
        arrow = "->" if sent else "<-"
        for node, rank, peer, per_step in rows:
            if per_step > med * (1.0 + cg.median_excess):
                text = (
                    f"{node}/{rank} {arrow} peer {peer}: {per_step * 1e3:.3g} ms/step on the "
                    f"network vs median {med * 1e3:.3g}"
                )
                out.append((per_step, text, node, rank, sent))
    return sorted(out, key=lambda pt: (-pt[0], pt[1]))


def link_verdict(ranks: list[tuple[str, RankReport]], policy: Policy) -> LinkVerdict | None:
    """The node the job's slow links point at, or why none (see the module
    docstring); None when no link is slow (or no rank reports links).

    A node is named when it reports slow ends in both directions and the
    other nodes' slow ends are no more than the other ends of its links
    (their slow receives at most its slow sends, their slow sends at most
    its slow receives); otherwise no node is named."""
    ends = _slow_ends(ranks, policy)
    if not ends:
        return None
    links = tuple(text for _, text, *_ in ends)
    sends = Counter(node for _, _, node, _, sent in ends if sent)
    recvs = Counter(node for _, _, node, _, sent in ends if not sent)
    both = sorted(n for n in sends if n in recvs)
    nodes = sorted(set(sends) | set(recvs))
    if len(both) == 1:
        x = both[0]
        if sum(recvs.values()) - recvs[x] <= sends[x] and sum(sends.values()) - sends[x] <= recvs[x]:
            rks = tuple(sorted({rank for _, _, node, rank, _ in ends if node == x}))
            return LinkVerdict(
                links,
                x,
                rks,
                (
                    f"slow links point at {x}: it sends ({sends[x]}) and receives ({recvs[x]}) slowly "
                    f"on the network, its neighbours only on their links with it; {links[0]}"
                ),
            )
    return LinkVerdict(
        links,
        None,
        (),
        (
            f"slow links on {', '.join(nodes)} point at no single node (no node common to them: a "
            f"cable, switch or congestion between nodes); no node is blamed for them"
        ),
    )
