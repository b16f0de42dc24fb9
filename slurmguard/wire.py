"""What a node agent sends the controller: one versioned, signed JSON report (the wire
format; "wire", not "report": `slurmguard.report` is the admin report, whose renderers
and commands share nothing with this).

Wire format (`schema_version`): 4 (what agents send, `encode_report`) is the
report's JSON on one line, without the fields at their defaults, a line break,
and then its columns as raw bytes: each rank's iterations ({"n": N} in its
place) as 24 x N bytes, N `end`, then N `step_s`, then N `comm_s`,
little-endian IEEE 754 (`StepWindow`), in the order of jobs and ranks; then
the telemetry ({"keys": [[signal, unit, gpu, nic], ...], "n": N} in its
place, each device signal named once) as N timestamps and N values (float64),
then N key indices (uint32) (`TelemetryColumns`). 32 iterations of 8 ranks
and 32 samples are 8.4 KB instead of 12 KB in version 3, and the controller
reads the columns as arrays without decoding them or building an object per
iteration or sample. Version 3 sent the same columns in place as base64 text
({"n": N, "cols": B64}; {"keys", "n", "k": B64, "cols": B64}), with every
field: that JSON form (model_dump_json) is read as version 4 too.
Versions 1 (steps as lists of {"end", "step_s", "comm_s"}), 2 (telemetry as a
list of records) and 3 are still accepted (`schema_version` 1 to 4; others
are refused), so agents of the previous releases keep reporting while the
fleet is upgraded (controllers first: an older controller refuses a newer
version with 422, and a version-4 report whose rank carries
`in_flight_known`, `stopped` or `last_io`, added in later releases of version 4,
as an unknown field). All are read by `decode_report` and validated alike: a
packed window must hold exactly 24 x n bytes of finite numbers with step_s
and comm_s >= 0, packed telemetry exactly n key indices below len(keys) and
2 x n finite numbers, and the columns after the JSON exactly what its
windows and telemetry name, or the report is refused naming the field.

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
import json
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
    ValidationError,
)
from pydantic_core import core_schema

from slurmguard.config import read_trusted
from slurmguard.errors import ConfigError
from slurmguard.names import NODE_NAME_RE

SCHEMA_VERSION: Final = 4
#: most iterations one packed rank window may carry (the agent sends agent.report_steps)
MAX_PACKED_STEPS = 1 << 16
MAX_SKEW_S = 300.0
TIME_HEADER = "X-Slurmguard-Time"
SIG_HEADER = "X-Slurmguard-Signature"
NODE_HEADER = "X-Slurmguard-Node"
KEY_CONTEXT = b"slurmguard node key v1\0"
#: the media type of a report body as agents send it (encode_report: JSON, then columns)
CONTENT_TYPE = "application/vnd.slurmguard.report"
#: a Slurm node name as slurmguard accepts it anywhere (slurmguard.names)
NODE_NAME = NODE_NAME_RE


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepSample(_Model):
    """One iteration of one rank. end: Unix seconds; step_s/comm_s: seconds
    (comm_s = time the rank may have waited inside collectives during the
    iteration: in each gap between its calls, up to the last completion
    before the next call, detect.waiting; after a receive the hook cannot
    time, the time until the rank's next collective: see
    agent.analysis.waited_until)."""

    end: float
    step_s: float = Field(ge=0)
    comm_s: float = Field(ge=0)


class Step(NamedTuple):
    """One iteration as read from a StepWindow (the fields of StepSample)."""

    end: float
    step_s: float
    comm_s: float


_LE_F64 = np.dtype("<f8")


def _form_of(packed_type: type) -> Callable[[object], str]:
    """The discriminator of a field sent either as a list of records ("list") or
    as packed columns ("packed": a dict from JSON, or the object itself)."""

    def form(v: object) -> str:
        return "packed" if isinstance(v, (dict, packed_type)) else "list"

    return form


#: bytes in JSON are base64 text (standard or URL-safe alphabet), decoded by the parser
_B64_BYTES = core_schema.CoreConfig(val_json_bytes="base64")


def _packed_schema(cls: type, fields: dict[str, core_schema.TypedDictField]) -> core_schema.CoreSchema:
    """The schema of a type sent as packed columns: from JSON the dict of `fields`
    (base64 decoded by the parser; the columns may also follow the JSON, wire
    format 4), which `decode_report` reads into the type for the whole report at
    once; from Python an instance; serialised to JSON through its packed()."""
    return core_schema.json_or_python_schema(
        json_schema=core_schema.typed_dict_schema(fields, extra_behavior="forbid", config=_B64_BYTES),
        python_schema=core_schema.is_instance_schema(cls),
        serialization=core_schema.plain_serializer_function_ser_schema(
            lambda x: x.packed(), when_used="json"
        ),
    )


class StepWindow(Sequence):
    """A rank's iterations as one (3, n) float64 array (end, step_s, comm_s):
    24 bytes an iteration instead of a model object each, and the packed wire
    form (schema versions 2 and later). Reads like the list of StepSample it
    replaces (len, index, slice, iterate); `end`, `step_s` and `comm_s` are the
    columns, for code that works on arrays. Read off the wire by `decode_report`,
    which checks all the windows of a report at once."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    @staticmethod
    def check(n: int, cols: bytes | str) -> np.ndarray:
        """The (3, n) array of a packed window's cols (its 24 x n bytes, or base64 text of
        them); ValueError naming what is wrong."""
        if isinstance(cols, str):
            try:
                cols = binascii.a2b_base64(cols, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"cols: Data should be valid base64 ({exc})") from None
        if len(cols) != 24 * n:
            raise ValueError(f"cols holds {len(cols)} bytes; n={n} needs 24 x n = {24 * n}")
        a = np.frombuffer(cols, dtype=_LE_F64).reshape(3, n)
        if not np.isfinite(a).all():
            raise ValueError("cols holds a value that is not a finite number")
        if n and a[1:].min() < 0:
            raise ValueError("step_s and comm_s must be >= 0")
        return a

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
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return _packed_schema(
            cls,
            {
                "n": core_schema.typed_dict_field(core_schema.int_schema(ge=0, le=MAX_PACKED_STEPS)),
                "cols": core_schema.typed_dict_field(core_schema.bytes_schema(), required=False),
            },
        )

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


