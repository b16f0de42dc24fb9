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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slurmguard.errors import InputError, read_user_text
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
OPTYPE_NAMES = tuple(sorted(optypes.KNOWN))
"""The op-type vocabulary; a checked trace's optype column holds indices into it."""


@dataclass(frozen=True)
class Coded:
    """A dictionary-encoded text column as parquet stores it: codes into categories, -1 = null."""

    codes: np.ndarray
    categories: list[str]

    def __len__(self) -> int:
        return len(self.codes)

    def take(self, mask: np.ndarray) -> Coded:
        return Coded(self.codes[mask], self.categories)


Columns = Mapping[str, Any]
"""A table as column name -> array: what read_columns returns; a pandas DataFrame also fits."""


@dataclass(frozen=True)
class Trace:
    """A checked trace: one numpy array per column, in file row order.

    Integer columns are int64, start_ts/duration/end_ts float64 seconds, and
    optype is int64 indices into OPTYPE_NAMES.
    """

    columns: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.columns["step"])

    def take(self, mask: np.ndarray) -> Trace:
        """The rows where `mask` is true."""
        return Trace({k: v[mask] for k, v in self.columns.items()})


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
    """Trial name, shown in the what-if summary and figures."""

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
        raise InputError(f"{source}: metadata must be a YAML mapping of keys such as dp_size, pp_size")
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
            raise InputError(f"{source}: key '{key}' must be a positive integer, got {v!r}")
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
    text = read_user_text(p, "metadata file")
    import yaml

    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{p}{line}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse_meta(data, p.name)


