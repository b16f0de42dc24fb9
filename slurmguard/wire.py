"""What a node agent sends the controller: one versioned, signed JSON report (the wire
format; "wire", not "report": `slurmguard.report` is the admin report, whose renderers
and commands share nothing with this).

Wire format (`schema_version`): 3 (what agents send) packs each rank's
iterations into one base64 string of float64 columns, {"n": N, "cols": B64},
where B64 holds 24 x N bytes: N `end`, then N `step_s`, then N `comm_s`,
little-endian IEEE 754 (`StepWindow`); 256 iterations of 8 ranks are 66 KB
of JSON instead of about 185 KB, and the controller reads them as arrays
without building an object per iteration. It sends the report's telemetry
samples as columns too (`TelemetryColumns`): {"keys": [[signal, unit, gpu,
nic], ...], "n": N, "k": B64 of N uint32 key indices, "cols": B64 of N
timestamps then N values, float64}, each device signal named once and one
object a report instead of one a sample (the controller sums them per
device signal as they are). The controller decodes a report's base64 in
its JSON parser (standard or URL-safe alphabet) and checks all its step
windows at once.
Versions 1 (steps as lists of {"end", "step_s", "comm_s"}) and 2 (telemetry
as a list of records) are still accepted (`schema_version` 1, 2 or 3;
others are refused), so agents of the previous releases keep reporting
while the fleet is upgraded (controllers first: an older controller
refuses a newer version with 422). All are validated alike: a packed window
must hold exactly 24 x n bytes of finite numbers with step_s and comm_s >=
0, packed telemetry exactly n key indices below len(keys) and 2 x n finite
numbers, or the report is refused naming the field.

Reports carry rolling windows (the last `max_steps` iterations of each rank,
the telemetry samples since the previous report), so the controller can
rebuild its view from the next report after a restart and a lost report
costs nothing but latency. Raw ring records stay on the node.

Authentication: each node has its own key, derived from the controller's
master secret: key = HMAC-SHA256(master, "slurmguard node key v1\\0" + node)
(`node_key`; the admin installs it with `slurmguard keys derive NODE`). A
report is signed with HMAC-SHA256 over "<unix time>\\n<node>\\n<body>"; the
headers X-Slurmguard-Node, -Time and -Signature carry node, time and signature,
so the controller derives the key and checks the signature before it parses
the body, and then requires the body's `node` to be the signed one. Root on one
compute node holds only that node's key and can report only for that node.
The controller rejects a bad signature, a time that is not finite or more than
`MAX_SKEW_S` away from its own, and an (epoch, seq) it has already seen from
that node: `epoch` is the agent process's start (Unix ns), `seq` counts its
reports, so a restarted agent is accepted at once and a replay is not.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal, NamedTuple, overload

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    PlainSerializer,
    Tag,
    model_validator,
)
from pydantic_core import core_schema

from slurmguard.config import read_trusted
from slurmguard.errors import ConfigError
from slurmguard.names import NODE_NAME_RE

SCHEMA_VERSION: Final = 3
#: most iterations one packed rank window may carry (the agent sends agent.report_steps)
MAX_PACKED_STEPS = 1 << 16
MAX_SKEW_S = 300.0
TIME_HEADER = "X-Slurmguard-Time"
SIG_HEADER = "X-Slurmguard-Signature"
NODE_HEADER = "X-Slurmguard-Node"
KEY_CONTEXT = b"slurmguard node key v1\0"
#: a Slurm node name as slurmguard accepts it anywhere (slurmguard.names)
NODE_NAME = NODE_NAME_RE


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepSample(_Model):
    """One iteration of one rank. end: Unix seconds; step_s/comm_s: seconds
    (comm_s = time inside collectives during the iteration, overlapping ones
    counted once; after a receive the hook cannot time, the time until the
    rank's next collective: see agent.analysis.waited_until)."""

    end: float
    step_s: float = Field(ge=0)
    comm_s: float = Field(ge=0)


class Step(NamedTuple):
    """One iteration as read from a StepWindow (the fields of StepSample)."""

    end: float
    step_s: float
    comm_s: float


_LE_F64 = np.dtype("<f8")
#: bytes in JSON are base64 text (standard or URL-safe alphabet), decoded by the parser
_B64_BYTES = core_schema.CoreConfig(val_json_bytes="base64")


def _form_of(packed_type: type) -> Callable[[object], str]:
    """The discriminator of a field sent either as a list of records ("list") or
    as packed columns ("packed": a dict from JSON, or the object itself)."""

    def form(v: object) -> str:
        return "packed" if isinstance(v, (dict, packed_type)) else "list"

    return form


def _packed_schema(
    cls: type, packed: Callable[[core_schema.CoreSchema], core_schema.CoreSchema]
) -> core_schema.CoreSchema:
    """The schema of a type sent as base64 columns (`packed(raw)`: its dict's schema
    with `raw` for the column strings). From JSON the parser decodes the base64
    (val_json_bytes, about four times faster than binascii); from Python the
    columns are base64 text, or the object is one already; it serialises to JSON
    through its packed()."""
    return core_schema.json_or_python_schema(
        json_schema=packed(core_schema.bytes_schema()),
        python_schema=core_schema.union_schema(
            [core_schema.is_instance_schema(cls), packed(core_schema.str_schema())]
        ),
        serialization=core_schema.plain_serializer_function_ser_schema(
            lambda x: x.packed(), when_used="json"
        ),
    )


class StepWindow(Sequence):
    """A rank's iterations as one (3, n) float64 array (end, step_s, comm_s):
    24 bytes an iteration instead of a model object each, and the packed wire
    form of schema version 2. Reads like the list of StepSample it replaces
    (len, index, slice, iterate); `end`, `step_s` and `comm_s` are the
    columns, for code that works on arrays.

    Read from the wire, a window is decoded with all the others of its report at
    once (`decode_all`, called by AgentReport's validation): one base64 decode and
    one check for the report instead of one per rank (they were a third of a
    report's parsing). A window validated outside a report is decoded, and
    checked, when first read."""

    __slots__ = ("_arr", "_raw")

    def __init__(self, a: np.ndarray) -> None:
        self._arr: np.ndarray | None = a
        self._raw: tuple[int, bytes | str] | None = None

    @property
    def _a(self) -> np.ndarray:
        if self._arr is None:
            assert self._raw is not None
            self._arr = StepWindow.unpack({"n": self._raw[0], "cols": self._raw[1]})._arr
            self._raw = None
        return self._arr  # type: ignore[return-value]

    @classmethod
    def _pending(cls, d: dict) -> StepWindow:
        """A window of a packed dict ({"n", "cols"}, types checked; cols: its bytes,
        decoded from base64 by the JSON parser, or base64 text), decoded later."""
        w = cls.__new__(cls)
        w._arr, w._raw = None, (d["n"], d["cols"])
        return w

    @staticmethod
    def _bytes(n: int, cols: bytes | str) -> bytes:
        """The 24 x n bytes of a window's cols; ValueError naming what is wrong."""
        if isinstance(cols, str):
            try:
                cols = binascii.a2b_base64(cols, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"cols is not base64 ({exc})") from None
        if len(cols) != 24 * n:
            raise ValueError(f"cols holds {len(cols)} bytes; n={n} needs 24 x n = {24 * n}")
        return cols

    @staticmethod
    def decode_all(windows: Sequence[StepWindow], where: Callable[[int], str]) -> None:
        """Decode and check the pending windows at once; ValueError naming the first bad
        one (`where(i)`: where the i-th window is in the report) and what is wrong (as
        `unpack` says it). The windows of a report usually have one length: then the
        check is three array operations, whatever the number of ranks."""
        raws = [w._raw for w in windows if w._raw is not None]
        if len(raws) != len(windows):
            raise ValueError("decode_all: a window is not pending")
        if not raws:
            return
        ns = [r[0] for r in raws]
        cols = [r[1] for r in raws]
        joined = None
        if [len(c) for c in cols] == [24 * n for n in ns]:
            try:
                joined = b"".join(cols)  # type: ignore[arg-type]
            except TypeError:  # base64 text (validated from Python)
                pass
        if joined is None:  # text, or a length that does not fit: one at a time, to name it
            i = 0
            try:
                for i, (n, c) in enumerate(zip(ns, cols)):
                    cols[i] = StepWindow._bytes(n, c)
            except ValueError as exc:
                raise ValueError(f"{where(i)}: {exc}") from None
            joined = b"".join(cols)  # type: ignore[arg-type]
        flat = np.frombuffer(joined, dtype=_LE_F64)
        n0 = ns[0]
        same = ns.count(n0) == len(ns)
        ok = bool(np.isfinite(flat).all())
        if same:
            a = flat.reshape(len(ns), 3, n0)
            ok = ok and (n0 == 0 or float(a[:, 1:].min()) >= 0)  # step_s and comm_s
        elif ok:
            bounds, at = [], 0
            for n in ns:
                if n:
                    bounds += [at + n, at + 3 * n]  # step_s and comm_s of this window
                at += 3 * n
            if bounds and bounds[-1] == at:  # the last segment runs to the end (reduceat's rule)
                bounds.pop()
            ok = not bounds or float(np.minimum.reduceat(flat, bounds)[::2].min()) >= 0
        if not ok:  # one of them is bad: each on its own, to name it
            for i, (n, c) in enumerate(zip(ns, cols)):
                try:
                    StepWindow.unpack({"n": n, "cols": c})
                except ValueError as exc:
                    raise ValueError(f"{where(i)}: {exc}") from None
            raise AssertionError("decode_all: joined windows failed, each alone passed")
        if same:
            for w, arr in zip(windows, a):
                w._arr, w._raw = arr, None
            return
        at = 0
        for w, n in zip(windows, ns):
            w._arr, w._raw = flat[at : at + 3 * n].reshape(3, n), None
            at += 3 * n

    @classmethod
    def of(cls, steps: StepWindow | Sequence[StepSample], keep: int | None = None) -> StepWindow:
        """The newest `keep` (None: all) of a StepWindow or a list of StepSample."""
        if isinstance(steps, StepWindow):
            if keep is None or len(steps) <= keep:
                return steps
            return StepWindow(steps._a[:, -keep:].copy())
        tail = steps[-keep:] if keep is not None and keep < len(steps) else steps
        a = np.empty((3, len(tail)))
        a[0] = [st.end for st in tail]  # a row at a time: about half the cost of element-wise
        a[1] = [st.step_s for st in tail]
        a[2] = [st.comm_s for st in tail]
        return cls(a)

    # ---- the wire form
    def packed(self) -> dict:
        """{"n": N, "cols": base64 of the 24 x N little-endian bytes}."""
        a = np.ascontiguousarray(self._a, dtype=_LE_F64)
        return {"n": a.shape[1], "cols": base64.b64encode(a.tobytes()).decode("ascii")}

    @classmethod
    def unpack(cls, d: dict) -> StepWindow:
        """The window of a packed dict ({"n", "cols"}, types already checked);
        ValueError naming what is wrong."""
        n = d["n"]
        a = np.frombuffer(StepWindow._bytes(n, d["cols"]), dtype=_LE_F64).reshape(3, n)
        if not np.isfinite(a).all():
            raise ValueError("cols holds a value that is not a finite number")
        if n and a[1:].min() < 0:
            raise ValueError("step_s and comm_s must be >= 0")
        return cls(a)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def packed(cols: core_schema.CoreSchema) -> core_schema.CoreSchema:
            return core_schema.no_info_after_validator_function(
                cls._pending,
                core_schema.typed_dict_schema(
                    {
                        "n": core_schema.typed_dict_field(core_schema.int_schema(ge=0, le=MAX_PACKED_STEPS)),
                        "cols": core_schema.typed_dict_field(cols),
                    },
                    extra_behavior="forbid",
                    config=_B64_BYTES,
                ),
            )

        return _packed_schema(cls, packed)

    # ---- the columns
    @property
    def columns(self) -> np.ndarray:
        """The (3, n) array: end, step_s, comm_s."""
        return self._a

    @property
    def end(self) -> np.ndarray:
        return self._a[0]

    @property
    def step_s(self) -> np.ndarray:
        return self._a[1]

    @property
    def comm_s(self) -> np.ndarray:
        return self._a[2]

    def __len__(self) -> int:
        return self._a.shape[1]

    def __bool__(self) -> bool:
        return self._a.shape[1] > 0

    @property
    def pending(self) -> bool:
        """Read from the wire and not decoded yet (decode_all)."""
        return self._raw is not None

    @overload
    def __getitem__(self, i: int) -> Step: ...
    @overload
    def __getitem__(self, i: slice) -> StepWindow: ...
    def __getitem__(self, i: int | slice) -> Step | StepWindow:
        if isinstance(i, slice):
            return StepWindow(self._a[:, i])
        e, st, c = self._a[:, i].tolist()
        return Step(e, st, c)

    def __iter__(self) -> Iterator[Step]:
        for e, st, c in zip(*self._a.tolist()):
            yield Step(e, st, c)

    def since(self, t: float | None) -> StepWindow:
        """The iterations that ended after Unix time t (all for None)."""
        if t is None:
            return self
        return StepWindow(self._a[:, int(np.searchsorted(self._a[0], t, side="right")) :])


#: a rank's iterations: a list of StepSample (version 1, and what the agent
#: builds) or a StepWindow (version 2 on the wire); always sent packed
Steps = Annotated[
    Annotated[list[StepSample], Tag("list")] | Annotated[StepWindow, Tag("packed")],
    Discriminator(_form_of(StepWindow)),
    PlainSerializer(lambda v: StepWindow.of(v).packed(), when_used="json"),
]


class ChangeReport(_Model):
    """A verified step-time change seen by the agent's step detector (Unix
    seconds, seconds). at: end of the last iteration before the change (the
    located onset); detected_at: end of the iteration at which it was known."""

    at: float
    direction: str
    before_s: float
    after_s: float
    detected_at: float | None = None


class LinkReport(_Model):
    """One link of a rank, from the NCCL profiler plugin's peer_xfer records
    (summed since the agent first read the ring): `peer` is the rank at the
    other end, in communicator `comm`; `sent`: data this rank sent to it.
    net_s: seconds its proxy steps spent on the network; peer_wait_s:
    sends waiting for the peer's clear-to-send; gpu_wait_s: steps waiting
    for the local GPU. A slow link shows as network time per step."""

    comm: int
    peer: int = Field(ge=0)
    sent: bool
    steps: int = Field(ge=0)
    bytes: int = Field(ge=0)
    net_s: float = Field(ge=0)
    peer_wait_s: float = Field(ge=0)
    gpu_wait_s: float = Field(ge=0)


#: links sent per rank (the busiest by steps)
MAX_LINKS = 64


class RankReport(_Model):
    rank: int = Field(ge=0)
    local_rank: int | None = None
    gpu: int | None = None
    source: str = "nccl"
    period_ops: int | None = None
    """Collectives per iteration the agent found (None: no iteration found yet)."""
    role: str | None = Field(None, max_length=64)
    """What work the rank does (agent.analysis.role_of): ranks of one job with
    the same role are peers (same pipeline stage, same kind of shard); None: unknown."""
    baseline_step_s: float | None = None
    """Median step time of the rank's first stable window (s); None until known."""
    baseline_compute_s: float | None = None
    steps: Steps = Field(default_factory=list)
    """The rank's newest iterations (agent.report_steps of them), oldest first."""
    total_steps: int = 0
    last_progress: float | None = None
    """Unix s of the rank's last completed collective."""
    in_flight_since: float | None = None
    """Unix s when the oldest collective still in flight started (None: none)."""
    lost_records: int = 0
    changes: tuple[ChangeReport, ...] = ()
    exited: bool = False
    """The rank's process is gone while its ring stays (it died, or the job
    ends): its silence is not a stall and its last steps are not a slowdown."""
    links: tuple[LinkReport, ...] = Field((), max_length=MAX_LINKS)
    """Per-link transfer times (NCCL profiler plugin only; empty otherwise). (Tuples here:
    an empty one is no object to the garbage collector, which a controller holding
    80,000 ranks walks through.)"""


class JobReport(_Model):
    job_id: int = Field(gt=0)
    world_size: int | None = None
    ranks: list[RankReport] = Field(default_factory=list)


class TelemetryRecord(_Model):
    signal: str
    value: float
    unit: str = ""
    timestamp: float
    gpu: int | None = None
    nic: str | None = None


#: a device signal as a report's telemetry columns name it: (signal, unit, gpu, nic)
TelemetryKey = tuple[str, str, int | None, str | None]
_LE_U4 = np.dtype("<u4")
#: most samples and device signals one report's telemetry columns may carry
MAX_PACKED_SAMPLES = 1 << 20


class TelemetryColumns(Sequence):
    """A report's telemetry samples as columns: `keys` (signal, unit, gpu, nic) of
    each device signal once, and per sample the index of its key (`k`, uint32), its
    `timestamp` and its `value` (float64): one object a report instead of a model
    object a sample, and the packed wire form of schema version 3. Reads like the
    list of TelemetryRecord it replaces (len, index, iterate)."""

    __slots__ = ("keys", "k", "timestamp", "value")

    def __init__(
        self, keys: list[TelemetryKey], k: np.ndarray, timestamp: np.ndarray, value: np.ndarray
    ) -> None:
        self.keys, self.k, self.timestamp, self.value = keys, k, timestamp, value

    @classmethod
    def of(cls, tel: TelemetryColumns | Sequence[TelemetryRecord]) -> TelemetryColumns:
        if isinstance(tel, TelemetryColumns):
            return tel
        index: dict[TelemetryKey, int] = {}
        k = [index.setdefault((t.signal, t.unit, t.gpu, t.nic), len(index)) for t in tel]
        return cls(
            list(index),
            np.array(k, dtype=_LE_U4),
            np.array([t.timestamp for t in tel], dtype=_LE_F64),
            np.array([t.value for t in tel], dtype=_LE_F64),
        )

    # ---- the wire form
    def packed(self) -> dict:
        """{"keys": [[signal, unit, gpu, nic], ...], "n": N, "k": base64 of N
        little-endian uint32, "cols": base64 of N timestamps then N values, float64}."""
        cols = np.concatenate([self.timestamp, self.value]).astype(_LE_F64, copy=False)
        return {
            "keys": [list(key) for key in self.keys],
            "n": len(self.k),
            "k": base64.b64encode(self.k.astype(_LE_U4, copy=False).tobytes()).decode("ascii"),
            "cols": base64.b64encode(cols.tobytes()).decode("ascii"),
        }

    @classmethod
    def unpack(cls, d: dict) -> TelemetryColumns:
        """The columns of a packed dict (types already checked); ValueError naming
        what is wrong."""
        n, keys, k_raw, cols = d["n"], d["keys"], d["k"], d["cols"]
        if isinstance(k_raw, str) or isinstance(cols, str):  # from Python: base64 text
            try:
                k_raw = binascii.a2b_base64(k_raw, strict_mode=True)
                cols = binascii.a2b_base64(cols, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"k or cols is not base64 ({exc})") from None
        if len(k_raw) != 4 * n or len(cols) != 16 * n:
            raise ValueError(
                f"k holds {len(k_raw)} bytes and cols {len(cols)}; n={n} needs 4 x n = {4 * n} "
                f"and 16 x n = {16 * n}"
            )
        k = np.frombuffer(k_raw, dtype=_LE_U4)
        a = np.frombuffer(cols, dtype=_LE_F64).reshape(2, n)
        if n:
            if int(k.max()) >= len(keys):
                raise ValueError(f"k names key {int(k.max())}; there are {len(keys)} keys")
            lo, hi = a.min(), a.max()  # NaN, if any, comes out of both
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError("cols holds a value that is not a finite number")
        return cls(keys, k, a[0], a[1])

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        key = core_schema.tuple_schema(
            [
                core_schema.str_schema(),
                core_schema.str_schema(),
                core_schema.nullable_schema(core_schema.int_schema()),
                core_schema.nullable_schema(core_schema.str_schema()),
            ]
        )

        def packed(raw: core_schema.CoreSchema) -> core_schema.CoreSchema:
            return core_schema.no_info_after_validator_function(
                cls.unpack,
                core_schema.typed_dict_schema(
                    {
                        "keys": core_schema.typed_dict_field(
                            core_schema.list_schema(key, max_length=MAX_PACKED_SAMPLES)
                        ),
                        "n": core_schema.typed_dict_field(
                            core_schema.int_schema(ge=0, le=MAX_PACKED_SAMPLES)
                        ),
                        "k": core_schema.typed_dict_field(raw),
                        "cols": core_schema.typed_dict_field(raw),
                    },
                    extra_behavior="forbid",
                    config=_B64_BYTES,
                ),
            )

        return _packed_schema(cls, packed)

    # ---- the samples
    def __len__(self) -> int:
        return len(self.k)

    def __bool__(self) -> bool:
        return len(self.k) > 0

    @overload
    def __getitem__(self, i: int) -> TelemetryRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[TelemetryRecord]: ...
    def __getitem__(self, i: int | slice) -> TelemetryRecord | list[TelemetryRecord]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        signal, unit, gpu, nic = self.keys[int(self.k[i])]
        return TelemetryRecord(
            signal=signal,
            unit=unit,
            gpu=gpu,
            nic=nic,
            timestamp=float(self.timestamp[i]),
            value=float(self.value[i]),
        )

    def __iter__(self) -> Iterator[TelemetryRecord]:
        for i in range(len(self)):
            yield self[i]

    def samples_of(self, keys: Sequence[int]) -> Iterator[tuple[TelemetryKey, float, float]]:
        """(key, timestamp, value) of the samples of the keys at these indices, in the
        order sent."""
        at = np.flatnonzero(np.isin(self.k, keys))
        for i, ts, v in zip(self.k[at].tolist(), self.timestamp[at].tolist(), self.value[at].tolist()):
            yield self.keys[i], ts, v


#: a report's telemetry samples: a list of TelemetryRecord (versions 1 and 2, and
#: what the agent builds) or TelemetryColumns (version 3 on the wire); always sent packed
Telemetry = Annotated[
    Annotated[list[TelemetryRecord], Tag("list")] | Annotated[TelemetryColumns, Tag("packed")],
    Discriminator(_form_of(TelemetryColumns)),
    PlainSerializer(lambda v: TelemetryColumns.of(v).packed(), when_used="json"),
]


class UnavailableSignal(_Model):
    """A signal the agent's telemetry cannot read now (since: Unix s). signal
    "source" means the whole source (nv-hostengine down, exporter unreachable)."""

    source: str
    signal: str
    gpu: int | None = None
    nic: str | None = None
    detail: str = ""
    since: float


class AgentReport(_Model):
    schema_version: Literal[1, 2, 3] = SCHEMA_VERSION
    """Wire format version (module docstring); others are refused."""
    node: str = Field(pattern=NODE_NAME.pattern)
    seq: int = Field(ge=0)
    epoch: int = Field(0, ge=0)
    """Start of the sending agent process, Unix ns: (epoch, seq) grows across restarts."""
    sent_at: float
    jobs: list[JobReport] = Field(default_factory=list)
    telemetry: Telemetry = Field(default_factory=list)
    """The telemetry samples since the agent's previous report (sent as TelemetryColumns)."""
    events: list[str] = Field(default_factory=list)
    unavailable: list[UnavailableSignal] = Field(default_factory=list)
    ring_errors: dict[str, int] = Field(default_factory=dict)
    """Ring problems this agent counted since it started, by kind
    (agent/rings.py ERROR_KINDS: invalid, untrusted, unreadable,
    corrupt_records, dropped_samples, analysis)."""

    @model_validator(mode="after")
    def _decode_windows(self) -> AgentReport:
        """The packed step windows of all ranks, decoded and checked at once."""
        pending = [
            r.steps
            for j in self.jobs
            for r in j.ranks
            if type(r.steps) is StepWindow and r.steps._raw is not None  # noqa: SLF001
        ]
        if pending:
            StepWindow.decode_all(pending, self._where_pending)
        return self

    def _where_pending(self, i: int) -> str:
        """Where the i-th pending step window of the report is (for an error)."""
        at = [
            f"jobs.{x}.ranks.{y}.steps"
            for x, j in enumerate(self.jobs)
            for y, r in enumerate(j.ranks)
            if isinstance(r.steps, StepWindow) and r.steps.pending
        ]
        return at[i]


def node_key(master: bytes, node: str) -> bytes:
    """The report key of `node` (64 hex characters, as installed in its key file)."""
    if not NODE_NAME.match(node or ""):
        raise ConfigError(f"invalid node name {node!r}: letters, digits, '.', '_', '-' only")
    return hmac.new(master, KEY_CONTEXT + node.encode(), hashlib.sha256).hexdigest().encode()


#: the controller derives a node's key for each of its reports: kept, for about as many
#: nodes as a cluster has (a key is 64 bytes; only nodes Slurm knows get this far)
_node_key_cached = functools.lru_cache(maxsize=1 << 17)(node_key)


def sign(key: bytes, timestamp: str, node: str, body: bytes) -> str:
    return hmac.digest(key, b"%s\n%s\n%s" % (timestamp.encode(), node.encode(), body), "sha256").hex()


def check_time(timestamp: str, now: float) -> str | None:
    """None if the time header is a finite Unix time within MAX_SKEW_S of now."""
    try:
        ts = float(timestamp)
    except (TypeError, ValueError):
        return "missing or malformed time header"
    if not math.isfinite(ts):
        return f"time header {timestamp!r} is not a finite number"
    if abs(now - ts) > MAX_SKEW_S:
        return f"time {ts:.0f} is {abs(now - ts):.0f}s from the controller's clock"
    return None


def signed_by(master: bytes, node: str, timestamp: str, body: bytes, signature: str) -> bool:
    """Whether `body` was signed with `node`'s key at `timestamp` (node: a valid node name,
    and the time checked already, check_time). The signature is compared as bytes: a
    header's text that is not ASCII is a bad signature, not an error."""
    good = sign(_node_key_cached(master, node), timestamp, node, body).encode()
    return hmac.compare_digest(good, signature.encode("utf-8", "surrogateescape"))


def read_secret(path: str | Path, what: str = "secret") -> bytes:
    """A secret or key file (content, stripped); ConfigError if unusable, missing, too
    short, or (run as root) not root-owned 0600 (config.read_trusted)."""
    p = Path(path)
    data = read_trusted(p, what, secret=True).strip()
    if len(data) < 16:
        raise ConfigError(f"{p}: {what} too short (need at least 16 bytes)")
    return data
