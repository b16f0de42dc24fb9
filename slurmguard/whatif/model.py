"""The dependency model of paper 004 section 3.2, built once per trace.

Each worker runs six streams: compute (forward/backward), DP communication
(params-sync = params-all-gather, grads-sync = grads-reduce-scatter) and the
four PP streams (forward-send, forward-recv, backward-send, backward-recv).
Dependencies, all between slots of the same worker (same DP rank and step):

* same stream: adjacent ops run in order (compute and DP stream in recorded
  order, PP streams by seq_id);
* params-sync before the first forward-compute of its model chunk; the last
  backward-compute before the post-backward chain (gc, layernorm/embedding
  all-reduce, grads-sync, optimizer-clip, optimizer);
* PP: a receive completes before the compute that consumes its microbatch; a
  send starts after the compute that produced it. A receive is launched after
  the compute op that precedes its consumer on the compute stream (NCCL's
  stream waits for the work enqueued before the call).

Cross-rank dependencies are *groups*: no member starts transferring before all
members have launched. PP send/recv pairs between adjacent stages of one DP
rank, embedding-grads all-reduce between the first and last stage, params-sync
and grads-sync among the DP ranks of a stage, and optimizer-clip (global grad
norm) among all workers. The dependency structure is the same for every step
and DP rank, so it is built over slots and evaluated on (step x DP rank) planes.

For evaluation the slots are split into *levels*: a group and the slots that
depend on nothing later than level k - 1 form level k, so the simulator runs
one vectorised update per level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from slurmguard.errors import InputError
from slurmguard.whatif import optypes as ot
from slurmguard.whatif.tensor import OpTensor


@dataclass
class Level:
    """One vectorised step of the simulation (see module docstring).

    Index arrays point into the simulator's per-slot arrays; the extra row
    `n_slots` is a sentinel (end time 0 for padded dependencies, launch time
    -inf for padded group members).
    """

    slots: np.ndarray
    """(k,) slots evaluated at this level."""
    deps: np.ndarray
    """(k, max_deps) dependency slots of each, padded with the sentinel."""
    local_pos: np.ndarray
    """positions (into `slots`) of slots that are not in a group."""
    member_pos: np.ndarray
    """positions (into `slots`) of group members."""
    member_group: np.ndarray
    """for each member, the row of its group in `group_members`."""
    group_members: np.ndarray
    """(g, max_members) member slots of each group, padded with the sentinel."""
    group_dp_sync: np.ndarray
    """(g,) bool: the group also spans all DP ranks."""


@dataclass
class DependencyModel:
    n_slots: int
    deps: list[list[int]]
    """Per slot, the slots of the same worker it waits for."""
    groups: list[list[int]]
    """Cross-rank groups (member slots); DP-spanning ones are flagged in group_dp_sync."""
    group_dp_sync: list[bool]
    group_of: np.ndarray
    """(n,) group index of a slot, -1 when it is a local op."""
    levels: list[Level] = field(default_factory=list)

    @property
    def is_comm(self) -> np.ndarray:
        """(n,) slots whose duration in the simulation is a transfer-duration."""
        return self.group_of >= 0


def build_model(t: OpTensor) -> DependencyModel:
    """Derive the dependency model from the slots of a trace; errors name the stage and op type."""
    n = t.n_slots
    pp = t.meta.pp_size
    dp_sync = t.meta.dp_size > 1
    deps: list[set[int]] = [set() for _ in range(n)]
    groups: list[list[int]] = []
    group_sync: list[bool] = []

    def chain(slots: list[int] | np.ndarray) -> None:
        for a, b in pairwise(slots):
            deps[int(b)].add(int(a))

    for s in range(pp):
        mine = np.flatnonzero(t.slot_stage == s)
        comp = mine[np.isin(t.slot_optype[mine], ot.COMPUTE)]
        comp = comp[np.lexsort((t.slot_seq[comp], t.slot_optype[comp].astype(str), t.order[comp]))]
        if len(comp) == 0:
            raise InputError(f"{t.source}: stage {s} has no forward-compute/backward-compute ops")
        chain(comp)
        comp_pos = {int(c): i for i, c in enumerate(comp)}
        by_type = {name: t.slots_of(s, name) for name in ot.COMPUTE}
        for name in ot.P2P:
            p2p = t.slots_of(s, name)
            if len(p2p) == 0:
                continue
            chain(p2p)
            compute = by_type[ot.P2P_COMPUTE[name]]
            if len(p2p) != len(compute):
                raise InputError(
                    f"{t.source}: stage {s} has {len(p2p)} {name} but {len(compute)}"
                    f" {ot.P2P_COMPUTE[name]} ops; each PP transfer must belong to one microbatch"
                    " (non-interleaved schedules only)"
                )
            for op, c in zip(p2p, compute):
                if name.endswith("send"):
                    deps[int(op)].add(int(c))
                else:
                    deps[int(c)].add(int(op))
                    before = comp_pos[int(c)] - 1
                    if before >= 0:
                        deps[int(op)].add(int(comp[before]))
        # DP stream: params-sync and grads-sync in recorded order.
        dpc = mine[np.isin(t.slot_optype[mine], ot.DP_COMM)]
        chain(dpc[np.lexsort((t.slot_seq[dpc], t.order[dpc]))])
        bwd = by_type[ot.BACKWARD_COMPUTE]
        # The latest params-sync of a model chunk gates that chunk's first forward.
        fwd_in_order = [int(c) for c in comp if t.slot_optype[c] == ot.FORWARD_COMPUTE]
        ags = t.slots_of(s, ot.PARAMS_ALL_GATHER)
        last_ag = {int(t.slot_mc[a]): int(a) for a in ags[np.argsort(t.order[ags], kind="stable")]}
        for mc, ag in last_ag.items():
            targets = [c for c in fwd_in_order if t.slot_mc[c] == mc] or fwd_in_order
            if targets:
                deps[targets[0]].add(ag)
        overlapped = len(t.slots_of(s, ot.SEPARATE_GRADS_ALL_REDUCE)) > 0
        post: list[int] = []
        for name in ot.POST_CHAIN:
            if name == ot.GRADS_REDUCE_SCATTER and overlapped:
                continue
            post.extend(int(x) for x in t.slots_of(s, name))
        if post:
            deps[post[0]].add(int(comp[-1]))
            chain(post)
        if overlapped:
            rs = t.slots_of(s, ot.GRADS_REDUCE_SCATTER)
            for r in rs:
                same_mc = [c for c in bwd if t.slot_mc[c] == t.slot_mc[r]]
                deps[int(r)].add(int(same_mc[-1] if same_mc else bwd[-1]))
            if len(rs) and len(post) > 1:
                deps[post[1]].add(int(rs[-1]))

    # PP pairs: k-th send of stage s with k-th matching receive of the peer stage.
    for s in range(pp):
        for name in (ot.FORWARD_SEND, ot.BACKWARD_SEND):
            sends = t.slots_of(s, name)
            if len(sends) == 0:
                continue
            peer_type, off = ot.P2P_PEER[name]
            peer = s + off
            recvs = t.slots_of(peer, peer_type) if 0 <= peer < pp else np.empty(0, dtype=np.int64)
            if len(recvs) != len(sends):
                raise InputError(
                    f"{t.source}: stage {s} has {len(sends)} {name} but stage {peer} has"
                    f" {len(recvs)} {peer_type}; PP sends and receives must pair up"
                )
            for a, b in zip(sends, recvs):
                groups.append([int(a), int(b)])
                group_sync.append(False)
    for s in range(pp):
        for name in ot.P2P:
            if name.endswith("recv"):
                peer_type, off = ot.P2P_PEER[name]
                peer = s + off
                if len(t.slots_of(s, name)) and not (0 <= peer < pp and len(t.slots_of(peer, peer_type))):
                    raise InputError(
                        f"{t.source}: stage {s} has {name} ops but stage {peer} has no {peer_type}"
                    )
    # DP collectives: one slot, all DP ranks of the stage.
    for slot in np.flatnonzero(np.isin(t.slot_optype, ot.DP_COMM)):
        groups.append([int(slot)])
        group_sync.append(dp_sync)
    # Stage-spanning collectives, matched by seq_id.
    for name, sync in (
        (ot.EMBEDDING_GRADS_ALL_REDUCE, False),
        (ot.OPTIMIZER_CLIP_MAIN_GRAD, dp_sync),
    ):
        idx = np.flatnonzero(t.slot_optype == name)
        # a set, not np.unique: that imports numpy.ma, a tenth of the command's start-up
        for q in sorted(set(t.slot_seq[idx].tolist())):
            groups.append([int(x) for x in idx[t.slot_seq[idx] == q]])
            group_sync.append(sync)

    group_of = np.full(n, -1, dtype=np.int64)
    for g, members in enumerate(groups):
        group_of[members] = g
    model = DependencyModel(
        n_slots=n,
        deps=[sorted(d) for d in deps],
        groups=groups,
        group_dp_sync=group_sync,
        group_of=group_of,
    )
    model.levels = _levelise(model, t)
    return model


def _levelise(m: DependencyModel, t: OpTensor) -> list[Level]:
    """Topological levels of the graph whose nodes are groups and local slots."""
    n = m.n_slots
    node_of = np.where(m.group_of >= 0, m.group_of, len(m.groups) + np.arange(n))
    n_nodes = len(m.groups) + n
    members: list[list[int]] = [list(g) for g in m.groups] + [[i] for i in range(n)]
    preds: list[set[int]] = [set() for _ in range(n_nodes)]
    for v in range(n):
        for u in m.deps[v]:
            if node_of[u] != node_of[v]:
                preds[node_of[v]].add(int(node_of[u]))
    succs: list[list[int]] = [[] for _ in range(n_nodes)]
    indeg = np.zeros(n_nodes, dtype=np.int64)
    for v, ps in enumerate(preds):
        indeg[v] = len(ps)
        for u in ps:
            succs[u].append(v)
    # A slot in a group is represented by its group's node only.
    live = list(range(len(m.groups))) + [len(m.groups) + i for i in range(n) if m.group_of[i] < 0]
    live_set = set(live)
    frontier = [v for v in live if indeg[v] == 0]
    levels: list[Level] = []
    done = 0
    while frontier:
        levels.append(
            _make_level(
                m,
                [members[v] for v in frontier],
                [v < len(m.groups) for v in frontier],
                n,
            )
        )
        done += len(frontier)
        nxt = []
        for u in frontier:
            for v in succs[u]:
                indeg[v] -= 1
                if indeg[v] == 0 and v in live_set:
                    nxt.append(v)
        frontier = nxt
    if done != len(live):
        stuck = [members[v][0] for v in live if indeg[v] > 0][:4]
        names = ", ".join(
            f"stage {int(t.slot_stage[s])} {t.slot_optype[s]} #{int(t.slot_seq[s])}" for s in stuck
        )
        raise InputError(f"{t.source}: the recorded op order has a dependency cycle (involving {names})")
    return levels


def _make_level(m: DependencyModel, node_members: list[list[int]], is_group: list[bool], n: int) -> Level:
    slots: list[int] = []
    member_pos: list[int] = []
    member_group: list[int] = []
    local_pos: list[int] = []
    grp: list[list[int]] = []
    sync: list[bool] = []
    for mem, isg in zip(node_members, is_group):
        if isg:
            g = int(m.group_of[mem[0]])
            for s in mem:
                member_pos.append(len(slots))
                member_group.append(len(grp))
                slots.append(s)
            grp.append(mem)
            sync.append(m.group_dp_sync[g])
        else:
            local_pos.append(len(slots))
            slots.append(mem[0])
    width = max((len(m.deps[s]) for s in slots), default=0)
    deps = np.full((len(slots), width), n, dtype=np.int64)
    for i, s in enumerate(slots):
        deps[i, : len(m.deps[s])] = m.deps[s]
    gw = max((len(g) for g in grp), default=0)
    gm = np.full((len(grp), gw), n, dtype=np.int64)
    for i, members in enumerate(grp):
        gm[i, : len(members)] = members
    return Level(
        slots=np.asarray(slots, dtype=np.int64),
        deps=deps,
        local_pos=np.asarray(local_pos, dtype=np.int64),
        member_pos=np.asarray(member_pos, dtype=np.int64),
        member_group=np.asarray(member_group, dtype=np.int64),
        group_members=gm,
        group_dp_sync=np.asarray(sync, dtype=bool),
    )