def read_columns(path: str | Path, columns: tuple[str, ...] | None = REQUIRED_COLUMNS) -> dict[str, Any]:
    """Read a parquet (or .csv) table as column name -> numpy array (or Coded).

    Only `columns` (None = all) are read from a parquet file: the others are
    never decoded. A column the file lacks is left out, for check_trace to
    name. A missing or unreadable file is an InputError. pyarrow, not pandas:
    the command's start-up is most of its run time.
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: trace file not found")
    import pyarrow as pa

    try:
        if p.suffix.lower() == ".csv":
            import pyarrow.csv as pacsv

            table = pacsv.read_csv(p)
            if columns is not None:
                table = table.select([c for c in columns if c in table.column_names])
        else:
            import pyarrow.parquet as pq

            f = pq.ParquetFile(p)
            names = f.schema_arrow.names
            wanted = None if columns is None else [c for c in columns if c in names]
            table = f.read(columns=wanted, use_pandas_metadata=False)
        return {name: _to_numpy(table.column(name)) for name in table.column_names}
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(f"{p}: cannot read trace: {type(exc).__name__}: {exc}") from None


def _to_numpy(col: Any) -> Any:
    """One pyarrow column as numpy; dictionary-encoded text stays encoded (Coded)."""
    import pyarrow as pa

    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        col = col.dictionary_encode()  # a few op names over many rows (CSV input)
    if pa.types.is_dictionary(col.type):
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if isinstance(arr, pa.ChunkedArray):  # zero chunks
            arr = pa.array([], type=col.type)
        raw = _chunk_to_numpy(arr.indices)
        codes = np.where(np.isnan(raw), -1, raw) if raw.dtype.kind == "f" else raw
        codes = codes.astype(np.int64)
        return Coded(codes, [str(c) for c in arr.dictionary.to_pylist()])
    parts = [_chunk_to_numpy(c) for c in col.chunks]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0)


# Arrow primitive type name -> numpy dtype, for reading column buffers directly
_NUMPY_OF_ARROW = {
    "int8": "i1", "int16": "i2", "int32": "i4", "int64": "i8",
    "uint8": "u1", "uint16": "u2", "uint32": "u4", "uint64": "u8",
    "halffloat": "f2", "float": "f4", "double": "f8",
}  # fmt: skip


def _chunk_to_numpy(arr: Any) -> np.ndarray:
    """One Arrow array as numpy; numeric values with nulls become float64 NaN.

    Numeric buffers are wrapped directly: pyarrow's own to_numpy imports
    pandas, which alone costs more than the whole analysis of a trace.
    """
    dtype = _NUMPY_OF_ARROW.get(str(arr.type))
    if dtype is None:
        return arr.to_numpy(zero_copy_only=False)
    n, off = len(arr), arr.offset
    validity, data = arr.buffers()[:2]
    values = np.frombuffer(data, dtype=dtype, count=n + off)[off:]
    if arr.null_count == 0 or validity is None:
        return values
    bits = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")
    return np.where(bits[off : off + n].astype(bool), values, np.nan)


def read_table(path: str | Path) -> Any:
    """The whole table as a pandas DataFrame (for the rank-ops adapter)."""
    import pandas as pd

    data = read_columns(path, None)
    return pd.DataFrame(
        {
            k: (pd.Categorical.from_codes(v.codes, v.categories) if isinstance(v, Coded) else v)
            for k, v in data.items()
        }
    )


def check_trace(table: Columns, meta: JobMeta, source: str, meta_source: str = "metadata") -> Trace:
    """Validate a trace table (read_columns' dict or a pandas DataFrame).

    Returns a Trace with compact dtypes and an `end_ts` column (seconds).
    `source` and `meta_source` are the names used in error messages.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in table]
    if missing:
        raise InputError(f"{source}: missing column(s): {', '.join(missing)}")
    if len(table["step"]) == 0:
        raise InputError(f"{source}: the trace has no rows")
    out: dict[str, np.ndarray] = {}
    for col in INT_COLUMNS:
        raw = table[col]
        if isinstance(raw, np.ndarray) and raw.dtype.kind in "iu":
            # integers without nulls (parquet's usual case): nothing to check, and no
            # float round trip (16 MB of copies on the AR trace)
            out[col] = raw.astype(np.int64, copy=False)
            continue
        arr = _numeric(raw, col, source, "integer")
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise InputError(f"{source}: column '{col}' row {row}: not an integer: {float(arr[row])!r}")
        out[col] = arr.astype(np.int64)
    for col in FLOAT_COLUMNS:
        arr = _numeric(table[col], col, source, "numeric seconds")
        bad = ~np.isfinite(arr)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise InputError(f"{source}: column '{col}' row {row}: not a finite number")
        out[col] = arr
    neg = out["duration"] < 0
    if neg.any():
        row = int(np.flatnonzero(neg)[0])
        raise InputError(
            f"{source}: column 'duration' has {int(neg.sum())} negative value(s), first at row {row}"
        )
    out["optype"] = _optype_codes(table["optype"], source)
    out["end_ts"] = out["start_ts"] + out["duration"]
    trace = Trace(out)
    _check_layout(trace, meta, source, meta_source)
    return trace


def _numeric(col: Any, name: str, source: str, what: str) -> np.ndarray:
    """A numeric column as float64 (NaN for nulls); other dtypes are an InputError."""
    dtype = getattr(col, "dtype", None)
    # numpy and pandas dtypes (nullable Int64, Float64, arrow-backed) all have .kind
    if isinstance(col, Coded) or getattr(dtype, "kind", "O") not in "iuf":
        shown = "dictionary" if isinstance(col, Coded) else dtype
        raise InputError(f"{source}: column '{name}' must be {what}, got dtype {shown}")
    if isinstance(col, np.ndarray):
        return col.astype(np.float64, copy=False)
    return col.to_numpy(dtype=np.float64, na_value=np.nan)


