"""Python reader and writer of slurmguard's per-rank ring files.

The format is defined once, in ``spank_plugin/sg_ring.h``; this module mirrors
it field by field (``tests/test_hook_ring_format.py`` checks both against the
C compiler's view of the header). Read that header first: header page,
fixed 128-byte records, commit protocol, control word.

This module uses the standard library only (and slurmguard.errors, which does
too), because the torch hook loads it inside users' jobs, whatever Python
environment they run. The reader alone needs numpy (a dependency of
slurmguard, imported when a ring is first read): it takes a batch of records
as one structured array (record_dtype) instead of an object per record.

Readers never block writers and never crash on a bad file: a truncated or
corrupt ring raises :class:`RingError` (one line naming the file and the
problem), a torn or overwritten record is counted as lost and skipped.

Python readers rely on 8-byte aligned loads being single-copy atomic and
on loads not being reordered with older loads (x86-64); the seq check
before and after copying a record catches everything else.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from slurmguard.errors import InputError

if TYPE_CHECKING:
    import numpy as np

MAGIC = 0x3130474E49524753  # b"SGRING01" read as little-endian u64
#: 2: 128-byte records with GPU start/end and per-peer transfer aggregates
VERSION = 2
HEADER_SIZE = 4096
RECORD_SIZE = 128
MIN_CAPACITY = 16
MAX_CAPACITY = 1 << 24
DEFAULT_CAPACITY = 65536
NODE_NAME_LEN = 64

SOURCE_NCCL = 1
SOURCE_TORCH = 2
SOURCE_TEST = 3
SOURCE_NCCL_PROFILER = 4
SOURCE_NAMES = {
    SOURCE_NCCL: "nccl",
    SOURCE_TORCH: "torch",
    SOURCE_TEST: "test",
    SOURCE_NCCL_PROFILER: "ncclprof",
}

CTL_HOLD = 0x1
HOLD_DEFAULT_TIMEOUT_MS = 60000

STEP_INTERACTIVE = 0xFFFFFFFA
STEP_BATCH = 0xFFFFFFFB
STEP_EXTERN = 0xFFFFFFFC
STEP_PENDING = 0xFFFFFFFD

# enum sg_op, by value
OP_NAMES: tuple[str, ...] = (
    "none",
    "allreduce",
    "allgather",
    "reducescatter",
    "broadcast",
    "reduce",
    "alltoall",
    "send",
    "recv",
    "group_start",
    "group_end",
    "comm_init",
    "comm_destroy",
    "comm_abort",
    "barrier",
    "gather",
    "scatter",
    "hold",
    "comm_split",
    "peer_xfer",
)
OP = {name: value for value, name in enumerate(OP_NAMES)}
#: ops that are not collectives: bookkeeping (groups, communicators, holds,
#: padding) and the profiler plugin's per-link aggregates (peer_xfer); what
#: readers leave out of op sequences and iteration timing
NOT_COLLECTIVE = frozenset(
    OP[n]
    for n in (
        "none",
        "group_start",
        "group_end",
        "comm_init",
        "comm_destroy",
        "comm_abort",
        "hold",
        "comm_split",
        "peer_xfer",
    )
)

# enum sg_datatype, by value, and element sizes in bytes
DATATYPE_NAMES: tuple[str, ...] = (
    "unknown",
    "int8",
    "uint8",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8_e4m3",
    "float8_e5m2",
    "bool",
    "int16",
    "uint16",
    "complex64",
    "complex128",
)
DATATYPE = {name: value for value, name in enumerate(DATATYPE_NAMES)}
DATATYPE_SIZES: tuple[int, ...] = (0, 1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1, 1, 2, 2, 8, 16)

# enum sg_redop, by value
REDOP_NAMES: tuple[str, ...] = ("none", "sum", "prod", "max", "min", "avg", "other")
REDOP = {name: value for value, name in enumerate(REDOP_NAMES)}

F_IN_GROUP = 0x01
F_ASYNC = 0x04
F_COMM_UNKNOWN = 0x08
F_ERROR = 0x10
F_COALESCED = 0x20
F_TIMEOUT = 0x40
F_GPU_TIME = 0x80  # gpu_start_ns/gpu_end_ns hold the GPU execution of the call
F_CAPTURED = 0x100  # issued into a CUDA graph capture: no events, runs later
F_NO_EVENT = 0x200  # GPU timing wanted but not available for this call
F_XFER_SEND = 0x400  # peer_xfer: data sent to the peer (else received)
FLAG_NAMES = {
    F_IN_GROUP: "in_group",
    F_ASYNC: "async",
    F_COMM_UNKNOWN: "comm_unknown",
    F_ERROR: "error",
    F_COALESCED: "coalesced",
    F_TIMEOUT: "timeout",
    F_GPU_TIME: "gpu_time",
    F_CAPTURED: "captured",
    F_NO_EVENT: "no_event",
    F_XFER_SEND: "xfer_send",
}

# header.header_flags: HF_IN_FLIGHT, the writer keeps header.in_flight (calls
# entered and not yet recorded nor counted lost) and header.in_flight_since_ns
# (CLOCK_MONOTONIC when in_flight last rose from 0). A reader then knows a
# rank with in_flight 0 is between collectives, not blocked inside one;
# without the flag it cannot tell.
HF_IN_FLIGHT = 0x1

# header.gpu_state: the writer's GPU timing (CUDA events or profiler plugin)
GPU_STATE_NAMES: tuple[str, ...] = ("untried", "on", "no_runtime", "pool_exhausted", "cuda_error", "disabled")

# struct sg_ring_header: (field, offset, struct code); node_name is char[64]
HEADER_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("magic", 0, "Q"),
    ("version", 8, "I"),
    ("header_size", 12, "I"),
    ("record_size", 16, "I"),
    ("capacity", 20, "I"),
    ("job_id", 24, "I"),
    ("step_id", 28, "I"),
    ("global_rank", 32, "i"),
    ("local_rank", 36, "i"),
    ("world_size", 40, "i"),
    ("pid", 44, "I"),
    ("clock_offset_ns", 48, "q"),
    ("created_ns", 56, "Q"),
    ("source", 64, "I"),
    ("header_flags", 68, "I"),
    ("node_name", 72, f"{NODE_NAME_LEN}s"),
    ("write_counter", 192, "Q"),
    ("overwritten", 200, "Q"),
    ("gpu_lost", 208, "Q"),
    ("gpu_state", 216, "I"),
    ("gpu_error", 220, "i"),
    ("in_flight", 224, "I"),
    ("in_flight_since_ns", 232, "Q"),
    ("control", 256, "I"),
    ("hold_timeout_ms", 260, "I"),
    ("hold_since_ns", 264, "Q"),
    ("holds", 272, "Q"),
    ("hold_timeouts", 280, "Q"),
)
_HDR = {name: (off, struct.Struct("<" + code)) for name, off, code in HEADER_FIELDS}

# struct sg_record, in order; offsets follow from the packing below
RECORD_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("seq", 0, "Q"),
    ("comm_id", 8, "Q"),
    ("count", 16, "Q"),
    ("bytes", 24, "Q"),
    ("start_ns", 32, "Q"),
    ("end_ns", 40, "Q"),
    ("peer", 48, "i"),
    ("op", 52, "H"),
    ("datatype", 54, "B"),
    ("redop", 55, "B"),
    ("flags", 56, "I"),
    ("status", 60, "i"),
    ("gpu_start_ns", 64, "Q"),
    ("gpu_end_ns", 72, "Q"),
    ("coll_seq", 80, "Q"),
    ("xfer_net_ns", 88, "Q"),
    ("xfer_peer_wait_ns", 96, "Q"),
    ("xfer_gpu_wait_ns", 104, "Q"),
    ("xfer_channels", 112, "Q"),
    ("xfer_ops", 120, "I"),
    ("reserved", 124, "I"),
)
# _REC: the first 64 bytes (what a host-only writer fills; the rest stays 0),
# _REC_EXT: GPU times and transfer aggregates after it
_N_HEAD = 12
_REC = struct.Struct("<" + "".join(code for _, _, code in RECORD_FIELDS[:_N_HEAD]))
_REC_EXT = struct.Struct("<" + "".join(code for _, _, code in RECORD_FIELDS[_N_HEAD:]))
_EXT_NAMES = frozenset(name for name, _, _ in RECORD_FIELDS[_N_HEAD:])
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
assert _REC.size + _REC_EXT.size == RECORD_SIZE

#: how ring files are named: rank-<global>.step-<step>.<source>[.pid-<pid>].ring
RING_NAME = re.compile(
    r"^rank-(?P<rank>-?\d+)\.step-(?P<step>[a-z0-9]+)\.(?P<source>[a-z]+)(?:\.pid-(?P<pid>\d+))?\.ring$"
)


class RingError(InputError):
    """A ring file that cannot be used: missing, truncated, corrupt (names the file)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def step_name(step_id: int) -> str:
    """Slurm's name for a step id: a number, or batch/extern/interactive."""
    return {STEP_BATCH: "batch", STEP_EXTERN: "extern", STEP_INTERACTIVE: "interactive"}.get(
        step_id, str(step_id)
    )


