"""O(1) link-validation passes for ring and tree communicators (Greyhound 4.3, Fig. 10).

Measuring every link of an N-rank communicator one at a time costs O(N) rounds (O(N^2)
for all pairs). Greyhound splits the links a ring or tree collective actually uses into
passes of non-overlapping point-to-point transfers: inside one pass every rank sends or
receives at most once, so all transfers of a pass run at the same time and identical
message sizes make a slow link stand out. The number of passes is constant:

* ring, even N: 2 passes (even -> next odd, then odd -> next even, wrapping to 0);
* ring, odd N: 3 passes (the wrap-around link (N-1) -> 0 gets a pass of its own);
* tree: 4 passes over child -> parent links of the binary tree in heap order
  (left children at even levels, right children at even levels, then the same at odd
  levels). `reverse_passes` gives the parent -> child direction in 4 more.

Ranks here are positions in the sweep's node order; the workload maps rank r on rail g
(GPU index g) to global rank r * gpus_per_node + g, and runs all rails of a pass at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

Link = tuple[int, int]
"""(src rank, dst rank): a directed transfer src -> dst."""
Passes = tuple[tuple[Link, ...], ...]


def ring_links(n: int) -> tuple[Link, ...]:
    """Directed links i -> (i+1) mod n of a ring over n ranks (none for n < 2)."""
    _check_n(n)
    if n < 2:
        return ()
    return tuple((i, (i + 1) % n) for i in range(n))


def ring_passes(n: int) -> Passes:
    """Passes covering every ring link once: 2 for even n, 3 for odd n >= 3."""
    _check_n(n)
    if n < 2:
        return ()
    even_src = tuple((i, (i + 1) % n) for i in range(0, n - 1, 2))
    odd_src = tuple((i, (i + 1) % n) for i in range(1, n - 1, 2))
    if n % 2 == 0:
        # the wrap-around link (n-1) -> 0 starts at an odd rank: it joins the odd pass
        return (even_src, odd_src + ((n - 1, 0),))
    # odd n: rank n-1 is even, and 0 already sends in the first pass, so the
    # wrap-around link (n-1) -> 0 needs a third pass
    return tuple(p for p in (even_src, odd_src, ((n - 1, 0),)) if p)


def tree_parent(rank: int) -> int | None:
    """Parent of a rank in the binary tree in heap order (root 0)."""
    return None if rank == 0 else (rank - 1) // 2


def tree_level(rank: int) -> int:
    """Depth of a rank in the heap-ordered binary tree (root = level 0)."""
    return (rank + 1).bit_length() - 1


def tree_links(n: int) -> tuple[Link, ...]:
    """Directed child -> parent links of the binary tree over n ranks."""
    _check_n(n)
    return tuple((c, (c - 1) // 2) for c in range(1, n))


def tree_passes(n: int) -> Passes:
    """Four passes covering every child -> parent link once (Greyhound Fig. 10, right).

    Pass order: left children at even levels, right children at even levels, left
    children at odd levels, right children at odd levels. Empty passes (small trees)
    are dropped, so a 2-rank tree has one pass.
    """
    _check_n(n)
    buckets: dict[tuple[int, int], list[Link]] = {(0, 0): [], (0, 1): [], (1, 0): [], (1, 1): []}
    for c in range(1, n):
        is_right = 1 if c % 2 == 0 else 0  # heap order: left child 2p+1 is odd
        buckets[(tree_level(c) % 2, is_right)].append((c, (c - 1) // 2))
    order = ((0, 0), (0, 1), (1, 0), (1, 1))
    return tuple(tuple(buckets[k]) for k in order if buckets[k])


def reverse_passes(passes: Passes) -> Passes:
    """The same passes with every link's direction flipped (still non-overlapping)."""
    return tuple(tuple((d, s) for s, d in p) for p in passes)


def passes_for(schedule: Literal["ring", "tree"], n: int) -> Passes:
    if schedule == "ring":
        return ring_passes(n)
    if schedule == "tree":
        return tree_passes(n)
    raise ValueError(f"unknown schedule {schedule!r} (ring or tree)")


def check_passes(passes: Passes, links: Iterable[Link]) -> None:
    """Raise ValueError unless `passes` cover `links` exactly once, non-overlapping.

    Non-overlapping: inside a pass no rank appears in two links (as sender or receiver),
    so every transfer of a pass has its endpoints to itself.
    """
    want = list(links)
    got = [link for p in passes for link in p]
    if sorted(got) != sorted(want) or len(set(got)) != len(got):
        raise ValueError(f"passes cover {sorted(got)}, links are {sorted(want)}")
    for i, p in enumerate(passes):
        ranks = [r for link in p for r in link]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"pass {i} uses a rank twice: {p}")


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"rank count must be a non-negative integer, got {n!r}")
