"""Python reader and writer of slurmguard's per-rank ring files.

The format is defined once, in ``spank_plugin/sg_ring.h``; this module mirrors
it field by field (``tests/test_hook_ring_format.py`` checks both against the
C compiler's view of the header). Read that header first: header page,
fixed 64-byte records, commit protocol, control word.

This module uses the standard library only, because the torch hook loads it
inside users' jobs, whatever Python environment they run.

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
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

MAGIC = 0x3130474E49524753  # b"SGRING01" read as little-endian u64
VERSION = 1
HEADER_SIZE = 4096
RECORD_SIZE = 64
MIN_CAPACITY = 16
MAX_CAPACITY = 1 << 24
DEFAULT_CAPACITY = 65536
NODE_NAME_LEN = 64

SOURCE_NCCL = 1
SOURCE_TORCH = 2
SOURCE_TEST = 3
SOURCE_NAMES = {SOURCE_NCCL: "nccl", SOURCE_TORCH: "torch", SOURCE_TEST: "test"}

CTL_HOLD = 0x1
HOLD_DEFAULT_TIMEOUT_MS = 60000

STEP_INTERACTIVE = 0xFFFFFFFA
STEP_BATCH = 0xFFFFFFFB
STEP_EXTERN = 0xFFFFFFFC
STEP_PENDING = 0xFFFFFFFD

# enum sg_op, by value
OP_NAMES: tuple[str, ...] = (
    "none", "allreduce", "allgather", "reducescatter", "broadcast", "reduce",
    "alltoall", "send", "recv", "group_start", "group_end", "comm_init",
    "comm_destroy", "comm_abort", "barrier", "gather", "scatter", "hold", "comm_split",
)
OP = {name: value for value, name in enumerate(OP_NAMES)}

# enum sg_datatype, by value, and element sizes in bytes
DATATYPE_NAMES: tuple[str, ...] = (
    "unknown", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
    "float32", "float64", "bfloat16", "float8_e4m3", "float8_e5m2", "bool", "int16",
    "uint16", "complex64", "complex128",
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
FLAG_NAMES = {
    F_IN_GROUP: "in_group", F_ASYNC: "async", F_COMM_UNKNOWN: "comm_unknown",
    F_ERROR: "error", F_COALESCED: "coalesced", F_TIMEOUT: "timeout",
}

# struct sg_ring_header: (field, offset, struct code); node_name is char[64]
HEADER_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("magic", 0, "Q"), ("version", 8, "I"), ("header_size", 12, "I"),
    ("record_size", 16, "I"), ("capacity", 20, "I"), ("job_id", 24, "I"),
    ("step_id", 28, "I"), ("global_rank", 32, "i"), ("local_rank", 36, "i"),
    ("world_size", 40, "i"), ("pid", 44, "I"), ("clock_offset_ns", 48, "q"),
    ("created_ns", 56, "Q"), ("source", 64, "I"), ("header_flags", 68, "I"),
    ("node_name", 72, f"{NODE_NAME_LEN}s"),
    ("write_counter", 192, "Q"), ("overwritten", 200, "Q"),
    ("control", 256, "I"), ("hold_timeout_ms", 260, "I"), ("hold_since_ns", 264, "Q"),
    ("holds", 272, "Q"), ("hold_timeouts", 280, "Q"),
)
_HDR = {name: (off, struct.Struct("<" + code)) for name, off, code in HEADER_FIELDS}

# struct sg_record, in order; offsets follow from the packing below
RECORD_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("seq", 0, "Q"), ("comm_id", 8, "Q"), ("count", 16, "Q"), ("bytes", 24, "Q"),
    ("start_ns", 32, "Q"), ("end_ns", 40, "Q"), ("peer", 48, "i"), ("op", 52, "H"),
    ("datatype", 54, "B"), ("redop", 55, "B"), ("flags", 56, "I"), ("status", 60, "i"),
)
_REC = struct.Struct("<" + "".join(code for _, _, code in RECORD_FIELDS))
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
assert _REC.size == RECORD_SIZE

#: how ring files are named: rank-<global>.step-<step>.<source>[.pid-<pid>].ring
RING_NAME = re.compile(
    r"^rank-(?P<rank>-?\d+)\.step-(?P<step>[a-z0-9]+)\.(?P<source>[a-z]+)(?:\.pid-(?P<pid>\d+))?\.ring$")


class RingError(Exception):
    """A ring file that cannot be used: missing, truncated, corrupt."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def step_name(step_id: int) -> str:
    """Slurm's name for a step id: a number, or batch/extern/interactive."""
    return {STEP_BATCH: "batch", STEP_EXTERN: "extern",
            STEP_INTERACTIVE: "interactive"}.get(step_id, str(step_id))


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
        return d