def ring_file_name(global_rank: int, step_id: int, source: str) -> str:
    return f"rank-{global_rank}.step-{step_name(step_id)}.{source}.ring"


def comm_id_of(name: str) -> int:
    """FNV-1a 64 of a communicator name, never 0 (0 means "no communicator")."""
    h = 0xCBF29CE484222325
    for b in name.encode():
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h or 1


@dataclass(frozen=True)
class RingHeader:
    """The header page. Times are CLOCK_MONOTONIC ns; clock_offset_ns
    converts them to wall-clock (CLOCK_REALTIME) ns."""

    path: str
    magic: int
    version: int
    header_size: int
    record_size: int
    capacity: int
    job_id: int
    step_id: int
    global_rank: int
    local_rank: int
    world_size: int
    pid: int
    clock_offset_ns: int
    created_ns: int
    source: int
    header_flags: int
    node_name: str
    write_counter: int
    overwritten: int
    control: int
    hold_timeout_ms: int
    hold_since_ns: int
    holds: int
    hold_timeouts: int
    gpu_lost: int = 0
    gpu_state: int = 0
    gpu_error: int = 0
    in_flight: int = 0
    in_flight_since_ns: int = 0

    @property
    def gpu_state_name(self) -> str:
        """How the writer timed GPU work: GPU_STATE_NAMES (sg_ring.h SG_GPU_*)."""
        return (
            GPU_STATE_NAMES[self.gpu_state] if self.gpu_state < len(GPU_STATE_NAMES) else str(self.gpu_state)
        )

    @property
    def step(self) -> str:
        return step_name(self.step_id)

    @property
    def source_name(self) -> str:
        return SOURCE_NAMES.get(self.source, str(self.source))

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("path")
        d["step"] = self.step
        d["source"] = self.source_name
        d["gpu_state"] = self.gpu_state_name
        return d


