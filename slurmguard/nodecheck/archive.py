"""Move a job's rings from the ring root into the job trace store.

Layout:
    <ring_root>/<job_id>/rank-*.ring             (written by the job's ranks)
    <trace_store>/<job_id>/<node>/rank-*.ring    (this module, one dir per node)
    <trace_store>/<job_id>/<node>/manifest.json
A requeued job (same id, SLURM_JOB_RESTART_COUNT n > 0) goes to
`<node>.restart-<n>`; a name already taken gets `.2`, `.3`, ...

Each node's archive is built in a hidden staging directory and renamed into
place, so a reader never sees half an archive.

On a real cluster each node has its own ring root (/dev/shm), so every ring in
the job's directory is this node's, whatever node name its header claims (the
header is written by the job), and the directory is removed in every case.
Only where several nodes share one ring root (`prolog.ring_root_shared`: the
development cluster, where every slurmd shares this host's /dev/shm and a
multi-node job runs one epilog per node on one directory) does an epilog leave
the rings naming another node of the job for that node's epilog: it takes an
flock on the directory (waiting at most `epilog_lock_timeout_s`, then going on
without it, so a job holding the lock cannot stall the epilog), and the epilog
that finds no rings of other job nodes left removes the directory.

The ring directory belongs to the job's user and the epilog runs as root, so
nothing in it is trusted: the ring root must be root-owned and not writable by
others, at most `max_ring_entries` entries are looked at (the rest are removed
unread, and only counted in the manifest), entries are opened without
following symlinks and without blocking (a FIFO), and only regular files whose
header passes slurmguard.hook.ring.read_header (exact geometry, fully
allocated) are copied, through the descriptor that was checked, at most
`max_archive_mb` per node and never below `min_free_mb` free in the trace
store. Rings that are not archived are still removed: tmpfs pages are RAM,
traces are diagnostics.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from slurmguard.clock import Clock, SystemClock
from slurmguard.config import PrologPolicy
from slurmguard.errors import SlurmguardError
from slurmguard.hook.ring import RingError, read_header

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
PRUNE_STAMP = ".last-prune"
PRUNE_INTERVAL_S = 3600.0
DIR_MODE = 0o750
FILE_MODE = 0o640
_COPY_CHUNK = 1 << 24
MANIFEST_MAX_SKIPPED = 100
"""Skipped entries listed by name in a manifest; the rest are only counted."""


@dataclass(frozen=True)
class ArchivedFile:
    """One ring copied into the archive (bytes: file size)."""

    name: str
    bytes: int
    job_id: int
    step_id: int
    global_rank: int
    local_rank: int
    world_size: int
    source: str
    node: str


@dataclass(frozen=True)
class SkippedFile:
    name: str
    reason: str
    bytes: int | None = None


@dataclass
class ArchiveResult:
    """What one epilog did for one job on one node."""

    job_id: int
    node: str
    restart_count: int = 0
    ring_dir: str = ""
    archive_dir: str | None = None
    files: list[ArchivedFile] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    left_for: dict[str, int] = field(default_factory=dict)
    """Rings left in place for the job's other nodes: node -> count."""
    errors: list[str] = field(default_factory=list)
    unread: int = 0
    """Entries beyond prolog.max_ring_entries, and subdirectories: removed (in the
    background, with the whole ring dir) without being looked at."""
    ring_dir_removed: bool = False
    cleanup_failed: bool = False
    """A ring of this node could not be removed from the ring root (tmpfs leak)."""

    @property
    def archived_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


