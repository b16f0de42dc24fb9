"""Parallelism-topology adjustment (Greyhound S3, section 5.2).

A hybrid-parallel job is laid out as a grid of roles: PP stage ``s`` (row) by
DP replica ``d`` (column); each role is held by one worker (a node, or a GPU,
whatever unit stragglers and links are reported in). Two plans:

- **Straggler consolidation.** Workers of one PP stage run in lock-step, so a
  stage is as slow as its slowest worker however many stragglers it holds.
  Moving all stragglers into the fewest stages, ``ceil(#stragglers / workers
  per stage)``, bounds the damage; interior stages are preferred because the
  first and last stages carry the embedding/loss layers and are already the
  most loaded.
- **DP/PP role swap.** DP gradient all-reduce moves far more bytes per
  iteration than PP activations (Falcon 9.2: Theta(h^2) vs Theta(h)), so
  exchanging the roles of two workers such that a congested link carries PP
  traffic (or none) instead of DP traffic relieves the job.

Link traffic model: in stage ``s`` the DP ring joins replica ``d`` and
``(d+1) mod D``; pipeline ``d`` joins stage ``s`` and ``s+1``. Plans are lists of
role swaps between two workers, applied by the job at a pause (dump
parameters to host memory, exchange peer-to-peer, resume).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurmguard.errors import InputError


@dataclass(frozen=True)
class Swap:
    """Workers ``a`` and ``b`` exchange their (stage, replica) roles."""

    a: str
    b: str

    def to_json(self) -> list[str]:
        return [self.a, self.b]


@dataclass(frozen=True)
class Layout:
    """``stages[s][d]``: the worker holding PP stage ``s`` of DP replica ``d``."""

    stages: tuple[tuple[str, ...], ...]

    @classmethod
    def of(cls, stages: Iterable[Iterable[str]]) -> Layout:
        rows = tuple(tuple(str(w) for w in row) for row in stages)
        if not rows or not rows[0]:
            raise InputError("layout: needs at least one stage with one worker")
        width = len(rows[0])
        for s, row in enumerate(rows):
            if len(row) != width:
                raise InputError(
                    f"layout: stage {s} has {len(row)} workers, stage 0 has {width}; "
                    "every PP stage needs the same number"
                )
        seen: set[str] = set()
        for s, row in enumerate(rows):
            for w in row:
                if w in seen:
                    raise InputError(f"layout: worker {w!r} appears twice (again in stage {s})")
                seen.add(w)
        return cls(rows)

    @classmethod
    def grid(cls, pp: int, dp: int, prefix: str = "w") -> Layout:
        """Workers named ``{prefix}{i}``, rank order stage-major: i = s*dp + d."""
        return cls.of([[f"{prefix}{s * dp + d}" for d in range(dp)] for s in range(pp)])

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def dp(self) -> int:
        return len(self.stages[0])

    def roles(self) -> dict[str, tuple[int, int]]:
        return {w: (s, d) for s, row in enumerate(self.stages) for d, w in enumerate(row)}

    def swapped(self, swaps: Iterable[Swap]) -> Layout:
        grid = [list(row) for row in self.stages]
        roles = self.roles()
        for sw in swaps:
            (sa, da), (sb, db) = roles[sw.a], roles[sw.b]
            grid[sa][da], grid[sb][db] = sw.b, sw.a
            roles[sw.a], roles[sw.b] = (sb, db), (sa, da)
        return Layout(tuple(tuple(r) for r in grid))

    def to_json(self) -> list[list[str]]:
        return [list(r) for r in self.stages]


# ------------------------------------------------------------ consolidation
@dataclass(frozen=True)
class ConsolidationPlan:
    """Where the stragglers go.

    ``stages_needed``: ceil(#stragglers / workers per stage); ``stages_before``
    / ``stages_after``: stage indices that hold a straggler before/after;
    ``swaps``: role exchanges that realise it; ``layout``: the result.
    """

    stragglers: tuple[str, ...]
    stages_needed: int
    stages_before: tuple[int, ...]
    stages_after: tuple[int, ...]
    swaps: tuple[Swap, ...]
    layout: Layout

    @property
    def improves(self) -> bool:
        return bool(self.swaps)

    def to_json(self) -> dict[str, object]:
        return {
            "stragglers": list(self.stragglers),
            "stages_needed": self.stages_needed,
            "stages_before": list(self.stages_before),
            "stages_after": list(self.stages_after),
            "swaps": [s.to_json() for s in self.swaps],
            "layout": self.layout.to_json(),
        }


def stages_needed(stragglers: int, per_stage: int) -> int:
    """Greyhound 5.2: ``ceil(#stragglers / #GPUs per PP stage)``."""
    if per_stage < 1:
        raise InputError(f"consolidation: workers per stage must be >= 1, got {per_stage}")
    return math.ceil(stragglers / per_stage) if stragglers > 0 else 0


def plan_consolidation(layout: Layout, stragglers: Iterable[str]) -> ConsolidationPlan:
    """Consolidate ``stragglers`` into the fewest PP stages, interior first.

    Target stages are chosen lexicographically: fewest first/last stages used
    (only when there are more than two stages), then the most stragglers
    already in place (fewest swaps), then closest to the middle, then lowest
    index. Each straggler outside the targets swaps with a healthy worker of a
    target stage, the same DP replica when one is free.
    """
    roles = layout.roles()
    strag = tuple(dict.fromkeys(str(w) for w in stragglers))
    for w in strag:
        if w not in roles:
            raise InputError(f"consolidation: straggler {w!r} is not a worker of the job's layout")
    pp, dp = layout.pp, layout.dp
    k = stages_needed(len(strag), dp)
    is_strag = set(strag)
    count = [sum(1 for w in row if w in is_strag) for row in layout.stages]
    before = tuple(s for s in range(pp) if count[s])
    if k == 0:
        return ConsolidationPlan(strag, 0, before, before, (), layout)
    edges = {0, pp - 1} if pp > 2 else set()
    mid = (pp - 1) / 2
    interior = sorted((s for s in range(pp) if s not in edges), key=lambda s: (-count[s], abs(s - mid), s))
    outer = sorted(edges, key=lambda s: (-count[s], s))
    targets = set((interior + outer)[:k])
    swaps: list[Swap] = []
    free = {s: [d for d, w in enumerate(layout.stages[s]) if w not in is_strag] for s in sorted(targets)}
    for s in range(pp):
        if s in targets:
            continue
        for d, w in enumerate(layout.stages[s]):
            if w not in is_strag:
                continue
            slot = next(((t, d) for t in sorted(free) if d in free[t]), None)
            if slot is None:
                slot = next((t, free[t][0]) for t in sorted(free) if free[t])
            t, dd = slot
            free[t].remove(dd)
            swaps.append(Swap(w, layout.stages[t][dd]))
    after_layout = layout.swapped(swaps)
    after = tuple(s for s, row in enumerate(after_layout.stages) if any(w in is_strag for w in row))
    return ConsolidationPlan(strag, k, before, after, tuple(swaps), after_layout)


# ------------------------------------------------------------ DP/PP role swap
@dataclass(frozen=True)
class LinkUse:
    """What a link carries: ``"dp"``, ``"pp"`` or ``"none"``, and bytes/iteration."""

    a: str
    b: str
    kind: str
    bytes_per_iter: float

    def to_json(self) -> dict[str, object]:
        return {"link": [self.a, self.b], "carries": self.kind, "bytes_per_iter": self.bytes_per_iter}


@dataclass(frozen=True)
class RoleSwapPlan:
    """Swaps that move congested links off heavy DP traffic.

    ``bytes_before``/``bytes_after``: traffic per iteration over the congested
    links under the old/new layout.
    """

    swaps: tuple[Swap, ...]
    before: tuple[LinkUse, ...]
    after: tuple[LinkUse, ...]
    layout: Layout

    @property
    def bytes_before(self) -> float:
        return sum(u.bytes_per_iter for u in self.before)

    @property
    def bytes_after(self) -> float:
        return sum(u.bytes_per_iter for u in self.after)

    def to_json(self) -> dict[str, object]:
        return {
            "swaps": [s.to_json() for s in self.swaps],
            "before": [u.to_json() for u in self.before],
            "after": [u.to_json() for u in self.after],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "layout": self.layout.to_json(),
        }


def link_kind(ra: tuple[int, int], rb: tuple[int, int], pp: int, dp: int) -> str:
    """Which traffic joins two roles under the ring-DP / chain-PP model."""
    (sa, da), (sb, db) = ra, rb
    if sa == sb and dp >= 2 and (db - da) % dp in (1, dp - 1):
        return "dp"
    if da == db and abs(sa - sb) == 1:
        return "pp"
    return "none"


def hybrid_comm_bytes(
    *,
    layers: int,
    hidden: int,
    seq_len: int,
    micro_batch: int,
    microbatches: int,
    tp: int,
    pp: int,
    bytes_per_value: int = 2,
    allreduce_factor: float = 2.0,
) -> tuple[float, float]:
    """Per-iteration bytes of (DP, PP) traffic, Falcon appendix 9.2.

    DP: ``k`` times the gradients of one GPU's shard, ``12*L*h^2 / (P*T)``
    values (Eq. 9, parameter count N ~ 12 L h^2 from Eq. 6); ``k`` is
    ``allreduce_factor``, default 2 (a ring all-reduce sends 2(D-1)/D copies).
    PP: the activations of the micro-batches crossing a stage boundary,
    ``m*b*n_ctx*h`` values (Eq. 10). ``bytes_per_value``: 2 for fp16/bf16.
    """
    for name, v in (
        ("layers", layers),
        ("hidden", hidden),
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("microbatches", microbatches),
        ("tp", tp),
        ("pp", pp),
    ):
        if v < 1:
            raise InputError(f"comm volume: {name}={v} must be >= 1")
    dp_bytes = allreduce_factor * 12.0 * layers * hidden**2 / (pp * tp) * bytes_per_value
    pp_bytes = float(microbatches * micro_batch * seq_len * hidden) * bytes_per_value
    return dp_bytes, pp_bytes


def _traffic(kind: str, dp_bytes: float, pp_bytes: float) -> float:
    return dp_bytes if kind == "dp" else pp_bytes if kind == "pp" else 0.0


def _uses(
    layout: Layout, links: Sequence[tuple[str, str]], dp_bytes: float, pp_bytes: float
) -> tuple[LinkUse, ...]:
    roles = layout.roles()
    out = []
    for a, b in links:
        kind = link_kind(roles[a], roles[b], layout.pp, layout.dp)
        out.append(LinkUse(a, b, kind, _traffic(kind, dp_bytes, pp_bytes)))
    return tuple(out)


def plan_role_swap(
    layout: Layout,
    congested: Iterable[tuple[str, str]],
    *,
    dp_bytes: float = 1.0,
    pp_bytes: float = 0.01,
    max_swaps: int = 1,
) -> RoleSwapPlan:
    """Choose up to ``max_swaps`` role exchanges that minimise the bytes per
    iteration crossing the ``congested`` links (worker pairs).

    ``dp_bytes``/``pp_bytes``: traffic of a DP-ring / PP link per iteration;
    only their ratio matters (default 100:1, Greyhound 5.2: tens of GB of
    gradients vs tens to hundreds of MB of activations). Use
    :func:`hybrid_comm_bytes` for a model's real figures. Greedy best
    improvement, one swap at a time: only swaps touching an endpoint of a
    congested link can change its traffic, so each round costs
    O(#endpoints x #workers x #links). Default one swap, as in the paper.
    """
    roles = layout.roles()
    links: list[tuple[str, str]] = []
    for pair in congested:
        a, b = (str(x) for x in pair)
        for w in (a, b):
            if w not in roles:
                raise InputError(f"role swap: link endpoint {w!r} is not a worker of the job's layout")
        if a == b:
            raise InputError(f"role swap: link {a}-{b} joins a worker to itself")
        links.append((a, b))
    if dp_bytes < 0 or pp_bytes < 0:
        raise InputError("role swap: traffic volumes must be >= 0")
    before = _uses(layout, links, dp_bytes, pp_bytes)
    current = layout
    swaps: list[Swap] = []
    workers = [w for row in layout.stages for w in row]
    ends = list(dict.fromkeys(w for link in links for w in link))
    pp, dp = layout.pp, layout.dp  # swaps never change the grid's shape

    def cost(r: dict[str, tuple[int, int]]) -> float:
        return sum(_traffic(link_kind(r[a], r[b], pp, dp), dp_bytes, pp_bytes) for a, b in links)

    for _ in range(max_swaps):
        cur_roles = current.roles()
        best = cost(cur_roles)
        best_swap: Swap | None = None
        for e in ends:
            for w in workers:
                if w == e:
                    continue
                # Try the exchange in place and undo it: copying the role map
                # per candidate would make a round quadratic in the job size.
                re_, rw = cur_roles[e], cur_roles[w]
                cur_roles[e], cur_roles[w] = rw, re_
                c = cost(cur_roles)
                cur_roles[e], cur_roles[w] = re_, rw
                if c < best:
                    best, best_swap = c, Swap(e, w)
        if best_swap is None:
            break
        swaps.append(best_swap)
        current = current.swapped([best_swap])
    return RoleSwapPlan(tuple(swaps), before, _uses(current, links, dp_bytes, pp_bytes), current)
