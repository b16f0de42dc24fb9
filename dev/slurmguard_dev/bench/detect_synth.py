"""Synthetic collective traces of a hybrid-parallel job, with known truth.

Used by the tests and the benchmark to check the period finder (true iteration
time per iteration is returned) and the localisers (a slow GPU, a late rank, a
stalled rank). Each iteration issues, per rank: `tp_ops` TP AllGathers /
ReduceScatters on the rank's TP communicator, then `dp_buckets` gradient
AllReduces on its DP communicator; the iteration ends when the slowest rank of
the job finishes (collectives synchronise). Deterministic given the seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slurmguard.detect.records import JobLayout, RankOps, RankPlace

ALLREDUCE, ALLGATHER, REDUCESCATTER, BROADCAST, SEND, RECV = range(6)


@dataclass
class JobSpec:
    nodes: int = 2
    gpus_per_node: int = 4
    tp: int = 2
    iterations: int = 60
    step_s: float = 0.5
    jitter: float = 0.01
    tp_ops: int = 4
    dp_buckets: int = 3
    warmup_ops: int = 7
    tp_bytes: int = 8 << 20
    dp_bytes: int = 64 << 20
    slow_rank: int | None = None  # computes `slow_factor` times slower from `slow_from`
    slow_factor: float = 1.0
    slow_from: int = 0
    late_rank: int | None = None  # starts every collective `late_s` late
    late_s: float = 0.0
    stall_rank: int | None = None  # stops issuing ops at iteration `stall_at`
    stall_at: int = 0
    phase2_at: int | None = None  # from this iteration, a different op pattern
    seed: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class JobTrace:
    ops: list[RankOps]
    layout: JobLayout
    iteration_s: np.ndarray  # true iteration durations, seconds
    tp_comm: dict[int, int]  # rank -> TP communicator id
    dp_comm: dict[int, int]  # rank -> DP communicator id
    now_ns: int  # the trace's "now" (after the last op)


def make_job(spec: JobSpec) -> JobTrace:
    rng = np.random.default_rng(spec.seed)
    world = spec.nodes * spec.gpus_per_node
    places = [
        RankPlace(r, f"node{r // spec.gpus_per_node + 1}", r % spec.gpus_per_node) for r in range(world)
    ]
    layout = JobLayout("job", places)
    tp_comm = {r: 100 + r // spec.tp for r in range(world)}
    dp_comm = {r: 200 + r % spec.tp for r in range(world)}
    rows: dict[int, list[tuple[int, int, int, int, int]]] = {r: [] for r in range(world)}
    t = 1_000_000_000  # ns
    # warm-up: a few broadcasts/barriers that do not repeat
    for i in range(spec.warmup_ops):
        for r in range(world):
            rows[r].append((BROADCAST if i % 2 else ALLREDUCE, 1, 4096 * (i + 1), t, t + 2_000_000))
        t += 50_000_000
    iters: list[float] = []
    stalled = False
    for it in range(spec.iterations):
        phase2 = spec.phase2_at is not None and it >= spec.phase2_at
        ntp = spec.tp_ops + (2 if phase2 else 0)
        base = spec.step_s * (1.0 + spec.jitter * rng.standard_normal())
        comp = base * 0.7
        t_iter0 = t
        # per-rank compute, then the collectives; the slowest rank gates each
        ready = np.full(world, float(t))
        for r in range(world):
            f = spec.slow_factor if (r == spec.slow_rank and it >= spec.slow_from) else 1.0
            ready[r] += comp * f * 1e9 * (1.0 + 0.002 * rng.standard_normal())
        seq = [(ALLGATHER if j % 2 == 0 else REDUCESCATTER, "tp", spec.tp_bytes) for j in range(ntp)]
        seq += [(ALLREDUCE, "dp", spec.dp_bytes) for _ in range(spec.dp_buckets)]
        comm_s = base * 0.3 / len(seq)
        for op, kind, nb in seq:
            start = ready.copy()
            if spec.late_rank is not None:
                start[spec.late_rank] += spec.late_s * 1e9
            groups = tp_comm if kind == "tp" else dp_comm
            end = np.empty(world)
            for g in set(groups.values()):
                members = [r for r in range(world) if groups[r] == g]
                gate = max(start[m] for m in members)
                for m in members:
                    end[m] = gate + comm_s * 1e9
            for r in range(world):
                if spec.stall_rank is not None and it >= spec.stall_at:
                    if r == spec.stall_rank:
                        continue  # this rank never issues the op
                    groups_r = tp_comm if kind == "tp" else dp_comm
                    if groups_r[r] == groups_r[spec.stall_rank]:
                        # its peers sit inside the collective, waiting
                        rows[r].append((op, groups[r], nb, int(start[r]), 0))
                        stalled = True
                        continue
                rows[r].append((op, groups[r], nb, int(start[r]), int(end[r])))
            ready = end
            if stalled:
                break
        t = int(ready.max()) + 1_000_000
        iters.append((t - t_iter0) / 1e9)
        if stalled:
            break
    ops = [RankOps.from_rows(r, rows[r]) for r in range(world)]
    return JobTrace(ops, layout, np.asarray(iters), tp_comm, dp_comm, t + 5_000_000_000)