class ArchiveError(SlurmguardError):
    """The ring root cannot be archived safely; the message names the directory."""


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _open_ring_root(ring_root: Path) -> int | None:
    """fd of the ring root, or None if absent; ArchiveError if others could write it."""
    try:
        fd = os.open(ring_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArchiveError(f"cannot open ring root {ring_root}: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ArchiveError(
            f"ring root {ring_root} must be owned by uid {os.geteuid()} and writable only by it "
            f"(found uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):04o}); not touching it"
        )
    return fd


def _lock(fd: int, timeout_s: float, clock: Clock) -> bool:
    deadline = clock.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if clock.monotonic() >= deadline:
                return False
            clock.sleep(0.05)


def _copy(src_fd: int, dst_fd: int, size: int) -> None:
    """Copy exactly `size` bytes from offset 0 (the size the ring header implies)."""
    off = 0
    while off < size:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(_COPY_CHUNK, size - off), off, off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.pwrite(dst_fd, os.pread(src_fd, min(_COPY_CHUNK, size - off), off), off)
        if n <= 0:
            raise OSError(errno.EIO, f"ring shrank while copying ({off} of {size} bytes)")
        off += n


class _Staging:
    """The hidden directory this epilog fills before renaming it into place."""

    def __init__(self, job_dir: Path, node: str) -> None:
        self.job_dir = job_dir
        self.path = job_dir / f".staging-{node}-{os.getpid()}"
        self.ready = False

    def ensure(self) -> Path:
        if not self.ready:
            os.makedirs(self.job_dir, mode=DIR_MODE, exist_ok=True)
            if self.path.exists():
                shutil.rmtree(self.path)  # leftover of a killed epilog with our pid
            os.mkdir(self.path, DIR_MODE)
            self.ready = True
        return self.path

    def publish(self, base: str) -> Path:
        for k in range(1, 1000):
            final = self.job_dir / (base if k == 1 else f"{base}.{k}")
            if final.exists():
                continue
            try:
                os.rename(self.path, final)
                return final
            except OSError as exc:  # another writer took the name between the checks
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        raise OSError(errno.EEXIST, f"no free archive name for {base} in {self.job_dir}")

    def discard(self) -> None:
        if self.ready:
            shutil.rmtree(self.path, ignore_errors=True)


def archive_job(
    job_id: int,
    node: str,
    *,
    ring_root: str | Path,
    policy: PrologPolicy,
    job_nodes: list[str] | None = None,
    restart_count: int = 0,
    clock: Clock | None = None,
) -> ArchiveResult:
    """Archive this node's rings of `job_id` and clean the ring directory.

    job_nodes: the job's nodes ($SLURM_NODELIST expanded); with a shared ring
    root (prolog.ring_root_shared), rings of these other nodes are left for
    their own epilogs (None = every other node named in a header counts as a
    job node); otherwise every ring is this node's. Never raises for archive
    problems: they are listed in `errors`.
    """
    clock = clock or SystemClock()
    ring_root = Path(ring_root)
    res = ArchiveResult(job_id, node, restart_count, str(ring_root / str(job_id)))
    try:
        rootfd = _open_ring_root(ring_root)
    except ArchiveError as exc:
        res.errors.append(str(exc))
        return res
    if rootfd is None:
        return res
    try:
        _archive_dir(res, rootfd, policy, job_nodes if policy.ring_root_shared else [res.node], clock)
    finally:
        os.close(rootfd)
    return res


def _archive_dir(
    res: ArchiveResult, rootfd: int, policy: PrologPolicy, job_nodes: list[str] | None, clock: Clock
) -> None:
    name = str(res.job_id)
    try:
        dirfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rootfd)
    except FileNotFoundError:
        return  # not a guarded job here, or another epilog already cleaned up
    except OSError as exc:
        res.errors.append(f"cannot open ring dir {res.ring_dir}: {exc.strerror}")
        return
    try:
        if policy.ring_root_shared:
            if not _lock(dirfd, policy.epilog_lock_timeout_s, clock):
                res.errors.append(
                    f"ring dir {res.ring_dir} stayed locked for "
                    f"{policy.epilog_lock_timeout_s:g} s; went on without the lock"
                )
            st = os.fstat(dirfd)
            try:
                now_st = os.stat(name, dir_fd=rootfd, follow_symlinks=False)
            except FileNotFoundError:
                now_st = None
            if st.st_nlink == 0 or now_st is None or now_st.st_ino != st.st_ino:
                return  # removed by the epilog of another node while we waited
        staging = _Staging(Path(policy.trace_store) / name, res.node)
        try:
            _take_rings(res, dirfd, staging, policy, job_nodes)
            if res.files or res.skipped or res.unread:
                _publish(res, staging, clock)
        except OSError as exc:
            res.errors.append(f"archive {staging.job_dir}: {exc}")
        finally:
            staging.discard()
        if not res.left_for or res.unread:
            try:
                if res.unread:
                    _remove_later(rootfd, name, res)
                else:
                    shutil.rmtree(name, dir_fd=rootfd)
                res.ring_dir_removed = True
            except FileNotFoundError:
                res.ring_dir_removed = True  # another epilog (lock timed out) removed it
            except OSError as exc:
                res.errors.append(f"cannot remove ring dir {res.ring_dir}: {exc}")
                res.cleanup_failed = True
    finally:
        os.close(dirfd)