@dataclass(frozen=True)
class RingRecord:
    """One intercepted call (struct sg_record). start_ns/end_ns are the host
    entry/return of the call (for NCCL: the enqueue), CLOCK_MONOTONIC ns;
    count is elements, bytes = count * element size.

    GPU time: with F_GPU_TIME set, gpu_start_ns/gpu_end_ns (CLOCK_MONOTONIC
    ns of this host) are when the call's work ran on the GPU. The duration
    rule, used by :attr:`duration_ns`: GPU time when present, else host
    time. A rank that waits inside a collective for a slow peer shows a long
    GPU duration; the late rank shows a late gpu_start_ns (:attr:`begin_ns`).

    peer_xfer records (op "peer_xfer", NCCL profiler plugin) aggregate the
    network steps of one direction (F_XFER_SEND: sent) to one peer (comm
    rank) over [start_ns, end_ns]: count = steps, bytes = bytes moved,
    xfer_net_ns = time on the network, xfer_peer_wait_ns = sends waiting for
    the peer's clear-to-send, xfer_gpu_wait_ns = waiting for the local GPU,
    xfer_channels = channel bitmask, xfer_ops = proxy operations.
    """

    seq: int
    comm_id: int
    count: int
    bytes: int
    start_ns: int
    end_ns: int
    peer: int
    op: int
    datatype: int
    redop: int
    flags: int
    status: int
    gpu_start_ns: int = 0
    gpu_end_ns: int = 0
    coll_seq: int = 0
    xfer_net_ns: int = 0
    xfer_peer_wait_ns: int = 0
    xfer_gpu_wait_ns: int = 0
    xfer_channels: int = 0
    xfer_ops: int = 0
    reserved: int = 0

    @property
    def op_name(self) -> str:
        return OP_NAMES[self.op] if 0 <= self.op < len(OP_NAMES) else str(self.op)

    @property
    def number(self) -> int:
        """Position in the ring's history (seq - 1)."""
        return self.seq - 1

    @property
    def is_peer_xfer(self) -> bool:
        """A per-link transfer aggregate (profiler plugin), not a call: keep
        it out of op sequences and iteration timing."""
        return self.op == OP["peer_xfer"]

    @property
    def has_gpu_time(self) -> bool:
        return bool(self.flags & F_GPU_TIME)

    @property
    def host_duration_ns(self) -> int:
        """Host entry to return of the call (for NCCL on a GPU: the enqueue)."""
        return self.end_ns - self.start_ns

    @property
    def gpu_duration_ns(self) -> int | None:
        """Time the work ran on the GPU, None without GPU timing."""
        return self.gpu_end_ns - self.gpu_start_ns if self.has_gpu_time else None

    @property
    def duration_ns(self) -> int:
        """GPU time when the record has it, else host time (the duration rule)."""
        return self.gpu_end_ns - self.gpu_start_ns if self.has_gpu_time else self.end_ns - self.start_ns

    @property
    def begin_ns(self) -> int:
        """When the work started: on the GPU when known, else the host call."""
        return self.gpu_start_ns if self.has_gpu_time else self.start_ns

    @property
    def finish_ns(self) -> int:
        """When the work finished: on the GPU when known, else the host return."""
        return self.gpu_end_ns if self.has_gpu_time else self.end_ns

    def to_json(self) -> dict:
        """Field names as in sg_ring.h; enums by name."""
        return {
            "seq": self.seq,
            "op": self.op_name,
            "comm_id": self.comm_id,
            "count": self.count,
            "bytes": self.bytes,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "peer": self.peer,
            "datatype": DATATYPE_NAMES[self.datatype]
            if self.datatype < len(DATATYPE_NAMES)
            else self.datatype,
            "redop": REDOP_NAMES[self.redop] if self.redop < len(REDOP_NAMES) else self.redop,
            "flags": [name for bit, name in FLAG_NAMES.items() if self.flags & bit],
            "status": self.status,
            **(
                {"gpu_start_ns": self.gpu_start_ns, "gpu_end_ns": self.gpu_end_ns}
                if self.has_gpu_time
                else {}
            ),
            **({"coll_seq": self.coll_seq} if self.coll_seq else {}),
            **(
                {
                    "xfer_net_ns": self.xfer_net_ns,
                    "xfer_peer_wait_ns": self.xfer_peer_wait_ns,
                    "xfer_gpu_wait_ns": self.xfer_gpu_wait_ns,
                    "xfer_channels": self.xfer_channels,
                    "xfer_ops": self.xfer_ops,
                }
                if self.op == OP["peer_xfer"]
                else {}
            ),
        }


