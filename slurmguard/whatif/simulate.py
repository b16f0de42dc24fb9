"""Timeline simulation (paper 004 section 3.2, "Simulate an alternative timeline").

Rules: an op launches when all its dependencies have finished (its start is the
latest end among them, 0 for the first ops of a step). A local op ends at
launch + duration. Members of a group (a collective or a PP send/recv pair)
wait until every member has launched; each ends at the latest launch in the
group plus its own transfer-duration.

`simulate` evaluates many timelines at once: durations have shape
(slot, scenario, step, lane), where lanes are DP ranks (or, for attribution to
one DP rank, that rank plus one lane standing for all the identical others).
It takes one vectorised update per dependency level. `simulate_naive` is the
straightforward per-op event loop, kept as the reference and the baseline of
`slurmguard bench whatif`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from slurmguard.whatif.model import DependencyModel


@dataclass
class SimResult:
    step_time: np.ndarray
    """(scenario, step) simulated step time, seconds."""
    start: np.ndarray | None = None
    """(slot, scenario, step, lane) launch time, when requested."""
    end: np.ndarray | None = None
    """(slot, scenario, step, lane) end time, when requested."""


def simulate(model: DependencyModel, dur: np.ndarray, keep_timeline: bool = False) -> SimResult:
    """Simulate every (scenario, step, lane) timeline of `dur` (slot, scenario, step, lane) at once.

    Durations are seconds: op durations for local slots, transfer-durations for
    group members. All lanes of one (scenario, step) form one job step: groups
    flagged DP-spanning synchronise across the lane axis.
    """
    n = model.n_slots
    if dur.shape[0] != n:
        raise ValueError(f"durations have {dur.shape[0]} slots, the model {n}")
    batch = dur.shape[1:]
    end = np.empty((n + 1,) + batch, dtype=dur.dtype)
    end[n] = 0.0
    launch = np.empty((n + 1,) + batch, dtype=dur.dtype)
    launch[n] = -np.inf
    for lv in model.levels:
        if lv.deps.shape[1] == 0:
            ready = np.zeros((len(lv.slots),) + batch, dtype=dur.dtype)
        elif lv.deps.shape[1] == 1:
            ready = end[lv.deps[:, 0]]
        else:
            ready = end[lv.deps].max(axis=1)
        launch[lv.slots] = ready
        if len(lv.local_pos):
            loc = lv.slots[lv.local_pos]
            end[loc] = ready[lv.local_pos] + dur[loc]
        if len(lv.member_pos):
            begin = launch[lv.group_members].max(axis=1)
            if lv.group_dp_sync.any():
                sync = np.flatnonzero(lv.group_dp_sync)
                begin[sync] = begin[sync].max(axis=-1, keepdims=True)
            mem = lv.slots[lv.member_pos]
            end[mem] = begin[lv.member_group] + dur[mem]
    step = end[:n].max(axis=(0, -1))
    if keep_timeline:
        return SimResult(step_time=step, start=launch[:n], end=end[:n])
    return SimResult(step_time=step)


def simulate_naive(model: DependencyModel, dur: np.ndarray) -> np.ndarray:
    """Reference event loop over individual ops. `dur` is (slot, step, dp); returns (step,) times.

    One Python iteration per op instance: the cost the vectorised simulator avoids.
    """
    n, n_steps, _ = dur.shape
    succ: list[list[int]] = [[] for _ in range(n)]
    for v, ds in enumerate(model.deps):
        for u in ds:
            succ[u].append(v)
    out = np.zeros(n_steps)
    for t in range(n_steps):
        out[t] = _naive_step(model, succ, dur[:, t, :])
    return out


def _naive_step(model: DependencyModel, succ: list[list[int]], dur: np.ndarray) -> float:
    """One step of the event loop; `dur` is (slot, dp)."""
    n, dp = dur.shape
    end: dict[tuple[int, int], float] = {}
    launched: dict[tuple[int, int], float] = {}
    waiting = {(s, d): len(model.deps[s]) for s in range(n) for d in range(dp)}
    group_count: dict[tuple[int, int], int] = {}
    queue = deque(k for k, c in waiting.items() if c == 0)
    while queue:
        s, d = queue.popleft()
        ready = max((end[(u, d)] for u in model.deps[s]), default=0.0)
        g = int(model.group_of[s])
        done: list[tuple[int, int, float]] = []
        if g < 0:
            done.append((s, d, ready + float(dur[s, d])))
        else:
            launched[(s, d)] = ready
            lanes = range(dp) if model.group_dp_sync[g] else (d,)
            gkey = (g, -1 if model.group_dp_sync[g] else d)
            group_count[gkey] = group_count.get(gkey, 0) + 1
            if group_count[gkey] == len(model.groups[g]) * len(lanes):
                begin = max(launched[(m, e)] for m in model.groups[g] for e in lanes)
                done.extend((m, e, begin + float(dur[m, e])) for m in model.groups[g] for e in lanes)
        for s2, d2, at in done:
            end[(s2, d2)] = at
            for v in succ[s2]:
                waiting[(v, d2)] -= 1
                if waiting[(v, d2)] == 0:
                    queue.append((v, d2))
    if len(end) != n * dp:
        raise RuntimeError("naive simulation did not finish every op (dependency cycle)")
    return max(end.values())