def _remove_later(rootfd: int, name: str, res: ArchiveResult) -> None:
    """Take a directory flooded with entries out of the way at once and delete it in a
    detached process: removing millions of files takes longer than Slurm's
    PrologEpilogTimeout, and a late epilog drains the node. The rename is atomic, the
    new name (.trash-...) is no job id, and the ring root is root's."""
    trash = f".trash-{name}-{os.getpid()}"
    os.rename(name, trash, src_dir_fd=rootfd, dst_dir_fd=rootfd)
    res.errors.append(f"ring dir {res.ring_dir} moved to {trash} and removed in the background")
    pid = os.fork()
    if pid == 0:  # child: detach, so slurmd waits for neither it nor its output
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.nice(10)
                shutil.rmtree(trash, dir_fd=rootfd, ignore_errors=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _entries(res: ArchiveResult, dirfd: int, cap: int) -> list[str]:
    """At most `cap` names of the directory (sorted); res.unread counts the rest."""
    names: list[str] = []
    with os.scandir(dirfd) as it:
        for e in it:
            if len(names) < cap:
                names.append(e.name)
            else:
                res.unread += 1
    return sorted(names)


def _take_rings(
    res: ArchiveResult, dirfd: int, staging: _Staging, policy: PrologPolicy, job_nodes: list[str] | None
) -> None:
    cap = policy.max_archive_mb * 1024 * 1024
    min_free = policy.min_free_mb * 1024 * 1024
    store_broken: str | None = None
    names = _entries(res, dirfd, policy.max_ring_entries)
    if res.unread:
        res.errors.append(
            f"ring dir {res.ring_dir} holds more than prolog.max_ring_entries="
            f"{policy.max_ring_entries} entries; {res.unread} removed unread"
        )
    for entry in names:
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError as exc:
            # symlinks (ELOOP), vanished files: not rings
            reason = "symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
            res.skipped.append(SkippedFile(entry, reason))
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                # its contents are not looked at: the whole ring dir goes in the background
                res.unread += 1
                res.skipped.append(SkippedFile(entry, "a directory: removed unread"))
                continue
            try:
                hdr = read_header(fd, entry)
            except RingError as exc:
                res.skipped.append(
                    SkippedFile(entry, exc.problem, st.st_size if stat.S_ISREG(st.st_mode) else None)
                )
                continue
            size = st.st_size
            owner = hdr.node_name
            if owner and owner != res.node and (job_nodes is None or owner in job_nodes):
                res.left_for[owner] = res.left_for.get(owner, 0) + 1
                continue
            if store_broken is None and res.archived_bytes + size > cap:
                res.skipped.append(
                    SkippedFile(
                        entry,
                        f"over prolog.max_archive_mb ({policy.max_archive_mb} MB): removed, not archived",
                        size,
                    )
                )
            elif store_broken is not None:
                res.skipped.append(SkippedFile(entry, f"not archived: {store_broken}", size))
            else:
                try:
                    dest = staging.ensure()
                    free = shutil.disk_usage(dest).free
                    if free - size < min_free:
                        res.skipped.append(
                            SkippedFile(
                                entry,
                                f"trace store has {free >> 20} MB free, keeping "
                                f"prolog.min_free_mb={policy.min_free_mb}: removed, not archived",
                                size,
                            )
                        )
                    else:
                        _copy_into(fd, dest / entry, size)
                        res.files.append(
                            ArchivedFile(
                                entry,
                                size,
                                hdr.job_id,
                                hdr.step_id,
                                hdr.global_rank,
                                hdr.local_rank,
                                hdr.world_size,
                                hdr.source_name,
                                owner,
                            )
                        )
                except OSError as exc:
                    store_broken = f"trace store error: {exc.strerror or exc}"
                    res.errors.append(f"archive {entry}: {exc}")
                    res.skipped.append(SkippedFile(entry, f"not archived: {store_broken}", size))
        finally:
            os.close(fd)
        # this node's entry: archived or not, its RAM is given back now
        try:
            os.unlink(entry, dir_fd=dirfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            res.errors.append(f"cannot remove {res.ring_dir}/{entry}: {exc.strerror}")
            res.cleanup_failed = True


def _copy_into(src_fd: int, dest: Path, size: int) -> None:
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        _copy(src_fd, out, size)
    finally:
        os.close(out)


def manifest(res: ArchiveResult, ts: float) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "job_id": res.job_id,
        "node": res.node,
        "restart_count": res.restart_count,
        "archived_at": _utc(ts),
        "archived_at_unix": ts,
        "ring_dir": res.ring_dir,
        "files": [asdict(f) for f in res.files],
        "archived_bytes": res.archived_bytes,
        "skipped": [asdict(s) for s in res.skipped[:MANIFEST_MAX_SKIPPED]],
        "skipped_count": len(res.skipped),
        "unread_count": res.unread,
        "left_for_other_nodes": dict(sorted(res.left_for.items())),
        "errors": list(res.errors),
    }


def _publish(res: ArchiveResult, staging: _Staging, clock: Clock) -> None:
    dest = staging.ensure()
    tmp = dest / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest(res, clock.now()), f, indent=2)
        f.write("\n")
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, dest / MANIFEST)
    base = res.node if res.restart_count == 0 else f"{res.node}.restart-{res.restart_count}"
    res.archive_dir = str(staging.publish(base))
    staging.ready = False


def prune(
    trace_store: str | Path, retention_days: float, *, clock: Clock | None = None, force: bool = False
) -> list[str]:
    """Remove job archives (<trace_store>/<digits>/) not modified for retention_days.

    At most once per PRUNE_INTERVAL_S (a stamp file), unless force. Returns
    the job ids removed. Entries that are not job directories are left alone.
    """
    clock = clock or SystemClock()
    store = Path(trace_store)
    now = clock.now()
    stamp = store / PRUNE_STAMP
    try:
        if not force and now - stamp.lstat().st_mtime < PRUNE_INTERVAL_S:
            return []
    except FileNotFoundError:
        pass
    if not store.is_dir():
        return []
    stamp.touch()
    os.utime(stamp, (now, now))
    cutoff = now - retention_days * 86400.0
    removed = []
    with os.scandir(store) as it:
        entries = [e for e in it if e.name.isdigit() and e.is_dir(follow_symlinks=False)]
    for e in entries:
        try:
            if e.stat(follow_symlinks=False).st_mtime < cutoff:
                shutil.rmtree(e.path)
                removed.append(e.name)
        except FileNotFoundError:
            pass  # another epilog sharing the store pruned it first
    return sorted(removed, key=int)