@dataclass(frozen=True)
class RingRecord:
    """One intercepted call (struct sg_record). start_ns/end_ns are
    CLOCK_MONOTONIC ns; count is elements, bytes = count * element size."""

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

    @property
    def op_name(self) -> str:
        return OP_NAMES[self.op] if 0 <= self.op < len(OP_NAMES) else str(self.op)

    @property
    def number(self) -> int:
        """Position in the ring's history (seq - 1)."""
        return self.seq - 1

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

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
            "datatype": DATATYPE_NAMES[self.datatype] if self.datatype < len(DATATYPE_NAMES)
            else self.datatype,
            "redop": REDOP_NAMES[self.redop] if self.redop < len(REDOP_NAMES) else self.redop,
            "flags": [name for bit, name in FLAG_NAMES.items() if self.flags & bit],
            "status": self.status,
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


_NOT_YET, _OK, _LOST = 0, 1, 2


def _plausible(r: RingRecord) -> bool:
    return (0 < r.op < len(OP_NAMES) and r.datatype < len(DATATYPE_NAMES)
            and r.redop < len(REDOP_NAMES) and r.end_ns >= r.start_ns)


def _header_from(buf, path: str) -> RingHeader:
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


class RingReader:
    """Read one ring while its writer runs.

    Use ``read()`` repeatedly with the returned cursor; each call returns
    the records committed since. `stall_s` (seconds, default 5): a reserved
    record that stays uncommitted that long is given up as abandoned;
    `clock` returns seconds (default time.monotonic). write_counter counts
    reserved numbers and may run ahead of the newest committed record.
    """

    def __init__(self, path: str, *, stall_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.fspath(path)
        self._stall_s = stall_s
        self._clock = clock
        self._stuck: tuple[int, float] | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise RingError(self.path, f"cannot open: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise RingError(self.path, f"truncated: {size} bytes, the header alone is {HEADER_SIZE}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            self.header = _header_from(self._mm, self.path)
            _validate(self.header, size)
        except RingError:
            self._mm.close()
            raise
        self.capacity = self.header.capacity
        self._mask = self.capacity - 1

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> RingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh_header(self) -> RingHeader:
        """The header with current counters and control state."""
        self.header = _header_from(self._mm, self.path)
        return self.header

    @property
    def write_counter(self) -> int:
        return _U64.unpack_from(self._mm, _HDR["write_counter"][0])[0]

    def _read_one(self, n: int) -> tuple[int, RingRecord | None]:
        off = HEADER_SIZE + (n & self._mask) * RECORD_SIZE
        mm = self._mm
        for _ in range(3):
            s1 = _U64.unpack_from(mm, off)[0]
            if s1 < n + 1:
                return _NOT_YET, None
            if s1 > n + 1:
                return _LOST, None
            raw = mm[off:off + RECORD_SIZE]
            s2 = _U64.unpack_from(mm, off)[0]
            if s2 == s1:
                rec = RingRecord(*_REC.unpack(raw))
                if rec.seq == s1:
                    return _OK, rec
        return _LOST, None  # rewritten under us three times: treat as overwritten

    def read(self, cursor: int | None = None, max_records: int | None = None) -> ReadBatch:
        """Records from `cursor` (default: the oldest still in the ring) up
        to what is committed now, at most `max_records`."""
        wc = self.write_counter
        out = ReadBatch()
        if cursor is None:
            cursor = max(0, wc - self.capacity)
        if wc - cursor > self.capacity:
            out.lost += wc - self.capacity - cursor
            cursor = wc - self.capacity
        while cursor < wc and (max_records is None or len(out.records) < max_records):
            state, rec = self._read_one(cursor)
            if state == _NOT_YET:
                if self._give_up(cursor, wc):
                    out.abandoned += 1
                    cursor += 1
                    continue
                break
            if state == _LOST:
                out.lost += 1
            elif rec is not None and rec.op == 0:
                pass  # padding a writer left when it stopped reserving blocks
            elif rec is not None and _plausible(rec):
                out.records.append(rec)
            else:
                out.corrupt += 1
            cursor += 1
        out.cursor = cursor
        return out

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
            if _U64.unpack_from(self._mm, off)[0] >= n + 1:
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

    def __init__(self, path: str, *, capacity: int = DEFAULT_CAPACITY, job_id: int = 0,
                 step_id: int = STEP_PENDING, global_rank: int = -1, local_rank: int = -1,
                 world_size: int = 0, source: int = SOURCE_TORCH, node_name: str = "") -> None:
        self.path = os.fspath(path)
        cap = MIN_CAPACITY
        while cap < capacity and cap < MAX_CAPACITY:
            cap <<= 1
        self.capacity = cap
        self._mask = cap - 1
        size = HEADER_SIZE + cap * RECORD_SIZE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
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
        put("node_name", node_name.encode()[:NODE_NAME_LEN - 1])
        put("magic", MAGIC)  # last: a reader that sees it sees the rest

    def _put(self, name: str, value) -> None:
        off, st = _HDR[name]
        st.pack_into(self._mm, off, value)

    def close(self) -> None:
        self._mm.close()

    def append(self, op: int, *, comm_id: int = 0, count: int = 0, nbytes: int = 0,
               start_ns: int = 0, end_ns: int = 0, peer: int = -1, datatype: int = 0,
               redop: int = 0, flags: int = 0, status: int = 0) -> int:
        """Append one record; returns its number. Times are CLOCK_MONOTONIC
        ns (time.monotonic_ns())."""
        with self._lock:
            n = self._n
            self._n = n + 1
            off = HEADER_SIZE + (n & self._mask) * RECORD_SIZE
            mm = self._mm
            _U64.pack_into(mm, _HDR["write_counter"][0], n + 1)  # reserve
            _U64.pack_into(mm, off, 0)  # being written
            _REC.pack_into(mm, off, 0, comm_id, count, nbytes, start_ns, end_ns, peer, op,
                           datatype, redop, flags, status)
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
            _U64.pack_into(self._mm, _HDR["overwritten"][0],
                           max(0, self._n - self.capacity) + self._given_up)

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
                    self._put("hold_timeouts",
                              _U64.unpack_from(self._mm, _HDR["hold_timeouts"][0])[0] + 1)
                timed_out = True
                break
            sleep(0.001)
        self._put("hold_since_ns", 0)
        with self._lock:
            self._put("holds", _U64.unpack_from(self._mm, _HDR["holds"][0])[0] + 1)
        self.append(OP["hold"], start_ns=t0, end_ns=time.monotonic_ns(),
                    flags=F_TIMEOUT if timed_out else 0)
        return timed_out


class RingControl:
    """The controller's handle on a ring's control word: hold a rank at its
    next collective, release it, see whether it is held."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        # validate like a reader first, so a bad file is a RingError here
        RingReader(self.path).close()
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            self._mm = mmap.mmap(fd, HEADER_SIZE, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._mm.close()

    def hold(self, timeout_ms: int = 0) -> None:
        """Ask the rank to wait at its next collective for at most
        timeout_ms (0: the writer's default, HOLD_DEFAULT_TIMEOUT_MS)."""
        _U32.pack_into(self._mm, _HDR["hold_timeout_ms"][0], timeout_ms)
        ctl = _U32.unpack_from(self._mm, _HDR["control"][0])[0]
        _U32.pack_into(self._mm, _HDR["control"][0], ctl | CTL_HOLD)

    def release(self) -> None:
        ctl = _U32.unpack_from(self._mm, _HDR["control"][0])[0]
        _U32.pack_into(self._mm, _HDR["control"][0], ctl & ~CTL_HOLD)

    def state(self) -> dict:
        """control bits, hold_since_ns (0: not waiting), holds, hold_timeouts."""
        def get(name: str) -> int:
            off, st = _HDR[name]
            return st.unpack_from(self._mm, off)[0]

        return {"held": bool(get("control") & CTL_HOLD), "control": get("control"),
                "hold_timeout_ms": get("hold_timeout_ms"), "hold_since_ns": get("hold_since_ns"),
                "holds": get("holds"), "hold_timeouts": get("hold_timeouts")}


@dataclass(frozen=True)
class RingProblem:
    """A file in a ring directory that could not be read (reported, skipped)."""

    path: str
    problem: str


def scan(directory: str) -> Iterator[object]:
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