#: iterations RankReport.newest_slower looks at: one more than a single outlier
#: and its neighbour
NEWEST_SLOWER_STEPS = 3


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
    baseline_mean_s: float | None = None
    """Mean step time of the rank's healthy iterations (s), its outliers and
    checkpoints counted: what an intermittent slowdown (some iterations slowed,
    the median not) is measured against (slurmguard.detect.steps); None: unknown."""
    baseline_compute_s: float | None = None
    """Median compute (step minus time inside collectives, s) of the iterations the
    baseline was learned or last followed over (agent.analysis.RankAnalyzer); None: unknown."""
    baseline_compute_mean_s: float | None = Field(None, ge=0)
    """Plain mean compute (s) of the same iterations: what a rank's plain mean
    compute is compared with (controller.assess.localise, a rank without
    same-role peers); None: unknown (an older agent), the median stands in."""
    baseline_compute_at: float | None = None
    """Unix s of the newest iteration the compute baseline was taken over (learned,
    learned again after a new iteration structure, or followed); None: unknown."""
    steps: Steps = Field(default_factory=list)
    """The rank's newest iterations (agent.report_steps of them), oldest first."""
    total_steps: int = 0
    last_progress: float | None = None
    """Unix s of the rank's last completed collective."""
    in_flight_since: float | None = None
    """Unix s since which the rank has had a collective in flight (None: none,
    or its hook does not say, see in_flight_known)."""
    in_flight_known: bool = False
    """The rank's hook says which calls are in flight (the torch hook and the
    NCCL profiler plugin do, the NCCL hook while it times calls on the GPU):
    in_flight_since None then means the rank is between collectives."""
    lost_records: int = 0
    changes: tuple[ChangeReport, ...] = ()
    exited: bool = False
    """The rank's process is gone while its ring stays (it died, or the job
    ends): its silence is not a stall and its last steps are not a slowdown."""
    stopped: bool = False
    """The rank's process is stopped (state T: SIGSTOP, a tracer) at the agent's
    last look: it cannot progress, so in a stall it is the rank the others wait
    for, whatever the ring says is in flight."""
    last_io: float | None = None
    """Unix s of the agent's newest look at which the rank's process was busy
    with I/O (agent.rings.IO_ACTIVE_BYTES_S or more through its read and write
    calls since the look before: a checkpoint save or load); None: never seen.
    A stall does not count while the ranks the others wait for are so busy."""
    links: tuple[LinkReport, ...] = Field((), max_length=MAX_LINKS)
    """Per-link transfer times (NCCL profiler plugin only; empty otherwise). (Tuples here:
    an empty one is no object to the garbage collector, which a controller holding
    80,000 ranks walks through.)"""

    def newest_slower(self, factor: float, n: int = NEWEST_SLOWER_STEPS) -> bool:
        """Whether the rank's newest n iterations all took at least `factor` times
        its baseline step (False without a baseline or n iterations): the first
        sign of a slowdown. What makes an agent report early and the controller
        judge a report at once."""
        base = self.baseline_step_s
        if not base or len(self.steps) < n:
            return False
        newest = self.steps[-n:]
        step_s = newest.step_s if isinstance(newest, StepWindow) else [s.step_s for s in newest]
        return bool(min(step_s) >= factor * base)


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
    def check(
        cls, keys: list[TelemetryKey], n: int, k_raw: bytes | str, cols: bytes | str
    ) -> TelemetryColumns:
        """The columns of a packed report's telemetry (keys already checked; k and cols:
        their bytes, or base64 text of them); ValueError naming what is wrong."""
        if isinstance(k_raw, str) or isinstance(cols, str):
            try:
                k_raw = binascii.a2b_base64(k_raw, strict_mode=True)
                cols = binascii.a2b_base64(cols, strict_mode=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"k or cols: Data should be valid base64 ({exc})") from None
        if len(k_raw) != 4 * n or len(cols) != 16 * n:
            raise ValueError(
                f"k holds {len(k_raw)} bytes and cols {len(cols)}; n={n} needs 4 x n = {4 * n} "
                f"and 16 x n = {16 * n}"
            )
        k = np.frombuffer(k_raw, dtype=_LE_U4)
        a = np.frombuffer(cols, dtype=_LE_F64).reshape(2, n)
        if n:
            top = int(k.max())
            if top >= len(keys):
                raise ValueError(f"k names key {top}; there are {len(keys)} keys")
            # isfinite and all (15k instructions), not a min and a max (11k each): at a
            # report's few samples what numpy's calls cost is their overhead
            if not np.isfinite(a).all():
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
        return _packed_schema(
            cls,
            {
                "keys": core_schema.typed_dict_field(
                    core_schema.list_schema(key, max_length=MAX_PACKED_SAMPLES)
                ),
                "n": core_schema.typed_dict_field(core_schema.int_schema(ge=0, le=MAX_PACKED_SAMPLES)),
                "k": core_schema.typed_dict_field(core_schema.bytes_schema(), required=False),
                "cols": core_schema.typed_dict_field(core_schema.bytes_schema(), required=False),
            },
        )

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
    schema_version: Literal[1, 2, 3, 4] = SCHEMA_VERSION
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


