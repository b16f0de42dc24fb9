"""From slurmguard's own per-rank op tables to the paper-004 trace schema.

slurmguard records per-rank events (op name, host start/end in nanoseconds) in
its rings; once archived and decoded they are a table with the columns

    rank      global rank of the process (int)
    step      training step / iteration the op belongs to (int)
    op        op name (str)
    start_ns  start, nanoseconds on a clock shared by the job's nodes (int)
    end_ns    end, nanoseconds (int)

`trace_from_rank_ops` turns such a table into the trace format the simulator
reads. Op names are mapped to the paper's op types by `op_map` (names already
in that vocabulary pass through); ops mapped to None are dropped (e.g. TP
all-reduces inside a stage). Ranks map to (DP rank, PP stage) with Megatron's
layout, TP fastest, then context parallel, then DP, then PP:

    rank = ((stage * dp_size + dp_rank) * dsp_size + cp_rank) * tp_size + tp_rank

and only the first rank of each TP x CP group (tp_rank = cp_rank = 0) is kept,
as in the published traces. seq_id numbers the ops of one type per (step,
rank) in start order; compute ops get mb_id = seq_id; mc = 0 and gmc = stage
(no interleaving).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from slurmguard.errors import InputError
from slurmguard.whatif import optypes as ot
from slurmguard.whatif.trace import JobMeta

RANK_OP_COLUMNS = ("rank", "step", "op", "start_ns", "end_ns")


def rank_layout(rank: np.ndarray, meta: JobMeta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dp_rank, stage, is_representative) of global ranks under Megatron's order."""
    inner = meta.tp_size * meta.dsp_size
    rep = rank % inner == 0
    group = rank // inner
    return group % meta.dp_size, group // meta.dp_size, rep


def trace_from_rank_ops(
    ops: pd.DataFrame,
    meta: JobMeta,
    source: str = "rank ops",
    op_map: Mapping[str, str | None] | None = None,
) -> pd.DataFrame:
    """Convert a per-rank op table (see module docstring) into a paper-004 trace table.

    Times become seconds from the first op of each step. Raises InputError
    naming the column, op name or rank when the table does not fit `meta`.
    """
    missing = [c for c in RANK_OP_COLUMNS if c not in ops.columns]
    if missing:
        raise InputError(f"{source}: missing column(s): {', '.join(missing)}")
    if len(ops) == 0:
        raise InputError(f"{source}: the table has no rows")
    mapping = dict(op_map or {})
    names = ops["op"].astype(str)
    optype = names.map(lambda x: mapping.get(x, x))
    keep = optype.notna()
    unknown = sorted(set(optype[keep]) - ot.KNOWN)
    if unknown:
        raise InputError(
            f"{source}: op name(s) {', '.join(unknown[:5])} have no op type; map them with op_map"
            f" to one of {', '.join(sorted(ot.KNOWN))} or to None to drop them"
        )
    rank = ops["rank"].to_numpy(dtype=np.int64)
    if rank.min() < 0 or rank.max() >= meta.world_size:
        bad = int(rank.max()) if rank.max() >= meta.world_size else int(rank.min())
        raise InputError(f"{source}: rank {bad} is outside world_size={meta.world_size}")
    start = ops["start_ns"].to_numpy(dtype=np.int64)
    end = ops["end_ns"].to_numpy(dtype=np.int64)
    if (end < start).any():
        row = int(np.flatnonzero(end < start)[0])
        raise InputError(f"{source}: row {row}: end_ns is before start_ns")
    dp_rank, stage, rep = rank_layout(rank, meta)
    sel = keep.to_numpy() & rep
    out = pd.DataFrame(
        {
            "dp_rank": dp_rank[sel],
            "stage": stage[sel],
            "rank": rank[sel],
            "step": ops["step"].to_numpy(dtype=np.int64)[sel],
            "optype": optype.to_numpy()[sel].astype(str),
            "start_ns": start[sel],
            "end_ns": end[sel],
        }
    )
    out = out.sort_values(["step", "rank", "optype", "start_ns"], kind="stable").reset_index(drop=True)
    out["seq_id"] = out.groupby(["step", "rank", "optype"]).cumcount().astype(np.int64)
    first = out.groupby("step")["start_ns"].transform("min")
    out["start_ts"] = (out["start_ns"] - first).to_numpy() / 1e9
    out["duration"] = (out["end_ns"] - out["start_ns"]).to_numpy() / 1e9
    is_compute = out["optype"].isin(ot.COMPUTE).to_numpy()
    out["mc"] = np.where(is_compute | out["optype"].isin(ot.DP_COMM).to_numpy(), 0, -1)
    out["mb_id"] = np.where(is_compute, out["seq_id"], -1)
    out["gmc"] = np.where(is_compute, out["stage"], -1)
    return out.drop(columns=["start_ns", "end_ns"])