def _optype_codes(col: Any, source: str) -> np.ndarray:
    """Op types as int64 indices into OPTYPE_NAMES; unknown or empty names are an error."""
    if isinstance(col, Coded):
        codes, cats = col.codes, col.categories
    elif hasattr(getattr(col, "dtype", None), "categories"):  # pandas categorical
        codes = col.cat.codes.to_numpy().astype(np.int64)
        cats = [str(c) for c in col.cat.categories]
    else:
        values = np.asarray(col, dtype=object)
        if any(v is None or v != v for v in values):  # None / NaN
            raise InputError(f"{source}: column 'optype' has empty values")
        # map the few distinct names instead of converting millions of strings
        cats_arr, codes = np.unique(values.astype(str), return_inverse=True)
        cats = [str(x) for x in cats_arr]
    codes = np.asarray(codes, dtype=np.int64)
    if len(codes) and codes.min() < 0:
        raise InputError(f"{source}: column 'optype' has empty values")
    # bincount, not np.unique: that imports numpy.ma, a tenth of the command's start-up
    used = np.flatnonzero(np.bincount(codes, minlength=len(cats)))
    names = [cats[i] for i in used]
    unknown = sorted(set(names) - optypes.KNOWN)
    if unknown:
        raise InputError(
            f"{source}: column 'optype' has unknown op type(s): {', '.join(unknown[:5])}"
            f" (known: {', '.join(OPTYPE_NAMES)})"
        )
    lookup = np.array(
        [OPTYPE_NAMES.index(c) if c in optypes.KNOWN else -1 for c in cats],
        dtype=np.int64,
    )
    return lookup[codes]


def _check_layout(df: Trace, meta: JobMeta, source: str, meta_source: str) -> None:
    """The trace's ranks must form exactly the dp_size x pp_size grid of the metadata."""
    for col, size, key in (
        ("dp_rank", meta.dp_size, "dp_size"),
        ("stage", meta.pp_size, "pp_size"),
    ):
        v = df[col]
        if v.min() < 0 or v.max() >= size:
            outside = int(v.max()) if v.max() >= size else int(v.min())
            raise InputError(f"{meta_source}: {key}={size} but {source} has {col} {outside}")
    rank = df["rank"]
    n_ranks = int(np.count_nonzero(np.bincount(rank - rank.min())))
    if n_ranks != meta.workers:
        raise InputError(
            f"{meta_source}: dp={meta.dp_size} x pp={meta.pp_size} = {meta.workers} workers"
            f" but {source} has {n_ranks} ranks"
        )
    # with as many ranks as cells, a bijection fails exactly when some row disagrees
    # with the rank first seen for its cell
    cell = df["stage"] * meta.dp_size + df["dp_rank"]
    first = np.full(meta.workers, -1, dtype=np.int64)
    first[cell[::-1]] = rank[::-1]
    bad = np.flatnonzero(first[cell] != rank)
    if len(bad) or (first < 0).any():
        if len(bad):
            row = int(bad[0])
            what = (
                f"row {row}: rank {int(rank[row])} in cell dp_rank {int(df['dp_rank'][row])},"
                f" stage {int(df['stage'][row])} which already has rank {int(first[cell[row]])}"
            )
        else:
            empty = int(np.flatnonzero(first < 0)[0])
            what = f"no rank in cell dp_rank {empty % meta.dp_size}, stage {empty // meta.dp_size}"
        raise InputError(f"{source}: {what}; expected one rank per DP x PP cell")
    if int(df["rank"].max()) >= meta.world_size or int(df["rank"].min()) < 0:
        raise InputError(
            f"{meta_source}: world_size={meta.world_size} but {source} has rank {int(df['rank'].max())}"
        )


def load_trace(trace_path: str | Path, meta_path: str | Path) -> tuple[Trace, JobMeta]:
    """Read and validate a trace file and its metadata file."""
    meta = load_meta(meta_path)
    df = read_columns(trace_path)
    checked = check_trace(df, meta, Path(trace_path).name, Path(meta_path).name)
    if not meta.name:
        meta = JobMeta(**{**meta.__dict__, "name": Path(trace_path).stem})
    return checked, meta