class ReportError(ValueError):
    """A report that cannot be read: `where` is the field (its dotted path in the
    report, "" for the whole body), `why` what is wrong with it."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}" if where else why)
        self.where, self.why = where, why


def _windows(report: AgentReport, tail: memoryview | None) -> int:
    """Put the report's step windows in place: each rank's packed window, as its JSON
    left it ({"n", "cols": bytes}, or {"n"} with its bytes in `tail`), checked with
    all the others at once (one join and three array operations for the report
    when its windows have one length, whatever its number of ranks); ReportError
    naming the first bad one. Returns the bytes of `tail` they took."""
    # each rank is visited once: for 8 ranks the Python work here costs about as
    # much as the array operations (callgrind: 108k instructions in all, was 118k)
    found: list[tuple[int, int]] = []  # (job, rank) of each window, to name a bad one
    ranks: list[RankReport] = []
    ns: list[int] = []
    raws: list[Any] = []
    short: tuple[int, int, int, int] | None = None  # the first window whose bytes do not fit
    at = 0
    for x, j in enumerate(report.jobs):
        for y, r in enumerate(j.ranks):
            p = r.steps
            if type(p) is not dict:  # a list of records (format 1): read already
                continue
            n = p["n"]
            raw = p.get("cols")
            if raw is None:
                if tail is None:
                    raise ReportError(f"jobs.{x}.ranks.{y}.steps.cols", "Field required")
                raw = tail[at : at + 24 * n]
                at += 24 * n
            if short is None and len(raw) != 24 * n:
                short = (x, y, n, len(raw))
            found.append((x, y))
            ranks.append(r)
            ns.append(n)
            raws.append(raw)
    if not found:
        return at
    if short is not None:
        x, y, n, size = short
        raise ReportError(
            f"jobs.{x}.ranks.{y}.steps", f"cols holds {size} bytes; n={n} needs 24 x n = {24 * n}"
        )
    # one copy of them all: the windows kept hold nothing of the body
    flat = np.frombuffer(b"".join(raws), dtype=_LE_F64)
    n0 = ns[0]
    same = ns.count(n0) == len(ns)
    ok = bool(np.isfinite(flat).all())
    if same:
        a = flat.reshape(len(ns), 3, n0)
        ok = ok and (n0 == 0 or float(a[:, 1:].min()) >= 0)  # step_s and comm_s
    elif ok:
        bounds, end = [], 0
        for n in ns:
            if n:
                bounds += [end + n, end + 3 * n]  # step_s and comm_s of this window
            end += 3 * n
        if bounds and bounds[-1] == end:  # the last segment runs to the end (reduceat's rule)
            bounds.pop()
        ok = not bounds or float(np.minimum.reduceat(flat, bounds)[::2].min()) >= 0
    if not ok:  # one of them is bad: each on its own, to name it
        for (x, y), n, c in zip(found, ns, raws):
            try:
                StepWindow.check(n, bytes(c))
            except ValueError as exc:
                raise ReportError(f"jobs.{x}.ranks.{y}.steps", str(exc)) from None
        raise AssertionError("_windows: joined windows failed, each alone passed")
    # the ranks were built by decode_report's parse, and no one has seen them yet
    if same:
        for r, arr in zip(ranks, a):
            r.__dict__["steps"] = StepWindow(arr)
    else:
        end = 0
        for r, n in zip(ranks, ns):
            r.__dict__["steps"] = StepWindow(flat[end : end + 3 * n].reshape(3, n))
            end += 3 * n
    return at


def decode_report(body: bytes) -> AgentReport:
    """The report of a request body, any wire format (1 to 4), checked: ReportError
    naming the field and what is wrong. (Read reports with this, not with
    AgentReport.model_validate_json, which leaves packed windows and telemetry as
    the dicts of their JSON.)"""
    tail: memoryview | None = None
    head = body
    nl = body.find(b"\n")
    if nl >= 0 and body[:1] == b"{" and body[nl - 1 : nl] == b"}":  # a JSON line, then columns
        head, tail = body[:nl], memoryview(body)[nl + 1 :]
    try:
        report = AgentReport.model_validate_json(head)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ReportError(".".join(str(x) for x in first["loc"]), first["msg"]) from None
    if tail is not None and report.schema_version < 4:
        if bytes(tail).strip():
            raise ReportError("", f"wire format {report.schema_version} has nothing after its JSON")
        tail = None
    at = _windows(report, tail)
    tel = report.telemetry
    if type(tel) is dict:
        n, k, cols = tel["n"], tel.get("k"), tel.get("cols")
        if k is None or cols is None:
            if tail is None:
                raise ReportError(f"telemetry.{'cols' if k is not None else 'k'}", "Field required")
            cols, k = tail[at : at + 16 * n], tail[at + 16 * n : at + 20 * n]
            at += 20 * n
        try:
            report.__dict__["telemetry"] = TelemetryColumns.check(tel["keys"], n, k, cols)
        except ValueError as exc:
            raise ReportError("telemetry", str(exc)) from None
    if tail is not None and at != len(tail):
        raise ReportError("", f"the body's columns hold {len(tail)} bytes; its windows and telemetry {at}")
    return report


#: (fields at their defaults are left out of what an agent sends; the columns follow the JSON)
_BULK: Any = {"jobs": {"__all__": {"ranks": {"__all__": {"steps"}}}}, "telemetry": True}


def encode_report(report: AgentReport) -> bytes:
    """What an agent sends (wire format 4): the report's JSON on one line, the fields
    at their defaults left out, then its columns as raw little-endian bytes: each
    rank's window ({"n": N} in its place; 24 x N bytes: N end, N step_s, N comm_s,
    float64), in the order of jobs and ranks, then the telemetry ({"keys", "n": N}
    in its place): N timestamps and N values (float64), then N key indices (uint32)."""
    doc = report.model_dump(mode="json", exclude_defaults=True, exclude=_BULK)
    doc = {"schema_version": SCHEMA_VERSION, **doc}
    chunks = []
    for j, jd in zip(report.jobs, doc.get("jobs", ())):
        for r, rd in zip(j.ranks, jd.get("ranks", ())):
            a = np.ascontiguousarray(StepWindow.of(r.steps).columns, dtype=_LE_F64)
            rd["steps"] = {"n": a.shape[1]}
            chunks.append(a.tobytes())
    if report.telemetry:
        tel = TelemetryColumns.of(report.telemetry)
        doc["telemetry"] = {"keys": [list(k) for k in tel.keys], "n": len(tel)}
        chunks.append(np.concatenate([tel.timestamp, tel.value]).astype(_LE_F64, copy=False).tobytes())
        chunks.append(tel.k.astype(_LE_U4, copy=False).tobytes())
    # compact: a JSON text without a line break, which the columns follow
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n" + b"".join(chunks)


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
