"""Find the rings of this node's guarded jobs and read what is new in them.

Layout (written by the SPANK plugin and the hooks):
``<ring_root>/<job_id>/rank-R.step-S.<source>.ring``, one file per rank and
source. The job directory is created by the plugin as root and handed to
the job's user; everything inside it is written by the job and untrusted.

Trust comes from Slurm and the kernel, not from what a job writes:

- a ring's job id is the name of its directory, never the header's;
- the job must be one Slurm says runs on this node, and the directory must
  be a real directory (no symlink) owned by that job's user;
- files are opened relative to that directory's descriptor, with
  O_NONBLOCK|O_NOFOLLOW, and must be complete rings (hook/ring.py checks
  type, geometry, size and allocation);
- the header must describe a rank (0 <= rank < world size) and carry this
  boot's clock offset.

Several nodes may share one ring root (the development cluster shares
/dev/shm), so a ring is taken only when its header names this node; a job
can only point at nodes of its own allocation that way.

Rings of jobs that no longer run on the node are ignored, not removed: the
epilog archives and removes the job directory (a job killed before its
epilog ran still gets it: Slurm runs the epilog on every node when a job
ends), and an agent deleting files as root in user-owned directories
would race the archive and be one more thing a user could steer.

A file is identified by (inode, created_ns): a requeued job that writes a
ring under the same name is a new ring. Every problem is counted per kind
(:attr:`RingTracker.errors`, sent in the agent's report) and logged once
per file.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from slurmguard.hook.ring import (
    F_GPU_TIME,
    F_IN_GROUP,
    F_XFER_SEND,
    NOT_COLLECTIVE,
    OP,
    RECORD_FIELDS,
    RING_NAME,
    RingError,
    RingHeader,
    RingReader,
)
from slurmguard.slurm.client import SlurmClient

log = logging.getLogger(__name__)

_GROUP_END = OP["group_end"]
_PEER_XFER = OP["peer_xfer"]
#: outermost NCCL groups remembered for their GPU spans (a member's group_end
#: is written when the group's GPU work has run, possibly polls later)
MAX_GROUPS = 4096
#: a ring that fails validation this young may still be being created (s)
YOUNG_S = 10.0
#: largest difference between a ring's clock offset and the agent's own (ns);
#: both are CLOCK_REALTIME - CLOCK_MONOTONIC of one boot, NTP slews them apart slowly
CLOCK_SLACK_NS = 3600 * 10**9
#: a record may end this far ahead of the agent's clock (ns; hooks stamp before writing)
FUTURE_SLACK_NS = 60 * 10**9
#: longest collective taken as real (ns)
MAX_OP_NS = 86400 * 10**9
#: how often Slurm is asked which jobs run on this node (s)
JOBS_REFRESH_S = 5.0
#: job states whose rings are read
RUNNING_STATES = frozenset({"RUNNING", "SUSPENDED"})

#: counted problem kinds (the keys of RingTracker.errors and of the report's ring_errors)
ERROR_KINDS = (
    "invalid",  # not a usable ring: FIFO, symlink, truncated, sparse, bad geometry/header
    "untrusted",  # job directory not a real directory owned by the job's user
    "unreadable",  # a ring that failed while being read (shrank, I/O error)
    "corrupt_records",  # committed records with impossible contents
    "dropped_samples",  # derived iteration samples that made no sense (negative, NaN, absurd)
    "analysis",  # a ring whose analysis raised (skipped, the others go on)
)


@dataclass
class LinkTime:
    """One link's transfers (profiler plugin peer_xfer records, summed): a
    slow link shows as network time per step (Mycroft, Table 4)."""

    steps: int = 0
    bytes: int = 0
    net_ns: int = 0
    peer_wait_ns: int = 0
    gpu_wait_ns: int = 0

    @property
    def net_per_step_s(self) -> float | None:
        return self.net_ns / self.steps / 1e9 if self.steps else None

    @property
    def gbps(self) -> float | None:
        """Bytes per second of network time (GB/s), None before any."""
        return self.bytes / self.net_ns if self.net_ns else None


@dataclass
class TrackedRing:
    """One rank's ring and the collectives read from it so far (bounded),
    kept in issue order (by start time: hooks write on completion, so a
    ring holds async collectives in completion order)."""

    key: tuple[int, int]
    job_id: int
    reader: RingReader
    header: RingHeader
    cursor: int | None = None
    lost: int = 0
    corrupt: int = 0
    op: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    comm: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    start_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    end_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    peer: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    flags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    begin_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """When each op's work started: on the GPU where the ring has it (the
    record's GPU start, or, for a call inside an NCCL group, its group's:
    NCCL launches a group's work at its end, which carries the GPU time),
    else the host call (RingRecord.begin_ns)."""
    finish_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """When each op's work finished, by the same rule (RingRecord.finish_ns)."""
    groups: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    """Outermost NCCL groups, by host call of their group_end: rows (host
    start, GPU start, GPU end, 1 if it has GPU time)."""
    links: dict[tuple[int, int, bool], LinkTime] = field(default_factory=dict)
    """(communicator, peer, sent) -> transfer time to that peer, from the
    profiler plugin's peer_xfer records."""
    comm_sizes: dict[int, int] = field(default_factory=dict)
    """communicator id -> its size (from the hooks' comm_init records)."""
    comm_ranks: dict[int, int] = field(default_factory=dict)
    """communicator id -> this rank's rank in it (comm_init records)."""
    in_flight_since_ns: int | None = None
    """CLOCK_MONOTONIC ns since which the writer has had a call in flight
    (None: none, or a writer that does not say, see in_flight_known)."""
    in_flight_known: bool = False
    """The writer says which calls are in flight (ring.HF_IN_FLIGHT, as of the last read)."""
    appended: int = 0
    """Ops read from the ring since it was first tracked, those no longer kept counted."""

    def to_unix_s(self, mono_ns: int | float) -> float:
        return (mono_ns + self.header.clock_offset_ns) / 1e9

    def ops_slice(self, lo: int, hi: int) -> TrackedRing:
        """A copy holding only ops lo:hi (issue order) of the per-op columns
        (views, not copies); header, links and the rest as this ring's."""
        return replace(self, **{name: getattr(self, name)[lo:hi] for name in _COLUMNS})

    @property
    def writer_exited(self) -> bool:
        """The process that wrote the ring no longer exists (same PID
        namespace as the agent: the job's ranks and slurmd's agent share the
        node's). A PID reused by another process reads as alive: never a
        false 'exited'."""
        pid = self.header.pid
        return pid > 0 and not os.path.exists(f"/proc/{pid}")

    io_bytes: int | None = None
    """The writer's bytes read and written through the kernel (/proc/PID/io
    rchar + wchar) at the agent's last look (look_at_io); None: not read."""
    io_look: float | None = None
    """Unix s of that look."""
    io_active_at: float | None = None
    """Unix s of the newest look at which the writer had read or written at
    least IO_ACTIVE_BYTES_S a second since the look before (None: never seen)."""

    def _writer_stat(self) -> list[bytes] | None:
        """The fields of the writer's /proc/PID/stat after its command name
        (field 3 on), or None: no such process, or one that started after the
        ring was created, so a PID reused since (or one of another PID
        namespace) is never taken for the rank. (Its start is on the boot-time
        clock, the ring's on CLOCK_MONOTONIC, which a suspended machine holds
        back: then the writer is missed, never another process taken for it.)"""
        pid = self.header.pid
        if pid <= 0:
            return None
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat_line = fh.read()
        except OSError:
            return None
        # the command name may hold spaces and ')': the fields follow the last ')'
        fields = stat_line[stat_line.rfind(b")") + 2 :].split()
        if len(fields) < 20:
            return None
        try:
            started_s = int(fields[19]) / _CLK_TCK  # field 22, starttime (clock ticks since boot)
        except ValueError:
            return None
        return fields if started_s <= self.header.created_ns / 1e9 else None

    @property
    def writer_stopped(self) -> bool:
        """The process that wrote the ring is stopped (state T or t: SIGSTOP, a
        tracer): it cannot progress (_writer_stat: only the writer itself)."""
        fields = self._writer_stat()
        return fields is not None and fields[0] in (b"T", b"t")

    def look_at_io(self, now: float) -> float | None:
        """Read the writer's I/O counters (/proc/PID/io: bytes through read
        and write calls, files and pipes alike) at Unix time `now`; returns
        io_active_at. A rank saving a checkpoint (rank 0 alone, while the
        others wait in a barrier) or loading one moves megabytes a second
        between its collectives; a rank hung outside them (a stuck kernel, a
        deadlock) moves none. Counters that cannot be read (another PID
        namespace, no permission, the process gone) leave the last answer."""
        if self._writer_stat() is None:
            return self.io_active_at
        try:
            with open(f"/proc/{self.header.pid}/io", "rb") as fh:
                text = fh.read()
        except OSError:
            return self.io_active_at
        total = 0
        for line in text.splitlines():
            name, _, value = line.partition(b":")
            if name in (b"rchar", b"wchar"):
                try:
                    total += int(value)
                except ValueError:
                    return self.io_active_at
        moved = total - (self.io_bytes if self.io_bytes is not None else total)
        if (
            self.io_look is not None
            and now > self.io_look
            and moved >= IO_ACTIVE_BYTES_S * (now - self.io_look)
        ):
            self.io_active_at = now
        self.io_bytes, self.io_look = total, now
        return self.io_active_at


