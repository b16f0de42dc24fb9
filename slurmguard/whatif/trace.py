"""Reading and checking job traces and their parallelism metadata.

A trace is a table with one row per recorded operation, in the format released
with paper 004 (StragglerAnalysis): columns dp_rank, stage, rank, step, optype,
start_ts, duration, seq_id, mc, mb_id, gmc. Times are seconds; start_ts is
relative to any per-step origin (only differences within a step matter).
One worker (a DP rank x PP rank cell, represented by one traced rank of its
TP/CP group) is traced per cell.

The metadata YAML gives the parallelism: dp_size, pp_size, tp_size, dsp_size
(context/sequence parallel; `cp_size` is accepted as an alias), vpp_size and
world_size. Every problem is reported as an InputError naming the file and the
column or key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from slurmguard.errors import InputError
from slurmguard.whatif import optypes

REQUIRED_COLUMNS = (
    "dp_rank",
    "stage",
    "rank",
    "step",
    "optype",
    "start_ts",
    "duration",
    "seq_id",
    "mc",
    "mb_id",
    "gmc",
)
INT_COLUMNS = ("dp_rank", "stage", "rank", "step", "seq_id", "mc", "mb_id", "gmc")
FLOAT_COLUMNS = ("start_ts", "duration")


@dataclass(frozen=True)
class JobMeta:
    """Parallelism of a traced job. Sizes are counts of ranks (>= 1)."""

    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int = 0
    """dp*pp*tp*dsp; 0 in the constructor means 'compute it'."""
    name: str = ""
    """Trial name, shown in reports."""

    def __post_init__(self) -> None:
        if self.world_size == 0:
            object.__setattr__(
                self,
                "world_size",
                self.dp_size * self.pp_size * self.tp_size * self.dsp_size,
            )

    @property
    def workers(self) -> int:
        """Traced workers: one per (DP rank, PP rank) cell."""
        return self.dp_size * self.pp_size


_SIZE_KEYS = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")


def parse_meta(data: Any, source: str) -> JobMeta:
    """Validate a metadata mapping; errors name `source` and the key."""
    if not isinstance(data, dict):
        raise InputError(
            f"{source}: metadata must be a YAML mapping of keys such as dp_size, pp_size"
        )
    data = dict(data)
    if "cp_size" in data and "dsp_size" not in data:
        data["dsp_size"] = data.pop("cp_size")
    for key in ("dp_size", "pp_size"):
        if key not in data:
            raise InputError(f"{source}: missing key '{key}'")
    values: dict[str, int] = {}
    for key in _SIZE_KEYS:
        if key not in data or data[key] is None:
            continue
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(
                f"{source}: key '{key}' must be a positive integer, got {v!r}"
            )
        values[key] = v
    meta = JobMeta(
        dp_size=values["dp_size"],
        pp_size=values["pp_size"],
        tp_size=values.get("tp_size", 1),
        dsp_size=values.get("dsp_size", 1),
        vpp_size=values.get("vpp_size", 1),
        name=str(data.get("trial_name", "") or ""),
    )
    product = meta.dp_size * meta.pp_size * meta.tp_size * meta.dsp_size
    if "world_size" in values and values["world_size"] != product:
        raise InputError(
            f"{source}: world_size={values['world_size']} but dp_size x pp_size x tp_size x dsp_size"
            f" = {meta.dp_size} x {meta.pp_size} x {meta.tp_size} x {meta.dsp_size} = {product}"
        )
    if meta.vpp_size != 1:
        raise InputError(
            f"{source}: vpp_size={meta.vpp_size}: interleaved pipeline schedules are not supported;"
            " only vpp_size=1 traces can be simulated"
        )
    return meta


def load_meta(path: str | Path) -> JobMeta:
    """Read a metadata YAML file (see module docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: metadata file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read metadata: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(
            f"{p}{line}: invalid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    return parse_meta(data, p.name)


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a parquet (or .csv) table; a missing or unreadable file is an InputError."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: trace file not found")
    import pyarrow as pa

    try:
        if p.suffix.lower() == ".csv":
            return pd.read_csv(p)
        return pd.read_parquet(p)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(
            f"{p}: cannot read trace: {type(exc).__name__}: {exc}"
        ) from None


def check_trace(
    df: pd.DataFrame, meta: JobMeta, source: str, meta_source: str = "metadata"
) -> pd.DataFrame:
    """Validate a trace table against the schema and the metadata.

    Returns a copy with compact dtypes and an `end_ts` column (seconds).
    `source` and `meta_source` are the names used in error messages.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(f"{source}: missing column(s): {', '.join(missing)}")
    if len(df) == 0:
        raise InputError(f"{source}: the trace has no rows")
    out = pd.DataFrame(index=pd.RangeIndex(len(df)))
    for col in INT_COLUMNS:
        s = df[col]
        if not pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s):
            raise InputError(
                f"{source}: column '{col}' must be integer, got dtype {s.dtype}"
            )
        arr = s.to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise InputError(
                f"{source}: column '{col}' row {row}: not an integer: {s.iloc[row]!r}"
            )
        out[col] = arr.astype(np.int64)
    for col in FLOAT_COLUMNS:
        s = df[col]
        if not pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s):
            raise InputError(
                f"{source}: column '{col}' must be numeric seconds, got dtype {s.dtype}"
            )
        arr = s.to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(arr)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise InputError(f"{source}: column '{col}' row {row}: not a finite number")
        out[col] = arr
    neg = out["duration"].to_numpy() < 0
    if neg.any():
        row = int(np.flatnonzero(neg)[0])
        raise InputError(
            f"{source}: column 'duration' has {int(neg.sum())} negative value(s), first at row {row}"
        )
    out["optype"] = _optype_column(df["optype"], source)
    out["end_ts"] = out["start_ts"] + out["duration"]
    _check_layout(out, meta, source, meta_source)
    return out


def _optype_column(col: pd.Series, source: str) -> pd.Categorical:
    """Op types as a categorical over the known vocabulary; unknown names are an error."""
    known = sorted(optypes.KNOWN)
    if isinstance(col.dtype, pd.CategoricalDtype):
        # map category codes instead of converting millions of strings
        cats = [str(c) for c in col.cat.categories]
        codes = col.cat.codes.to_numpy()
        used = np.unique(codes)
        if (used < 0).any():
            raise InputError(f"{source}: column 'optype' has empty values")
        names = [cats[i] for i in used]
        lookup = np.array(
            [known.index(c) if c in optypes.KNOWN else -1 for c in cats], dtype=np.int64
        )
    else:
        values = col.astype(str).to_numpy()
        names, codes = np.unique(values, return_inverse=True)
        names = [str(x) for x in names]
        lookup = np.array(
            [known.index(c) if c in optypes.KNOWN else -1 for c in names],
            dtype=np.int64,
        )
    unknown = sorted(set(names) - optypes.KNOWN)
    if unknown:
        raise InputError(
            f"{source}: column 'optype' has unknown op type(s): {', '.join(unknown[:5])}"
            f" (known: {', '.join(known)})"
        )
    return pd.Categorical.from_codes(lookup[codes], categories=known)


def _check_layout(
    df: pd.DataFrame, meta: JobMeta, source: str, meta_source: str
) -> None:
    """The trace's ranks must form exactly the dp_size x pp_size grid of the metadata."""
    for col, size, key in (
        ("dp_rank", meta.dp_size, "dp_size"),
        ("stage", meta.pp_size, "pp_size"),
    ):
        v = df[col].to_numpy()
        if v.min() < 0 or v.max() >= size:
            bad = int(v.max()) if v.max() >= size else int(v.min())
            raise InputError(
                f"{meta_source}: {key}={size} but {source} has {col} {bad}"
            )
    rank = df["rank"].to_numpy()
    n_ranks = (
        len(np.unique(rank))
        if len(rank) < 1_000_000
        else int(np.count_nonzero(np.bincount(rank - rank.min())))
    )
    if n_ranks != meta.workers:
        raise InputError(
            f"{meta_source}: dp={meta.dp_size} x pp={meta.pp_size} = {meta.workers} workers"
            f" but {source} has {n_ranks} ranks"
        )
    # with as many ranks as cells, a bijection fails exactly when some row disagrees
    # with the rank first seen for its cell
    cell = df["stage"].to_numpy() * meta.dp_size + df["dp_rank"].to_numpy()
    first = np.full(meta.workers, -1, dtype=np.int64)
    first[cell[::-1]] = rank[::-1]
    bad = np.flatnonzero(first[cell] != rank)
    if len(bad) or (first < 0).any():
        if len(bad):
            row = int(bad[0])
            what = (
                f"row {row}: rank {int(rank[row])} in cell dp_rank {int(df['dp_rank'].iloc[row])},"
                f" stage {int(df['stage'].iloc[row])} which already has rank {int(first[cell[row]])}"
            )
        else:
            empty = int(np.flatnonzero(first < 0)[0])
            what = f"no rank in cell dp_rank {empty % meta.dp_size}, stage {empty // meta.dp_size}"
        raise InputError(f"{source}: {what}; expected one rank per DP x PP cell")
    if int(df["rank"].max()) >= meta.world_size or int(df["rank"].min()) < 0:
        raise InputError(
            f"{meta_source}: world_size={meta.world_size} but {source} has rank {int(df['rank'].max())}"
        )


def load_trace(
    trace_path: str | Path, meta_path: str | Path
) -> tuple[pd.DataFrame, JobMeta]:
    """Read and validate a trace file and its metadata file."""
    meta = load_meta(meta_path)
    df = read_table(trace_path)
    checked = check_trace(df, meta, Path(trace_path).name, Path(meta_path).name)
    if not meta.name:
        meta = JobMeta(**{**meta.__dict__, "name": Path(trace_path).stem})
    return checked, meta