@dataclass
class ReadBatch:
    """What one read() found. cursor: where the next read continues.
    lost: records overwritten (or torn) before they could be read.
    corrupt: committed records with impossible contents, skipped.
    abandoned: reserved records that were never committed (writer died)."""

    records: list[RingRecord] = field(default_factory=list)
    cursor: int = 0
    lost: int = 0
    corrupt: int = 0
    abandoned: int = 0


@dataclass
class ArrayBatch:
    """What one read_array() found: as ReadBatch, with the records as one
    structured array of record_dtype() (fields as in sg_ring.h, oldest first)."""

    records: np.ndarray
    cursor: int = 0
    lost: int = 0
    corrupt: int = 0
    abandoned: int = 0


_NP_CODES = {"Q": "<u8", "q": "<i8", "I": "<u4", "i": "<i4", "H": "<u2", "B": "u1"}
_DTYPE: Any = None


def record_dtype() -> np.dtype:
    """struct sg_record as a numpy structured dtype (128 bytes, little-endian)."""
    global _DTYPE
    if _DTYPE is None:
        import numpy as np

        _DTYPE = np.dtype(
            {
                "names": [name for name, _, _ in RECORD_FIELDS],
                "formats": [_NP_CODES[code] for _, _, code in RECORD_FIELDS],
                "offsets": [off for _, off, _ in RECORD_FIELDS],
                "itemsize": RECORD_SIZE,
            }
        )
    return _DTYPE


def _plausible(r: np.ndarray) -> np.ndarray:
    """Mask of the records (record_dtype) whose contents a writer can have
    written: a known op (0, padding, is handled before), datatype and redop,
    an end not before the start, on the host and, with F_GPU_TIME, on the GPU."""
    return (
        (r["op"] > 0)
        & (r["op"] < len(OP_NAMES))
        & (r["datatype"] < len(DATATYPE_NAMES))
        & (r["redop"] < len(REDOP_NAMES))
        & (r["end_ns"] >= r["start_ns"])
        & (((r["flags"] & F_GPU_TIME) == 0) | (r["gpu_end_ns"] >= r["gpu_start_ns"]))
    )


def _header_from(buf: bytes, path: str) -> RingHeader:
    values = {}
    for name, (off, st) in _HDR.items():
        v = st.unpack_from(buf, off)[0]
        if name == "node_name":
            v = v.split(b"\0", 1)[0].decode("utf-8", "replace")
        values[name] = v
    return RingHeader(path=path, **values)