class SlurmJobs:
    """Which jobs Slurm says run on `node`, with their users' uids.

    Asked at most every `refresh_s` seconds; when Slurm does not answer the
    last answer stands (None until the first one: nothing is trusted before).
    """

    def __init__(
        self,
        slurm: SlurmClient,
        node: str,
        *,
        refresh_s: float = JOBS_REFRESH_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slurm = slurm
        self.node = node
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._at: float | None = None
        self._jobs: dict[int, int | None] | None = None
        self._failed = False

    def __call__(self) -> dict[int, int | None] | None:
        """job id -> uid of its user (None: user unknown here)."""
        now = self._monotonic()
        if self._at is not None and now - self._at < self.refresh_s:
            return self._jobs
        self._at = now
        try:
            jobs = self.slurm.jobs()
        except Exception as exc:  # noqa: BLE001 - Slurm down is a state, not a crash
            if not self._failed:
                log.warning(
                    "cannot ask Slurm for the jobs on %s (keeping the last answer): %s", self.node, exc
                )
            self._failed = True
            return self._jobs
        self._failed = False
        self._jobs = {
            j.job_id: _uid(j.user) for j in jobs if j.state in RUNNING_STATES and self.node in j.nodes
        }
        return self._jobs


def _uid(user: str | None) -> int | None:
    if not user:
        return None
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def _own_clock_offset_ns() -> int:
    return time.time_ns() - time.monotonic_ns()


class RingTracker:
    """Polls ring_root for this node's rings; keeps at most max_ops per rank.

    jobs: returns {job id: uid of its user} for the jobs running on this
    node (see :class:`SlurmJobs`), or None when that is not known yet.
    """

    def __init__(
        self,
        ring_root: str,
        node: str,
        jobs: Callable[[], dict[int, int | None] | None],
        max_ops: int = 16384,
        *,
        young_s: float = YOUNG_S,
    ) -> None:
        self.root = os.fspath(ring_root)
        self.node = node
        self.jobs = jobs
        self.max_ops = max_ops
        self.young_s = young_s
        self.rings: dict[str, TrackedRing] = {}
        #: path -> ((inode, size), why): files not (re)opened until replaced (a
        #: freed inode number is reused at once, hence the size too)
        self.skipped: dict[str, tuple[tuple[int, int], str]] = {}
        self.errors: dict[str, int] = {k: 0 for k in ERROR_KINDS}
        self.ignored_jobs: set[int] = set()
        self._dirs_seen: set[str] = set()
        self._logged: set[tuple[str, str]] = set()

    # ------------------------------------------------------------ problems
    def problem(self, path: str, kind: str, why: str, count: int | None = None) -> None:
        """Count a problem and log it, once per file and kind (while the file
        stays); `count`: new bad records or samples, added every time."""
        first = (path, kind) not in self._logged
        if count is not None:
            self.errors[kind] = self.errors.get(kind, 0) + count
        elif first:
            self.errors[kind] = self.errors.get(kind, 0) + 1
        if first:
            self._logged.add((path, kind))
            log.warning("ring %s: %s (%s; logged once)", path, why, kind)

    # ------------------------------------------------------------ polling
    def poll(self) -> list[TrackedRing]:
        """Discover new rings, drop vanished ones, read new records; returns live rings.
        Never raises for what is in the ring root."""
        running = self.jobs()
        seen: set[str] = set()
        if running is not None:
            for job_id, dfd, names in self._job_dirs(running):
                try:
                    for name in names:
                        path = os.path.join(self.root, str(job_id), name)
                        seen.add(path)
                        self._visit(path, job_id, dfd, name)
                finally:
                    os.close(dfd)
        for path in list(self.rings):
            if path not in seen:
                self._drop(path)
        self.skipped = {p: v for p, v in self.skipped.items() if p in seen}
        self._logged = {pk for pk in self._logged if pk[0] in seen or pk[0] in self._dirs_seen}
        if len(self._logged) > 10000:  # bounded, whatever a ring root holds
            self._logged.clear()
        return list(self.rings.values())

    def _job_dirs(self, running: dict[int, int | None]) -> Iterator[tuple[int, int, list[str]]]:
        """(job id, directory fd, ring file names) of the running jobs' trusted directories."""
        try:
            rootfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            try:
                entries = [e.name for e in os.scandir(rootfd)]
            except OSError:
                return
            ignored = set()
            self._dirs_seen = set()
            for name in sorted(entries):
                if not name.isdigit() or len(name) > 10:
                    continue
                job_id = int(name)
                if job_id not in running:
                    ignored.add(job_id)  # ended, or another node's: left for the epilog
                    continue
                path = os.path.join(self.root, name)
                self._dirs_seen.add(path)
                try:
                    dfd = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rootfd
                    )
                except OSError as exc:
                    self.problem(path, "untrusted", f"not a usable job directory: {exc.strerror}")
                    continue
                try:
                    st = os.fstat(dfd)
                    uid = running[job_id]
                    if uid is None or st.st_uid != uid:
                        raise RingError(
                            path,
                            f"owned by uid {st.st_uid}, job {job_id} runs as "
                            f"{'an unknown user' if uid is None else f'uid {uid}'}",
                        )
                    names = [
                        e.name
                        for e in os.scandir(dfd)
                        if e.name.endswith(".ring") and RING_NAME.match(e.name)
                    ]
                except (OSError, RingError) as exc:
                    os.close(dfd)
                    why = exc.problem if isinstance(exc, RingError) else f"cannot list: {exc.strerror}"
                    self.problem(path, "untrusted", why)
                    continue
                yield job_id, dfd, sorted(names)
            self.ignored_jobs = ignored
        finally:
            os.close(rootfd)

    def _visit(self, path: str, job_id: int, dfd: int, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            self._drop(path)
            return
        tr = self.rings.get(path)
        if tr is not None and tr.key[0] != st.st_ino:
            self._drop(path)
            tr = None
        if tr is None:
            skip = self.skipped.get(path)
            if skip is not None and skip[0] == (st.st_ino, st.st_size):
                return
            tr = self._open(path, job_id, dfd, st)
            if tr is None:
                return
        self._read(path, tr)

    def _open(self, path: str, job_id: int, dfd: int, st: os.stat_result) -> TrackedRing | None:
        try:
            reader = RingReader(path, dir_fd=dfd)
        except RingError as exc:
            # a ring being created has no magic yet: retry for a few seconds;
            # after that (or for what no writer ever creates) it is skipped
            creating = stat.S_ISREG(st.st_mode) and "magic" in exc.problem
            if creating and time.time() - st.st_mtime < self.young_s:
                return None
            self.skipped[path] = ((st.st_ino, st.st_size), exc.problem)
            self.problem(path, "invalid", exc.problem)
            return None
        h = reader.header
        why = None
        if h.node_name and h.node_name != self.node:
            reader.close()
            self.skipped[path] = ((st.st_ino, st.st_size), f"ring of node {h.node_name}")  # not an error
            return None
        if h.global_rank < 0 or h.world_size < 0 or (h.world_size and h.global_rank >= h.world_size):
            why = f"rank {h.global_rank} of world size {h.world_size} is not a rank"
        elif abs(h.clock_offset_ns - _own_clock_offset_ns()) > CLOCK_SLACK_NS:
            why = "clock offset is not this boot's (stale or forged header)"
        if why is not None:
            reader.close()
            self.skipped[path] = ((st.st_ino, st.st_size), why)
            self.problem(path, "invalid", why)
            return None
        tr = TrackedRing((st.st_ino, h.created_ns), job_id, reader, h)
        self.rings[path] = tr
        return tr

    def inspect(self, path: str) -> TrackedRing:
        """Open and read one ring file as it is, for an admin's inspection
        (`slurmguard iterations`): no job, owner, node or boot check, as the
        file is named on purpose (an epilog archive, a copy). Raises RingError
        for what is not a ring. Times beyond this boot's clock still count as
        impossible: a ring from an earlier boot reads as corrupt records."""
        reader = RingReader(path)
        h = reader.header
        tr = TrackedRing((os.fstat(reader.fileno()).st_ino, h.created_ns), h.job_id, reader, h)
        self.rings[path] = tr
        self._read(path, tr)
        return tr

    def _drop(self, path: str) -> None:
        tr = self.rings.pop(path, None)
        if tr is not None:
            tr.reader.close()

    def _read(self, path: str, tr: TrackedRing) -> None:
        try:
            batch = tr.reader.read_array(tr.cursor)
        except (OSError, ValueError, RingError) as exc:
            self.problem(path, "unreadable", str(exc))
            try:
                size = os.fstat(tr.reader.fileno()).st_size
            except (OSError, ValueError):
                size = -1
            self.skipped[path] = ((tr.key[0], size), str(exc))
            self._drop(path)
            return
        tr.cursor = batch.cursor
        tr.lost += batch.lost
        # records are written on completion: whether a call is in flight is
        # the writer's header count (hooks that keep it, HF_IN_FLIGHT)
        tr.in_flight_known, tr.in_flight_since_ns = tr.reader.in_flight()
        if batch.corrupt:
            tr.corrupt += batch.corrupt
            self.problem(path, "corrupt_records", f"{batch.corrupt} corrupt record(s) skipped", batch.corrupt)
        # the batch as arrays, never an object per record: at 200 collectives
        # per second per rank, per-record Python was most of the agent's CPU
        # (issue 17.5). Unsigned fields stay uint64 and are compared as such;
        # their int64 view is _fold.
        rec = batch.records
        ops = rec["op"]
        for r in rec[(ops == _COMM_INIT) & (rec["comm_id"] != 0)].tolist():
            # comm_init: count = communicator size, peer = rank in it (the last one stands)
            tr.comm_sizes[_fold(r[_I_COMM])] = int(r[_I_COUNT])
            tr.comm_ranks[_fold(r[_I_COMM])] = int(r[_I_PEER])
        for r in rec[ops == _PEER_XFER].tolist():
            lt = tr.links.setdefault(
                (_fold(r[_I_COMM]), int(r[_I_PEER]), bool(r[_I_FLAGS] & F_XFER_SEND)), LinkTime()
            )
            lt.steps += r[_I_COUNT]
            lt.bytes += r[_I_BYTES]
            lt.net_ns += r[_I_NET]
            lt.peer_wait_ns += r[_I_PEER_WAIT]
            lt.gpu_wait_ns += r[_I_GPU_WAIT]
        ge = rec[(ops == _GROUP_END) & ((rec["flags"] & F_IN_GROUP) == 0)]
        if ge.size:
            timed = ((ge["flags"] & F_GPU_TIME) != 0) & (ge["gpu_end_ns"] >= ge["gpu_start_ns"])
            fresh = np.stack(
                [
                    ge["start_ns"].view(np.int64),
                    ge["gpu_start_ns"].view(np.int64),
                    ge["gpu_end_ns"].view(np.int64),
                    timed.astype(np.int64),
                ],
                axis=1,
            )
            g = np.concatenate([tr.groups, fresh])
            tr.groups = g[np.argsort(g[:, 0], kind="stable")][-MAX_GROUPS:]
        coll = _IS_COLLECTIVE[ops]
        recs = rec if coll.all() else rec[coll]  # (indexing copies every record)
        done, nbad = False, 0
        if recs.size:
            start, end, flags = recs["start_ns"], recs["end_ns"], recs["flags"]
            gstart, gend = recs["gpu_start_ns"], recs["gpu_end_ns"]
            gpu = (flags & F_GPU_TIME) != 0
            # times the writer cannot have taken: beyond the agent's own clock, or
            # a collective lasting more than a day (monotonic ns of this boot),
            # on the host or the GPU (records with end < start never get here)
            limit = np.uint64(time.monotonic_ns() + FUTURE_SLACK_NS)
            longest = np.uint64(MAX_OP_NS)
            with np.errstate(over="ignore"):
                bad = (
                    (end > limit)
                    | (end - start > longest)
                    | (gpu & ((gend > limit) | (gend < gstart) | (gend - gstart > longest)))
                )
            nbad = int(np.count_nonzero(bad))
            if nbad:
                tr.corrupt += nbad
                self.problem(
                    tr.reader.path, "corrupt_records", f"{nbad} record(s) with impossible times skipped", nbad
                )
            keep = ~bad
            done = bool(keep.any())
        if done:
            k = recs[keep] if nbad else recs
            g = (k["flags"] & F_GPU_TIME) != 0
            start, end = k["start_ns"].view(np.int64), k["end_ns"].view(np.int64)  # _fold
            new = (
                k["op"].astype(np.int64),
                k["comm_id"].view(np.int64),
                k["bytes"].view(np.int64),
                start,
                end,
                k["peer"].astype(np.int64),
                k["flags"].astype(np.int64),
                np.where(g, k["gpu_start_ns"].view(np.int64), start),  # begin
                np.where(g, k["gpu_end_ns"].view(np.int64), end),  # finish
            )
            _append_columns(tr, new, self.max_ops)
        if (done or ge.size) and tr.groups.size:
            _group_spans(tr)

    def close(self) -> None:
        for path in list(self.rings):
            self._drop(path)


#: clock ticks a second of /proc/PID/stat's times
_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: bytes a second through a rank's read and write calls (TrackedRing.look_at_io)
#: that make it busy with I/O: a checkpoint save moves hundreds of MB/s (torch.save
#: to the page cache here: 800 MB/s), a training loop's log lines kilobytes. A gloo
#: rank's collectives move hundreds of MB/s through its sockets' read and write
#: calls too (367 MB/s, a DDP rank here), but a rank inside a collective is in
#: flight, and the I/O of ranks in flight is not asked (controller.assess._stalled_for)
IO_ACTIVE_BYTES_S = 1 << 20
_COMM_INIT = OP["comm_init"]
#: by op code (a record's op is a uint16): whether it is a collective; a
#: lookup, where np.isin sorted the batch's ops every poll
_IS_COLLECTIVE = np.ones(1 << 16, bool)
_IS_COLLECTIVE[sorted(NOT_COLLECTIVE)] = False
#: TrackedRing's per-op columns, in the order _read builds them
_COLUMNS = ("op", "comm", "nbytes", "start_ns", "end_ns", "peer", "flags", "begin_ns", "finish_ns")
# positions of fields in a record's tuple (record_dtype order, as RingRecord)
_I_COMM, _I_COUNT, _I_BYTES, _I_PEER, _I_FLAGS, _I_NET, _I_PEER_WAIT, _I_GPU_WAIT = (
    [name for name, _, _ in RECORD_FIELDS].index(f)
    for f in (
        "comm_id",
        "count",
        "bytes",
        "peer",
        "flags",
        "xfer_net_ns",
        "xfer_peer_wait_ns",
        "xfer_gpu_wait_ns",
    )
)


def _append_columns(tr: TrackedRing, new: tuple[np.ndarray, ...], max_ops: int) -> None:
    """Add a batch's ops (columns in _COLUMNS order) to the ring's, keeping
    the newest max_ops in issue order (by start time, stable)."""
    old = [getattr(tr, name) for name in _COLUMNS]
    start, before = new[3], old[3]
    tr.appended += int(start.size)
    if (before.size == 0 or start[0] >= before[-1]) and bool(np.all(start[1:] >= start[:-1])):
        # already in issue order (a rank whose calls complete in the order they
        # start): the stable sort would leave it as it is; skipped, the ops
        # falling out of the window are never copied
        drop = max(0, before.size + start.size - max_ops)
        cols = [np.concatenate([o[drop:], a])[-max_ops:] for o, a in zip(old, new)]
    else:
        # a ring holds completion order, and a record completed late may start
        # before records read in an earlier poll
        joined = [np.concatenate([o, a]) for o, a in zip(old, new)]
        order = np.argsort(joined[3], kind="stable")[-max_ops:]
        cols = [c[order] for c in joined]
    for name, col in zip(_COLUMNS, cols):
        setattr(tr, name, col)


def _group_spans(tr: TrackedRing) -> None:
    """Calls inside an outermost NCCL group run as the group's work (NCCL
    launches it at ncclGroupEnd), whose GPU time the hook records on the
    group_end: give it to the group's calls that have none of their own.
    A call belongs to the first outermost group_end called after it."""
    member = ((tr.flags & F_IN_GROUP) != 0) & ((tr.flags & F_GPU_TIME) == 0)
    if not member.any():
        return
    idx = np.flatnonzero(member)
    g = np.searchsorted(tr.groups[:, 0], tr.start_ns[idx], side="left")
    ok = g < tr.groups.shape[0]
    idx, g = idx[ok], g[ok]
    ok = tr.groups[g, 3] == 1  # a group without GPU time: its calls keep host times
    idx, g = idx[ok], g[ok]
    tr.begin_ns[idx] = tr.groups[g, 1]
    tr.finish_ns[idx] = tr.groups[g, 2]


def _fold(v: int) -> int:
    """Unsigned 64-bit -> int64 (ids: only equality matters; times past 2^63 are nonsense anyway)."""
    return v - (1 << 64) if v >= 1 << 63 else v
