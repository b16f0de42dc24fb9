"""The OpDuration tensor of paper 004 section 3.2, for all op types at once.

Every (step, DP rank) runs the same ops: on each PP stage, the op types with
their sequence numbers. One such (stage, op type, seq_id) is a *slot*; the trace
becomes arrays of shape (slot, step, dp_rank) holding start times and durations.
The simulator then works on whole (step x DP rank) planes per slot instead of
per recorded op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from slurmguard.errors import InputError
from slurmguard.whatif.trace import OPTYPE_NAMES, JobMeta, Trace


def median(a: np.ndarray, axis: int | tuple[int, ...] | None = None) -> Any:
    """np.median(a, axis), the same values (the mean of the two middle ones when even, NaN
    where any is NaN), without np.median's first-call import of numpy.ma, which is a tenth
    of `slurmguard whatif`'s start-up. axis None: a float over all values."""
    a = np.asarray(a, dtype=float)
    flat: np.ndarray
    if axis is None:
        flat = a.reshape(-1)
    else:
        axes = {x % a.ndim for x in ((axis,) if isinstance(axis, int) else axis)}
        keep = [i for i in range(a.ndim) if i not in axes]
        moved = np.transpose(a, keep + sorted(axes))
        flat = moved.reshape(moved.shape[: len(keep)] + (-1,))
    s = np.sort(flat, axis=-1)
    n = s.shape[-1]
    out: Any
    if n == 0:
        out = np.full(s.shape[:-1], np.nan)
    else:
        m = n // 2
        out = s[..., m] if n % 2 else (s[..., m - 1] + s[..., m]) / 2
        out = np.where(np.isnan(s[..., -1]), np.nan, out)
    return float(out) if axis is None else out


@dataclass
class OpTensor:
    """A validated trace as dense arrays. Times in seconds from the step's first op."""

    meta: JobMeta
    source: str
    steps: np.ndarray
    """(T,) step numbers, ascending."""
    slot_stage: np.ndarray
    """(n,) PP rank of each slot."""
    slot_optype: np.ndarray
    """(n,) op type name (object array of str)."""
    slot_seq: np.ndarray
    """(n,) seq_id within (step, worker, op type)."""
    slot_mc: np.ndarray
    """(n,) model chunk."""
    order: np.ndarray
    """(n,) median start time over steps and DP ranks: the slot's place on its worker."""
    start: np.ndarray
    """(n, T, dp) recorded start, seconds after the step's earliest op."""
    duration: np.ndarray
    """(n, T, dp) recorded duration, seconds."""
    rank: np.ndarray
    """(pp, dp) global rank of the traced worker of each cell."""

    @property
    def n_slots(self) -> int:
        return int(self.slot_stage.shape[0])

    @property
    def end(self) -> np.ndarray:
        return self.start + self.duration

    def actual_step_times(self) -> np.ndarray:
        """(T,) recorded step time: last op end minus first op start, seconds."""
        return self.end.max(axis=(0, 2)) - self.start.min(axis=(0, 2))

    def slots_of(self, stage: int, optype: str) -> np.ndarray:
        """Slot ids of one op type on one stage, by seq_id."""
        idx = np.flatnonzero((self.slot_stage == stage) & (self.slot_optype == optype))
        return idx[np.argsort(self.slot_seq[idx], kind="stable")]


def _dense_unique(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True), in O(n) when the value range is small."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > 4 * len(values) + 1_000_000:
        return np.unique(values, return_inverse=True)
    present = np.zeros(hi - lo + 1, dtype=bool)
    present[values - lo] = True
    uniq = np.flatnonzero(present)
    index = np.cumsum(present) - 1
    return uniq + lo, index[values - lo]


def tensorize(df: Trace, meta: JobMeta, source: str) -> OpTensor:
    """Arrange a checked trace (trace.check_trace) as an OpTensor.

    Every step and DP rank must record the same (stage, op type, seq_id) set;
    a missing or duplicated op is an InputError naming step, rank and op.
    """
    dp, pp = meta.dp_size, meta.pp_size
    steps, step_idx = _dense_unique(df["step"])
    n_steps = len(steps)
    stage = df["stage"]
    dp_rank = df["dp_rank"]
    seq = df["seq_id"]
    if seq.min() < 0:
        row = int(np.argmin(seq))
        raise InputError(f"{source}: column 'seq_id' row {row}: negative seq_id {int(seq[row])}")
    opcode = df["optype"]
    names = np.asarray(OPTYPE_NAMES, dtype=object)
    n_codes = len(names)
    seq_span = int(seq.max()) + 1
    key = (stage.astype(np.int64) * n_codes + opcode) * seq_span + seq
    slot_keys, slot_of_row = _dense_unique(key)
    n = len(slot_keys)
    flat = (slot_of_row * n_steps + step_idx) * dp + dp_rank
    counts = np.bincount(flat, minlength=n * n_steps * dp)
    slot_stage = (slot_keys // seq_span) // n_codes
    slot_code = (slot_keys // seq_span) % n_codes
    slot_seq = slot_keys % seq_span
    slot_optype = names[slot_code]

    def where(cell: int) -> str:
        s, rest = divmod(cell, n_steps * dp)
        t, d = divmod(rest, dp)
        return (
            f"step {int(steps[t])} dp_rank {d} stage {int(slot_stage[s])}:"
            f" {slot_optype[s]} seq_id {int(slot_seq[s])}"
        )

    if (counts > 1).any():
        raise InputError(f"{source}: {where(int(np.flatnonzero(counts > 1)[0]))} is recorded twice")
    if (counts == 0).any():
        raise InputError(
            f"{source}: {where(int(np.flatnonzero(counts == 0)[0]))} is missing"
            " (every step and DP rank must record the same ops)"
        )
    start: np.ndarray = np.empty(n * n_steps * dp)
    dur: np.ndarray = np.empty(n * n_steps * dp)
    start[flat] = df["start_ts"]
    dur[flat] = df["duration"]
    start = start.reshape(n, n_steps, dp)
    dur = dur.reshape(n, n_steps, dp)
    # Steps are simulated from time 0: measure every op from its step's first op.
    start = start - start.min(axis=(0, 2), keepdims=True)
    mc = np.zeros(n, dtype=np.int64)
    mc[slot_of_row] = df["mc"]
    rank = np.full((pp, dp), -1, dtype=np.int64)
    rank[stage, dp_rank] = df["rank"]
    return OpTensor(
        meta=meta,
        source=source,
        steps=steps,
        slot_stage=slot_stage.astype(np.int64),
        slot_optype=slot_optype,
        slot_seq=slot_seq.astype(np.int64),
        slot_mc=mc,
        order=median(start, axis=(1, 2)),
        start=start,
        duration=dur,
        rank=rank,
    )