def _validate(h: RingHeader, size: int) -> None:
    if h.magic != MAGIC:
        raise RingError(h.path, "bad magic (not a ring, or not initialised yet)")
    if h.version < VERSION:
        raise RingError(
            h.path,
            f"ring format version {h.version} was written by an older slurmguard "
            f"(this reader knows version {VERSION}); upgrade the job's hook "
            f"or read it with the slurmguard that wrote it",
        )
    if h.version != VERSION:
        raise RingError(h.path, f"unsupported ring version {h.version} (this reader knows {VERSION})")
    if h.header_size != HEADER_SIZE or h.record_size != RECORD_SIZE:
        raise RingError(h.path, f"bad geometry: header {h.header_size} B, record {h.record_size} B")
    cap = h.capacity
    if cap < MIN_CAPACITY or cap > MAX_CAPACITY or cap & (cap - 1):
        raise RingError(h.path, f"bad capacity {cap}")
    need = HEADER_SIZE + cap * RECORD_SIZE
    if size < need:
        raise RingError(h.path, f"truncated: {size} bytes, a ring of {cap} records needs {need}")


def read_header(fd: int, path: str) -> RingHeader:
    """The validated header of the open file `fd`, for code that must not trust the file
    (the root epilog): a regular file of exactly the size its geometry gives, with every
    block allocated (sg_ring_create and RingWriter posix_fallocate the whole ring, so a
    sparse "ring" is a forgery that would copy as gigabytes of zeros). RingError otherwise."""
    import stat as _stat

    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        raise RingError(path, "not a regular file")
    buf = os.pread(fd, HEADER_SIZE, 0)
    if len(buf) < 8 or _U64.unpack_from(buf, 0)[0] != MAGIC:
        raise RingError(path, "bad magic (not a ring, or not initialised yet)")
    if len(buf) < HEADER_SIZE:
        raise RingError(path, f"truncated: {st.st_size} bytes, the header alone is {HEADER_SIZE}")
    h = _header_from(buf, path)
    _validate(h, st.st_size)
    need = HEADER_SIZE + h.capacity * RECORD_SIZE
    if st.st_size != need:
        raise RingError(path, f"size {st.st_size} bytes, a ring of {h.capacity} records is {need}")
    if st.st_blocks * 512 < need:
        raise RingError(path, f"sparse: {st.st_blocks * 512} of {need} bytes allocated")
    return h


#: records copied per pread while reading (256 KiB)
_CHUNK = 4096


class RingReader:
    """Read one ring while its writer runs.

    Use ``read()`` repeatedly with the returned cursor; each call returns
    the records committed since. `stall_s` (seconds, default 5): a reserved
    record that stays uncommitted that long is given up as abandoned;
    `clock` returns seconds (default time.monotonic). write_counter counts
    reserved numbers and may run ahead of the newest committed record.

    Ring files live in directories their job's user owns, so the file is
    untrusted: it is opened with O_NONBLOCK|O_NOFOLLOW (a FIFO or a symlink
    neither blocks nor redirects the reader), must be a regular file of
    exactly the size its header's geometry gives, with that many bytes
    allocated (no sparse file standing in for a huge ring), and is read
    with pread, never mapped: a file truncated under a mapping would kill
    the reader with SIGBUS, a short pread is only a RingError.
    `dir_fd`: open `path`'s last component relative to this directory
    descriptor (the caller has checked the directory itself).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        stall_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        dir_fd: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self._stall_s = stall_s
        self._clock = clock
        self._stuck: tuple[int, float] | None = None
        self._fd = -1
        name = os.path.basename(self.path) if dir_fd is not None else self.path
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise RingError(self.path, f"cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if stat.S_ISREG(st.st_mode) and size < HEADER_SIZE:  # before what the bytes would say
                raise RingError(self.path, f"truncated: {size} bytes, the header alone is {HEADER_SIZE}")
            self.header = read_header(fd, self.path)
        except OSError as exc:
            os.close(fd)
            raise RingError(self.path, f"cannot read: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.capacity = self.header.capacity
        self._mask = self.capacity - 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def fileno(self) -> int:
        return self._fd

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pread(self, size: int, offset: int) -> bytes:
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            raise RingError(self.path, f"cannot read: {exc.strerror}") from None
        if len(data) < size:
            raise RingError(self.path, f"truncated while open: short read at offset {offset}")
        return data

    def refresh_header(self) -> RingHeader:
        """The header with current counters and control state."""
        self.header = _header_from(self._pread(HEADER_SIZE, 0), self.path)
        return self.header

    @property
    def write_counter(self) -> int:
        return _U64.unpack(self._pread(8, _HDR["write_counter"][0]))[0]

    def in_flight(self) -> tuple[bool, int | None]:
        """(whether the writer keeps the in-flight count now, HF_IN_FLIGHT;
        CLOCK_MONOTONIC ns since which it has had a call in flight, None when
        it has none or does not keep the count). The NCCL hook keeps it only
        while its GPU timing is on, so the flag is read afresh. A count
        without a start time (a reader between the writer's two stores)
        reads as in flight from now."""
        lo, hi = _HDR["header_flags"][0], _HDR["in_flight_since_ns"][0] + 8
        data = self._pread(hi - lo, lo)
        flags = _U32.unpack_from(data, 0)[0]
        if not flags & HF_IN_FLIGHT:
            return False, None
        count = _U32.unpack_from(data, _HDR["in_flight"][0] - lo)[0]
        since = _U64.unpack_from(data, _HDR["in_flight_since_ns"][0] - lo)[0]
        if count == 0:
            return True, None
        return True, since or time.monotonic_ns()

    def _chunk(self, cursor: int, count: int) -> tuple[bytes, bytes]:
        """Records cursor..cursor+count-1 (not wrapping), copied twice: a
        record whose seq is the same in both copies was not rewritten
        while the first copy was taken (writers clear seq before they
        touch a record and set it last)."""
        off = HEADER_SIZE + (cursor & self._mask) * RECORD_SIZE
        first = self._pread(count * RECORD_SIZE, off)
        return first, self._pread(count * RECORD_SIZE, off)

    def read(self, cursor: int | None = None, max_records: int | None = None) -> ReadBatch:
        """Records from `cursor` (default: the oldest still in the ring) up
        to what is committed now, at most `max_records`, as RingRecord
        objects (read_array, one object per record: for tools and the
        epilog, not for a reader of busy rings). RingError if the file
        shrank under the reader."""
        b = self.read_array(cursor, max_records)
        return ReadBatch(
            [RingRecord(*row) for row in b.records.tolist()], b.cursor, b.lost, b.corrupt, b.abandoned
        )

    def read_array(self, cursor: int | None = None, max_records: int | None = None) -> ArrayBatch:
        """As read(), the records as one structured array (record_dtype()).

        Per record, oldest first: one not yet committed (seq below its
        number + 1) ends the read, unless _give_up says its writer died
        (abandoned, skipped); one overwritten (seq above) or rewritten while
        copied (seq differs between the two copies) is lost; padding (op 0)
        is skipped; one with impossible contents (_plausible) is corrupt."""
        import numpy as np

        dt = record_dtype()
        wc = self.write_counter
        lost = corrupt = abandoned = 0
        if cursor is None:
            cursor = max(0, wc - self.capacity)
        if wc - cursor > self.capacity:
            lost += wc - self.capacity - cursor
            cursor = wc - self.capacity
        parts: list[np.ndarray] = []
        got = 0
        stop = False
        while cursor < wc and (max_records is None or got < max_records) and not stop:
            count = min(wc - cursor, _CHUNK, self.capacity - (cursor & self._mask))
            if max_records is not None:
                count = min(count, max_records - got)
            a, b = self._chunk(cursor, count)
            recs = np.frombuffer(a, dtype=dt, count=count)
            seq = recs["seq"]
            again = np.frombuffer(b, dtype=dt, count=count)["seq"]
            want = np.arange(cursor + 1, cursor + 1 + count, dtype=np.uint64)
            i = 0
            while i < count:
                # up to the next record not committed yet (rare: a tail still
                # being written, or a writer that died holding numbers)
                waiting = np.flatnonzero(seq[i:] < want[i:])
                j = count if waiting.size == 0 else i + int(waiting[0])
                if j > i:
                    s, w = seq[i:j], want[i:j]
                    ok = (s == w) & (again[i:j] == s)
                    lost += int(np.count_nonzero(~ok))  # overwritten, or rewritten while copied
                    r = recs[i:j][ok]
                    r = r[r["op"] != 0]  # padding a writer left when it stopped reserving blocks
                    good = _plausible(r)
                    corrupt += int(np.count_nonzero(~good))
                    r = r[good]
                    if r.size:
                        parts.append(r)
                        got += r.size
                if j == count:
                    break
                if self._give_up(cursor + j, wc):
                    abandoned += 1
                    i = j + 1
                    continue
                stop = True
                count = j
                break
            cursor += count
        # (boolean selection copied each part: nothing refers to the chunks' bytes)
        records = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=dt)
        return ArrayBatch(records, cursor, lost, corrupt, abandoned)

    def _give_up(self, cursor: int, wc: int) -> bool:
        # Writers may reserve blocks of numbers ahead (see sg_ring.h), so an
        # uncommitted record at the tail is normal: wait for it. A hole with
        # committed records after it that stays open for stall_s belongs to
        # a writer that died; one the ring is about to overwrite is lost.
        if wc - cursor > self.capacity // 2:
            return True
        if not self._committed_after(cursor, wc):
            self._stuck = None
            return False
        now = self._clock()
        if self._stuck is None or self._stuck[0] != cursor:
            self._stuck = (cursor, now)
            return False
        return now - self._stuck[1] >= self._stall_s

    def _committed_after(self, cursor: int, wc: int) -> bool:
        for n in range(cursor + 1, min(wc, cursor + 257)):
            off = HEADER_SIZE + (n & self._mask) * RECORD_SIZE
            if _U64.unpack(self._pread(8, off))[0] >= n + 1:
                return True
        return False

    def records(self) -> Iterator[RingRecord]:
        """All records currently in the ring, oldest first."""
        yield from self.read().records


class RingWriter:
    """Create a ring and append records to it (the torch hook's writer).

    Appends from several threads of one process are serialised by a lock
    held for a few microseconds; one ring file has one writing process.
    """

    def __init__(
        self,
        path: str,
        *,
        capacity: int = DEFAULT_CAPACITY,
        job_id: int = 0,
        step_id: int = STEP_PENDING,
        global_rank: int = -1,
        local_rank: int = -1,
        world_size: int = 0,
        source: int = SOURCE_TORCH,
        node_name: str = "",
        tracks_in_flight: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        cap = MIN_CAPACITY
        while cap < capacity and cap < MAX_CAPACITY:
            cap <<= 1
        self.capacity = cap
        self._mask = cap - 1
        size = HEADER_SIZE + cap * RECORD_SIZE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                # reserve the memory now: a full /dev/shm is an error here,
                # never a SIGBUS in the middle of training
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(self.path)
                raise
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._n = 0
        self._given_up = 0  # records the writer could not write (count_lost)
        self._ext = False  # a record with GPU / transfer fields was written
        self._in_flight = 0
        mono = time.monotonic_ns()
        real = time.time_ns()
        mono2 = time.monotonic_ns()
        put = self._put
        put("version", VERSION)
        put("header_size", HEADER_SIZE)
        put("record_size", RECORD_SIZE)
        put("capacity", cap)
        put("job_id", job_id & 0xFFFFFFFF)
        put("step_id", step_id & 0xFFFFFFFF)
        put("global_rank", global_rank)
        put("local_rank", local_rank)
        put("world_size", world_size)
        put("pid", os.getpid())
        put("clock_offset_ns", real - (mono + mono2) // 2)
        put("created_ns", mono2)
        put("source", source)
        put("node_name", node_name.encode()[: NODE_NAME_LEN - 1])
        put("header_flags", HF_IN_FLIGHT if tracks_in_flight else 0)
        put("magic", MAGIC)  # last: a reader that sees it sees the rest

    def _put(self, name: str, value: int | bytes) -> None:
        off, st = _HDR[name]
        st.pack_into(self._mm, off, value)

    def close(self) -> None:
        self._mm.close()

    def enter(self, now_ns: int) -> None:
        """A call entered at now_ns (CLOCK_MONOTONIC ns): one more in flight
        (HF_IN_FLIGHT); every enter is matched by one leave."""
        with self._lock:
            if self._in_flight == 0:
                self._put("in_flight_since_ns", now_ns)
            self._in_flight += 1
            self._put("in_flight", self._in_flight & 0xFFFFFFFF)

    def leave(self) -> None:
        """A call entered is recorded or counted lost: one fewer in flight."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._put("in_flight", self._in_flight)
            if self._in_flight == 0:
                self._put("in_flight_since_ns", 0)

    def append(
        self,
        op: int,
        *,
        comm_id: int = 0,
        count: int = 0,
        nbytes: int = 0,
        start_ns: int = 0,
        end_ns: int = 0,
        peer: int = -1,
        datatype: int = 0,
        redop: int = 0,
        flags: int = 0,
        status: int = 0,
        **ext: int,
    ) -> int:
        """Append one record; returns its number. Times are CLOCK_MONOTONIC
        ns (time.monotonic_ns()). ext: the fields after the first 64 bytes
        by name (gpu_start_ns, gpu_end_ns, coll_seq, xfer_*), 0 when left
        out; the torch hook writes none."""
        bad = set(ext) - _EXT_NAMES
        if bad:
            raise ValueError(f"not a record field: {', '.join(sorted(bad))}")
        with self._lock:
            n = self._n
            self._n = n + 1
            off = HEADER_SIZE + (n & self._mask) * RECORD_SIZE
            mm = self._mm
            _U64.pack_into(mm, _HDR["write_counter"][0], n + 1)  # reserve
            _U64.pack_into(mm, off, 0)  # being written
            _REC.pack_into(
                mm, off, 0, comm_id, count, nbytes, start_ns, end_ns, peer, op, datatype, redop, flags, status
            )
            if ext or self._ext:
                # once written, every later record writes them (a lapped slot
                # must not keep an older record's values)
                self._ext = True
                _REC_EXT.pack_into(
                    mm, off + _REC.size, *(ext.get(name, 0) for name, _, _ in RECORD_FIELDS[_N_HEAD:])
                )
            _U64.pack_into(mm, off, n + 1)  # committed
            if n >= self.capacity:
                _U64.pack_into(mm, _HDR["overwritten"][0], n + 1 - self.capacity + self._given_up)
        return n

    def count_lost(self, n: int = 1) -> None:
        """Count n records the writer could not write (work still in flight
        when the process ended, calls missed after an internal error) in
        the header's lost-record counter, beside those lost to overwrite."""
        with self._lock:
            self._given_up += n
            _U64.pack_into(self._mm, _HDR["overwritten"][0], max(0, self._n - self.capacity) + self._given_up)

    def hold_requested(self) -> bool:
        return bool(_U32.unpack_from(self._mm, _HDR["control"][0])[0] & CTL_HOLD)

    def hold_wait(self, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Wait while the controller holds this rank (Greyhound 4.3), up to
        hold_timeout_ms (0: HOLD_DEFAULT_TIMEOUT_MS). Records the hold;
        returns True if it ended by timeout."""
        t0 = time.monotonic_ns()
        tmo = _U32.unpack_from(self._mm, _HDR["hold_timeout_ms"][0])[0] or HOLD_DEFAULT_TIMEOUT_MS
        timed_out = False
        self._put("hold_since_ns", t0)
        while self.hold_requested():
            if time.monotonic_ns() - t0 >= tmo * 1_000_000:
                with self._lock:
                    ctl = _U32.unpack_from(self._mm, _HDR["control"][0])[0]
                    self._put("control", ctl & ~CTL_HOLD)
                    self._put("hold_timeouts", _U64.unpack_from(self._mm, _HDR["hold_timeouts"][0])[0] + 1)
                timed_out = True
                break
            sleep(0.001)
        self._put("hold_since_ns", 0)
        with self._lock:
            self._put("holds", _U64.unpack_from(self._mm, _HDR["holds"][0])[0] + 1)
        self.append(OP["hold"], start_ns=t0, end_ns=time.monotonic_ns(), flags=F_TIMEOUT if timed_out else 0)
        return timed_out


class RingControl:
    """The controller's handle on a ring's control word: hold a rank at its
    next collective, release it, see whether it is held.

    Opened once, like a reader (O_NONBLOCK|O_NOFOLLOW, read_header's checks),
    and used through pread/pwrite on that descriptor: the file cannot be
    swapped between the check and the use, and a file truncated later is a
    RingError, not a SIGBUS of the caller."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise RingError(self.path, f"cannot open: {exc.strerror}") from None
        try:
            read_header(self._fd, self.path)
        except OSError as exc:
            os.close(self._fd)
            raise RingError(self.path, f"cannot read: {exc.strerror}") from None
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _get(self, name: str) -> int:
        off, st = _HDR[name]
        data = os.pread(self._fd, st.size, off)
        if len(data) < st.size:
            raise RingError(self.path, "truncated while open")
        return st.unpack(data)[0]

    def _put(self, name: str, value: int) -> None:
        off, st = _HDR[name]
        os.pwrite(self._fd, st.pack(value), off)

    def hold(self, timeout_ms: int = 0) -> None:
        """Ask the rank to wait at its next collective for at most
        timeout_ms (0: the writer's default, HOLD_DEFAULT_TIMEOUT_MS)."""
        self._put("hold_timeout_ms", timeout_ms)
        self._put("control", self._get("control") | CTL_HOLD)

    def release(self) -> None:
        self._put("control", self._get("control") & ~CTL_HOLD)

    def state(self) -> dict:
        """control bits, hold_since_ns (0: not waiting), holds, hold_timeouts."""
        get = self._get
        return {
            "held": bool(get("control") & CTL_HOLD),
            "control": get("control"),
            "hold_timeout_ms": get("hold_timeout_ms"),
            "hold_since_ns": get("hold_since_ns"),
            "holds": get("holds"),
            "hold_timeouts": get("hold_timeouts"),
        }


@dataclass(frozen=True)
class RingProblem:
    """A file in a ring directory that could not be read (reported, skipped)."""

    path: str
    problem: str


def scan(directory: str) -> Iterator[RingHeader | RingProblem]:
    """Every ``*.ring`` file below `directory` (one level of job dirs or
    the job dir itself): a RingHeader for each readable ring, a
    RingProblem for each damaged one. Never raises for a bad file."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        yield RingProblem(directory, f"cannot list: {exc.strerror}")
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from scan(entry.path)
        elif entry.name.endswith(".ring"):
            try:
                with RingReader(entry.path) as r:
                    yield r.header
            except RingError as exc:
                yield RingProblem(exc.path, exc.problem)
