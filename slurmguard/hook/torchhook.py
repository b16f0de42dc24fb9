"""torch.distributed hook: ring records for collectives that bypass NCCL.

For guarded jobs (SLURMGUARD_RING_DIR set by the SPANK plugin) the
sitecustomize.py next to this package calls :func:`install`. Nothing is
imported or patched until the job itself imports ``torch.distributed``;
jobs that never do are untouched.

Where it hooks. DDP, FSDP and the functional collectives call the process
group from C++, so wrapping the Python functions of torch.distributed would
miss most of a real job's traffic. Every c10d collective and p2p call goes
through the torch dispatcher as a ``c10d::*`` operator, so the hook
registers a kernel for each of them at the BackendSelect dispatch key (the
last one before the backend kernels; c10d has none there): it notes the
start time, redispatches to the backend kernel the dispatcher would have
chosen with the same arguments, and returns its result unchanged. Calls on
CPU and CUDA tensors are timed; others pass untimed. BackendSelect, not
the Autograd keys: functional collectives (``torch.ops._c10d_functional``:
all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
all_to_all_single, broadcast and the coalesced ones; what DTensor
tensor parallelism and torch.compile'd code issue) reach the c10d op from
inside the autograd fallback, which excludes the Autograd keys, as does
every call made inside a __torch_dispatch__; BackendSelect is never
excluded, so each call is seen once, as its c10d op (a functional
all_reduce is recorded as the ``allreduce_`` it issues, a few microseconds
after the functional op was called), inference-mode tensors included.
Work with a future (all gloo collectives) gets its end time from a done-callback on that
future and the ASYNC flag: the callback, on the thread that completes the
work, describes the call (group, sizes, reduce op), writes its record into
the ring at once and drops every reference to the call's arguments and
future. Work without a future (gloo's send/recv and reduce_scatter, whose
data moves when the job waits for it) is handed back wrapped (_timed_work):
its record ends when the job's wait() returns, so a pipeline stage waiting
for its neighbour, or an FSDP rank waiting for a slow peer's gradients, is
seen waiting rather than computing; for a functional collective that wait
is wait_tensor's on its output (an AsyncCollectiveTensor waits on first
use), which calls the wrapper from C++. Past MAX_UNWAITED such works not yet
waited for, further ones end when the call returns; those never waited for
are counted lost when the hook gives up (process end, last group gone).
The ring is shared memory, so a record once written outlives
whatever ends the process afterwards (os._exit, SIGTERM, SIGKILL). Records
appear in completion order; the callback needs the interpreter lock, so
the end can lag the real completion when the lock is busy. start_ns is
exact, which is what period detection uses.

What a call costs (all_reduce on a 1-rank gloo group pinned to one core of
the 2-core development machine, interleaved hook on/off blocks; `slurmguard
bench hook` measures 2 ranks): 25-35 us of wall time, of which about 45% is
the dispatcher's round trip through Python (arguments boxed into Python
objects and back; any Python kernel pays it), about 30% the done-callback
(a Python callable on a C++ future: wrapping it, then the interpreter lock
and a thread state on the completing thread), and the rest the start time,
the hold check and the future. Describing and writing the record in the
callback adds about 10 us on the completing thread. Per training step
that is collectives per step x this, against steps of tens of milliseconds
or more.

How a job ends stays the job's business: the hook never exits a process
itself and never changes how one ends; it adds bounded waits at the end,
so that completion callbacks still waiting for the interpreter lock write
their records (at most SETTLE_TIMEOUT_S, usually microseconds): before and
after destroy_process_group, at interpreter exit, in os._exit, and on the
terminating signals Slurm sends (TERM_SIGNALS, where they have their
default disposition; _TermGuard re-raises them so the process still dies of
the signal). Work still in flight once the last process group is gone or
the process ends is counted as lost in the ring header (its ``overwritten``
field counts every record the ring lost) and its arguments are released;
so is every call missed after recording failed. A record is therefore in
the ring or counted, never silently absent, except on SIGKILL within the
microseconds between a collective's completion and its callback.

NCCL-backed calls are left to the C hook when it is loaded in the process
(SLURMGUARD_NCCL_HOOK mapped), so nothing is recorded twice.

The hook must never change a result or break a job: every step of its own
bookkeeping is guarded; on its first internal error it prints one line to
stderr and stops recording, while calls keep going to the real kernels.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

if __package__:
    from . import ring as _ring
else:  # loaded by sitecustomize.py under a private name, ring.py likewise
    import _slurmguard_ring as _ring  # type: ignore[no-redef, import-not-found]

_monotonic_ns = time.monotonic_ns

#: at most this long (s) destroy_process_group waits, after the callbacks of
#: the group's calls ran, for their works to mark themselves completed
COMPLETE_WAIT_S = 1.0

#: longest the hook waits, at destroy_process_group and at interpreter exit,
#: for completion callbacks of finished work to write their records (s);
#: they normally need microseconds (the interpreter lock, then one record)
SETTLE_TIMEOUT_S = 1.0
#: signals whose default disposition ends the process and that Slurm sends
#: to a job's tasks (scancel, time limit, --signal); see _TermGuard
TERM_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
#: works without a future (gloo p2p, reduce_scatter) handed back wrapped and
#: not yet waited for; beyond it a call is recorded when it returns. The
#: wrappers are kept until the job has waited and dropped them: a wrapper
#: freed while C++ still held its Work would leave that Work's wait() blocked
MAX_UNWAITED = 1024
#: wrappers held before the waited-for ones the job dropped are pruned
PRUNE_UNWAITED = 64

# c10d operator -> (sg op, index of the process group, index of the count
# tensor(s), how to count, index of peer/root or None, index of the
# ReduceOp or None, coalesced)
# count kinds: "list" = first tensor of a Tensor[] (sum over the list when
# coalesced), "tensor" = a Tensor, "nested" = first list of a Tensor[][],
# "per_peer" = Tensor / group size (alltoall_base), "none" = no payload.
_OPS: dict[str, tuple] = {
    "allreduce_": ("allreduce", 1, 0, "list", None, 2, False),
    "allreduce_coalesced_": ("allreduce", 1, 0, "list", None, 2, True),
    "allgather_": ("allgather", 2, 1, "list", None, None, False),
    "_allgather_base_": ("allgather", 2, 1, "tensor", None, None, False),
    "allgather_coalesced_": ("allgather", 2, 1, "list", None, None, True),
    "allgather_into_tensor_coalesced_": ("allgather", 2, 1, "list", None, None, True),
    "reduce_scatter_": ("reducescatter", 2, 0, "list", None, 3, False),
    "_reduce_scatter_base_": ("reducescatter", 2, 0, "tensor", None, 3, False),
    "reduce_scatter_tensor_coalesced_": ("reducescatter", 2, 0, "list", None, 3, True),
    "broadcast_": ("broadcast", 1, 0, "list", 2, None, False),
    "reduce_": ("reduce", 1, 0, "list", 3, 2, False),
    "alltoall_": ("alltoall", 2, 1, "list", None, None, False),
    "alltoall_base_": ("alltoall", 2, 1, "per_peer", None, None, False),
    "gather_": ("gather", 2, 1, "list", 3, None, False),
    "scatter_": ("scatter", 2, 0, "list", 3, None, False),
    "send": ("send", 1, 0, "list", 2, None, False),
    "recv_": ("recv", 1, 0, "list", 2, None, False),
    "recv_any_source_": ("recv", 1, 0, "list", None, None, False),
    "barrier": ("barrier", 1, None, "none", None, None, False),
    "monitored_barrier_": ("barrier", 1, None, "none", None, None, False),
}

_DTYPES = {
    "torch.int8": "int8",
    "torch.uint8": "uint8",
    "torch.int32": "int32",
    "torch.uint32": "uint32",
    "torch.int64": "int64",
    "torch.uint64": "uint64",
    "torch.float16": "float16",
    "torch.float32": "float32",
    "torch.float64": "float64",
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.bool": "bool",
    "torch.int16": "int16",
    "torch.uint16": "uint16",
    "torch.complex64": "complex64",
    "torch.complex128": "complex128",
}

# c10d ReduceOp.RedOpType values (torch/csrc/distributed/c10d/Types.hpp)
_REDOPS = {0: "sum", 1: "avg", 2: "prod", 3: "min", 4: "max"}


def _warn(msg: str) -> None:
    try:
        sys.stderr.write(f"slurmguard: torch.distributed timing off: {msg}\n")
    except Exception:
        pass


class Recorder:
    """Turns dispatcher calls into ring records. One per process."""

    def __init__(self, env: Mapping[str, str], nccl_hook_loaded: bool) -> None:
        self.env = env
        self.nccl_hook_loaded = nccl_hook_loaded
        self.enabled = True
        self.writer: _ring.RingWriter | None = None
        self._init_lock = threading.Lock()
        # completion callbacks of work in flight (_Pending); set.add and
        # set.discard are atomic under the interpreter lock
        self._pending: set = set()
        self._term: _TermGuard | None = None
        self._groups: dict[tuple, tuple] = {}  # (group name, device) -> (comm_id, skip)
        self._announced: set = set()
        self._unwaited: dict[int, Any] = {}  # id -> _timed_work wrapper (see MAX_UNWAITED)
        self._prune_at = PRUNE_UNWAITED

    # ---------------------------------------------------------------- setup
    def _writer(self) -> _ring.RingWriter | None:
        if self.writer is not None or not self.enabled:
            return self.writer
        with self._init_lock:
            if self.writer is None and self.enabled:
                self.writer = self._create()
        return self.writer

    def _create(self) -> _ring.RingWriter | None:
        import torch.distributed as dist

        env = self.env
        rank = dist.get_rank() if dist.is_initialized() else _env_int(env, ("RANK", "SLURM_PROCID"), -1)
        world = (
            dist.get_world_size()
            if dist.is_initialized()
            else _env_int(env, ("WORLD_SIZE", "SLURM_NTASKS"), 0)
        )
        step = _env_int(env, ("SLURMGUARD_STEP_ID",), _ring.STEP_PENDING)
        directory = env["SLURMGUARD_RING_DIR"]
        meta: dict[str, Any] = dict(
            capacity=_env_int(env, ("SLURMGUARD_RING_RECORDS",), _ring.DEFAULT_CAPACITY),
            job_id=_env_int(env, ("SLURMGUARD_JOB_ID",), 0),
            step_id=step,
            global_rank=rank,
            local_rank=_env_int(env, ("LOCAL_RANK", "SLURM_LOCALID"), -1),
            world_size=world,
            source=_ring.SOURCE_TORCH,
            node_name=env.get("SLURMD_NODENAME") or os.uname().nodename,
            tracks_in_flight=True,
        )
        name = _ring.ring_file_name(rank, step, "torch")
        path = os.path.join(directory, name)
        try:
            writer = _ring.RingWriter(path, **meta)
        except FileExistsError:
            path = os.path.join(directory, name[: -len(".ring")] + f".pid-{os.getpid()}.ring")
            try:
                writer = _ring.RingWriter(path, **meta)
            except OSError as exc:
                self._fail(f"cannot create {path}: {exc.strerror}")
                return None
        except OSError as exc:
            self._fail(f"cannot create {path}: {exc.strerror}")
            return None
        atexit.register(self.at_exit)
        self._term = _TermGuard.install(self)
        return writer

    def forked(self) -> None:
        """In a forked child: never write into the parent's ring (its lock
        stayed in the parent); a child that runs collectives gets its own."""
        global _TAKE
        self.writer = None
        self._init_lock = threading.Lock()
        _TAKE = threading.Lock()  # a parent's thread may have held it at fork
        self._pending = set()  # the parent's work completes in the parent
        if self._term is not None:
            self._term.forked()
            self._term = None
        self._groups = {}
        self._announced = set()
        self._unwaited = {}
        self._prune_at = PRUNE_UNWAITED

    def _fail(self, msg: str) -> None:
        if self.enabled:
            self.enabled = False
            _warn(msg)
            self.give_up()

    def missed(self, n: int = 1) -> None:
        """Count n calls that recording failed to write as lost."""
        w = self.writer
        if w is not None:
            try:
                w.count_lost(n)
            except Exception:
                pass

    def _group(self, pg_obj: Any, device_type: str, first_use_ns: int = 0) -> tuple:
        """(comm_id, skip) of a process group; the first sight of a group
        also records a comm_init with its rank and size, stamped with the
        start of the call that showed it (first_use_ns)."""
        pg = _c10d().pg(pg_obj)
        key = (pg.group_name, device_type)
        cached = self._groups.get(key)
        if cached is not None:
            return cached
        backend = pg._get_backend_name() if hasattr(pg, "_get_backend_name") else ""
        skip = device_type == "cuda" and self.nccl_hook_loaded and "nccl" in backend
        cid = _ring.comm_id_of(pg.group_name)
        w = None if skip else self._writer()
        with self._init_lock:  # completion callbacks run on other threads
            if w is not None and pg.group_name not in self._announced:
                # the group's rank and size, once, like the NCCL hook's comm_init
                self._announced.add(pg.group_name)
                t = first_use_ns or time.monotonic_ns()
                w.append(
                    _ring.OP["comm_init"], comm_id=cid, count=pg.size(), peer=pg.rank(), start_ns=t, end_ns=t
                )
        self._groups[key] = (cid, skip)
        return cid, skip

    # ---------------------------------------------------------------- calls
    # The call's own path only takes the start time, checks the hold word
    # and attaches a callback; describing the call (group, sizes, reduce op:
    # several microseconds of TorchScript object access) happens when the
    # work completes, off the caller's path.

    def before(self, opname: str, args: tuple, device_type: str) -> tuple | None:
        if device_type == "cuda" and self.nccl_hook_loaded:
            _, skip = self._group(args[_OPS[opname][1]], device_type)
            if skip:
                return None
        w = self.writer
        if w is None:
            w = self._writer()
            if w is None:
                return None
        if w.hold_requested():
            w.hold_wait()
        start = _monotonic_ns()
        w.enter(start)
        # the last item is the call's one leave (_close): its record or its loss
        return (w, opname, args, device_type, start, [True])

    def after(self, ctx: tuple, out: Any, error: bool = False) -> Any:
        """Record the call (now, or when its work completes). Returns what
        the kernel hands back: `out`, or `out` with its work wrapped."""
        if not error:
            # (outputs, work) or a bare work; the work arrives boxed as a
            # TorchScript object
            work = out[-1] if type(out) is tuple and out else out
            inner = fut = None
            try:
                inner = _c10d().work_unbox(work)
                fut = inner.get_future()
            except Exception:
                pass  # gloo p2p / reduce_scatter work has no future
            if fut is not None:
                p = _Pending(self, ctx, fut, inner)
                self._pending.add(p)
                fut.add_done_callback(p)  # a future already done runs it here
                return out
            if inner is not None and ctx[3] == "cpu" and ctx[1] != "recv_any_source_":
                timed = self._timed(ctx, inner)
                if timed is not None:
                    return (*out[:-1], timed) if type(out) is tuple else timed
        self._emit(ctx, _monotonic_ns(), error, False)
        return out

    def _timed(self, ctx: tuple, inner: Any) -> Any:
        """A boxed wrapper of `inner` whose wait() writes the record, or None
        (too many unwaited: the caller records at return)."""
        if len(self._unwaited) >= self._prune_at:
            # wrappers the job has waited for and no longer holds can go
            # (references: the dict, `old`, getrefcount's argument)
            for k in list(self._unwaited):
                old = self._unwaited[k]
                if old._sg is None and sys.getrefcount(old) <= 3:
                    del self._unwaited[k]
            old = None
            self._prune_at = max(PRUNE_UNWAITED, 2 * len(self._unwaited))
        if len(self._unwaited) >= MAX_UNWAITED:
            # full of works not waited for (a job that drops isend works or
            # functional outputs unused): the next look is MAX_UNWAITED or
            # more calls away, so a full table costs no scan per call
            self._prune_at -= 1
            return None
        w = _c10d().timed_work(self, ctx, inner)
        self._unwaited[id(w)] = w
        return w.boxed()

    def waited(self, ctx: tuple, error: bool) -> None:
        """A wrapped work's wait() returned (or raised): write its record."""
        try:
            self._emit(ctx, _monotonic_ns(), error, True)
        except Exception as exc:
            self.missed()
            self._fail(f"recording failed: {exc!r}")

    def completed(self, ctx: tuple, end: int, fut: Any) -> None:
        """A done-callback: write the record now (the process may end at any
        moment after the work is done)."""
        try:
            fut.value()
            error = False
        except BaseException:
            error = True  # failed or aborted work: recorded with F_ERROR
        try:
            self._emit(ctx, end, error, True)
        except Exception as exc:
            self.missed()
            self._fail(f"recording failed: {exc!r}")

    def settle(self, timeout_s: float | None = None) -> int:
        """Wait until the callbacks of work that is already done have
        written their records (they wait for the interpreter lock, which
        sleeping here gives up), at most timeout_s (default
        SETTLE_TIMEOUT_S). Returns how many calls are still in flight."""
        deadline = time.monotonic() + (SETTLE_TIMEOUT_S if timeout_s is None else timeout_s)
        _poll(lambda: not any(p.done() for p in list(self._pending)), deadline)
        return len(self._pending)

    def give_up(self) -> int:
        """Count the calls still in flight as lost and release what they
        hold (arguments, futures); their callbacks, should they still run,
        write nothing. Wrapped works the job has not waited for (a p2p
        work or a functional collective's output it never used) are
        counted too; their wrappers stay (C++ may still hold them) but
        write nothing. Returns the number given up."""
        n = 0
        taken = []  # callbacks that took their call before the drop
        for p in list(self._pending):
            if p.drop():
                n += 1
            elif p.writing():
                taken.append(p)
        # a callback that started between settle and here is writing its
        # record: the process may end right after this returns
        _poll(lambda: not any(p.writing() for p in taken), time.monotonic() + SETTLE_TIMEOUT_S)
        self._pending.clear()
        for w in list(self._unwaited.values()):
            sg, w._sg = w._sg, None
            if sg is not None:
                _close(sg[1])
                n += 1
        if n:
            self.missed(n)
        return n

    def at_exit(self) -> None:
        """Interpreter exit: nothing the job completed may be missing."""
        try:
            self.settle()
            self.give_up()
        except Exception:  # pragma: no cover - defensive
            pass

    def around_destroy(self, destroy: Callable, *args: Any, **kwargs: Any) -> Any:
        """destroy_process_group, after the records of the group's finished
        work are written; once no group is left, whatever is still in
        flight is counted lost (a job that ends with os._exit right after,
        as slurmguard.teardown.finish does, loses nothing unseen).

        Work of the group still in flight is waited for first, with the
        interpreter lock released: gloo's destructor joins its worker
        threads while holding that lock, and a worker that finishes such
        work must run our callback (Python) first, so destroying the group
        with the callback pending would deadlock. Without the hook the same
        destroy_process_group blocks until that work ends as well (the
        worker must finish it before the join returns), so the wait changes
        nothing but who waits.
        """
        try:
            if self.enabled:
                group = args[0] if args else kwargs.get("group")
                self.wait_for(None if group is None else _group_name(group))
        except Exception:  # pragma: no cover - defensive
            pass
        try:
            return destroy(*args, **kwargs)
        finally:
            try:
                if self.enabled:
                    self.settle()
                    import torch.distributed as dist

                    if not dist.is_initialized():
                        self.give_up()
            except Exception:  # pragma: no cover - defensive
                pass

    def wait_for(self, group_name: str | None) -> None:
        """Sleep until no CPU call of group_name (None: of any group) awaits
        its completion callback, and until the works whose callbacks that
        took mark themselves completed (at most COMPLETE_WAIT_S more): the
        callback runs inside the work's completion, before the work says
        it is completed, so without this wait a job would see its work
        unfinished after destroy_process_group where it sees it finished
        without the hook."""
        works = [p.work for p in list(self._pending) if p.of_group(group_name) and p.work is not None]
        _poll(lambda: not any(p.of_group(group_name) for p in list(self._pending)))
        deadline = time.monotonic() + COMPLETE_WAIT_S
        for work in works:
            _poll(functools.partial(_completed, work), deadline)

    def _emit(self, ctx: tuple, end: int, error: bool, is_async: bool) -> None:
        try:
            self._write(ctx, end, error, is_async)
        finally:
            _close(ctx)

    def _write(self, ctx: tuple, end: int, error: bool, is_async: bool) -> None:
        w, opname, args, device_type, start, _ = ctx
        op, pg_i, t_i, kind, peer_i, red_i, coalesced = _OPS[opname]
        cid, _ = self._group(args[pg_i], device_type, start)
        count, dt = _count(args, t_i, kind, args[pg_i])
        flags = _ring.F_COALESCED if coalesced and _list_len(args, t_i) > 1 else 0
        if error:
            flags |= _ring.F_ERROR
        if is_async:
            flags |= _ring.F_ASYNC
        w.append(
            _ring.OP[op],
            comm_id=cid,
            count=count,
            nbytes=count * _ring.DATATYPE_SIZES[dt],
            start_ns=start,
            end_ns=end,
            peer=int(args[peer_i]) if peer_i is not None and peer_i < len(args) else -1,
            datatype=dt,
            redop=_redop(args[red_i]) if red_i is not None and red_i < len(args) else 0,
            flags=flags,
            status=1 if error else 0,
        )


def _close(ctx: tuple) -> None:
    """The call of ctx is no longer in flight (recorded or lost): its writer's
    count drops once, whichever of its paths gets here first (list.pop is
    one step under the interpreter lock)."""
    try:
        ctx[5].pop()
    except IndexError:
        return
    try:
        ctx[0].leave()
    except Exception:  # pragma: no cover - a closed ring: nothing left to count
        pass


def _poll(done: Callable[[], bool], deadline: float | None = None) -> None:
    """Sleep, giving up the interpreter lock, with a pause growing from 0.5 to
    10 ms, until done() or the deadline (time.monotonic() s; None: no limit)."""
    pause = 0.0005
    while not done() and (deadline is None or time.monotonic() < deadline):
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _completed(work: Any) -> bool:
    """The work says it is completed (a work that cannot say counts as completed)."""
    try:
        return bool(work.is_completed())
    except Exception:
        return True


#: taking a call from its _Pending (its callback or a give-up) is one
#: exchange under this lock, so a call is written or counted, never both
#: nor neither
_TAKE = threading.Lock()


class _Pending:
    """The done-callback of one call's work. It holds the call's arguments
    and future only until the work completes (or the hook gives it up)."""

    __slots__ = ("rec", "ctx", "fut", "work", "__weakref__")

    def __init__(self, rec: Recorder, ctx: tuple, fut: Any, work: Any = None) -> None:
        self.rec = rec
        self.ctx: tuple | None = ctx
        self.fut = fut
        self.work = work  # the call's Work, for Recorder.wait_for

    def __call__(self, fut: Any) -> None:
        # on the thread that completed the work, ahead of the job's own
        # continuations. While the record is written the call stays in
        # the pending set, taken (ctx None) but holding its future: a
        # settle on another thread (a terminating signal, os._exit) waits
        # for it instead of missing a record that is neither written nor
        # counted lost. The job's own wait returns as soon as the future is
        # marked completed, before this callback ends.
        end = _monotonic_ns()
        with _TAKE:
            ctx, self.ctx = self.ctx, None
        if ctx is None:
            return
        try:
            self.rec.completed(ctx, end, fut)
        finally:
            self.fut = self.work = None
            self.rec._pending.discard(self)

    def done(self) -> bool:
        """The work is done and its record not yet written (its callback
        is due, or writing it)."""
        fut = self.fut
        try:
            return fut is not None and (self.ctx is None or fut.done())
        except Exception:
            return False

    def writing(self) -> bool:
        """Its callback took it and has not finished writing its record."""
        return self.ctx is None and self.fut is not None

    def of_group(self, group_name: str | None) -> bool:
        """Still pending, a call on CPU tensors (gloo's, whose destroy joins
        the workers that run the callbacks; NCCL's destroy aborts instead)
        of group_name (None: any group)."""
        ctx = self.ctx
        if ctx is None or ctx[3] != "cpu":
            return False
        if group_name is None:
            return True
        try:
            return _group_name(ctx[2][_OPS[ctx[1]][1]]) == group_name
        except Exception:
            return True

    def drop(self) -> bool:
        """Release the call; False if its callback already took it (and
        then releases it itself once the record is written)."""
        with _TAKE:
            ctx, self.ctx = self.ctx, None
        if ctx is not None:
            self.fut = self.work = None
            _close(ctx)
        return ctx is not None


class _TermGuard:
    """Records of finished work before a terminating signal ends the process.

    For the signals Slurm sends to end or warn a job (TERM_SIGNALS) whose
    disposition is the default (death), installed with the ring. A job's
    own handler is never replaced (it decides; if it exits, the atexit
    settle runs). The process must still die of the signal, and at once:
    Python runs a handler only when the main thread is back in the
    interpreter, which a rank blocked in a collective may not be for a
    long time. So Python's C-level handler, through set_wakeup_fd, writes
    the signal number to a pipe that wakes a thread of ours; that thread
    (or the Python-level handler, whichever comes first) lets waiting
    completion callbacks write (SETTLE_TIMEOUT_S at most), counts work in
    flight as lost, restores the default disposition and sends the signal
    again: the process ends killed by that signal, as without the hook.
    If the job installs a handler later, it alone decides; if it takes over
    the wakeup fd (asyncio does), only the Python-level path remains. A
    thread blocked in C while holding the interpreter lock delays both
    paths (it would block the job's own handlers too).
    """

    def __init__(self, rec: Recorder, signums: tuple) -> None:
        self.rec = rec
        self.signums = signums
        self.fired = threading.Lock()
        self.rfd = self.wfd = -1
        self.libc_signal: Any = None

    @classmethod
    def install(cls, rec: Recorder) -> _TermGuard | None:
        import signal

        try:
            if threading.current_thread() is not threading.main_thread():
                return None
            signums = tuple(
                n
                for n in (getattr(signal, x, None) for x in TERM_SIGNALS)
                if n is not None and signal.getsignal(n) is signal.SIG_DFL
            )
            if not signums:
                return None
            import ctypes

            guard = cls(rec, signums)
            # signal() of libc: the way back to the default disposition
            # from a thread that is not the main thread
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            guard.libc_signal = libc.signal
            for n in signums:
                signal.signal(n, guard.handler)
            rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
            except (ValueError, OSError):
                old = None
            if old != -1:
                # someone else's wakeup fd: theirs stays, only the Python path
                if old is not None:
                    signal.set_wakeup_fd(old)
                os.close(rfd)
                os.close(wfd)
            else:
                guard.rfd, guard.wfd = rfd, wfd
                threading.Thread(target=guard._watch, name="slurmguard-signals", daemon=True).start()
            return guard
        except Exception as exc:  # pragma: no cover - defensive
            _warn(f"no record settle on signals: {exc!r}")
            return None

    def _ours(self, signum: int) -> bool:
        import signal

        return signal.getsignal(signum) == self.handler

    def _watch(self) -> None:
        import select

        while True:
            try:
                select.select([self.rfd], [], [])
                data = os.read(self.rfd, 512)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                return
            for signum in self.signums:
                if signum in data and self._ours(signum):
                    self.fire(signum, main=False)

    def handler(self, signum: int, frame: Any) -> None:
        self.fire(signum, main=True)

    def fire(self, signum: int, main: bool) -> None:
        import signal

        if not self.fired.acquire(blocking=False):
            if main:  # the watcher is on it: it ends the process
                time.sleep(SETTLE_TIMEOUT_S + 1.0)
            return
        try:
            self.rec.settle()
            self.rec.give_up()
        except Exception:  # pragma: no cover - defensive
            pass
        try:
            if main:
                signal.signal(signum, signal.SIG_DFL)
            else:
                self.libc_signal(signum, signal.SIG_DFL.value)
        finally:
            os.kill(os.getpid(), signum)

    def forked(self) -> None:
        """In a forked child (DataLoader workers): signals act on it as they
        would without the hook, and never wake the parent's watcher."""
        import signal

        try:
            for signum in self.signums:
                if self._ours(signum):
                    signal.signal(signum, signal.SIG_DFL)
            if self.wfd >= 0:
                current = signal.set_wakeup_fd(-1)
                if current != self.wfd:
                    signal.set_wakeup_fd(current)
                os.close(self.rfd)
                os.close(self.wfd)
        except Exception:
            pass


def _group_name(pg_obj: Any) -> str:
    return _c10d().pg(pg_obj).group_name


def _env_int(env: Mapping[str, str], names: tuple, default: int) -> int:
    for n in names:
        v = env.get(n)
        if v:
            try:
                return int(v)
            except ValueError:
                continue
    return default


def _list_len(args: tuple, i: int | None) -> int:
    if i is None or i >= len(args):
        return 0
    a = args[i]
    return len(a) if isinstance(a, (list, tuple)) else 1


def _dtype_code(t: Any) -> int:
    return _ring.DATATYPE.get(_DTYPES.get(str(t.dtype), "unknown"), 0)


def _count(args: tuple, i: int | None, kind: str, pg_obj: Any) -> tuple:
    """(elements, datatype code) as the NCCL call would count them."""
    if i is None or kind == "none" or i >= len(args):
        return 0, 0
    a = args[i]
    if kind == "tensor":
        return a.numel(), _dtype_code(a)
    if kind == "per_peer":
        size = _c10d().pg(pg_obj).size() or 1
        return a.numel() // size, _dtype_code(a)
    if not a:
        return 0, 0
    first = a[0]
    if isinstance(first, (list, tuple)):  # Tensor[][]
        return (first[0].numel(), _dtype_code(first[0])) if first else (0, 0)
    return sum(t.numel() for t in a), _dtype_code(first)


def _redop(obj: Any) -> int:
    """sg redop of a c10d ReduceOp (a TorchScript object in the dispatcher,
    whose op() method returns the RedOpType value)."""
    try:
        op = obj.op
        value = int(op() if callable(op) else op)
        return _ring.REDOP[_REDOPS[value]] if value in _REDOPS else _ring.REDOP["other"]
    except Exception:
        return _ring.REDOP["other"]


class _C10d:
    """torch's c10d classes, looked up once (an import statement per call
    costs microseconds on the caller's path)."""

    def __init__(self) -> None:
        import torch
        from torch._C._distributed_c10d import ProcessGroup, Work

        self.script_object = torch.ScriptObject
        self.work_cls = Work
        self.pg_cls = ProcessGroup
        self.timed_work = _timed_work_class(Work)

    def work_unbox(self, work: Any) -> Any:
        return work if type(work) is self.work_cls else self.work_cls.unbox(work)

    def pg(self, obj: Any) -> Any:
        """The ProcessGroup of a dispatcher argument (a boxed TorchScript
        object there; a ProcessGroup when called directly)."""
        return self.pg_cls.unbox(obj) if type(obj) is self.script_object else obj


def _timed_work_class(Work: type) -> type:
    """A Work subclass (torch calls its Python methods from C++) that
    forwards everything to the real work and tells the recorder when the
    job's wait() on it returns."""

    class TimedWork(Work):
        def __init__(self, rec: Recorder, ctx: tuple, inner: Any) -> None:
            super().__init__()
            self._sg: tuple | None = (rec, ctx)
            self._inner = inner

        def wait(self, timeout: Any = None) -> bool:
            try:
                ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
            except BaseException:
                self._record(True)
                raise
            self._record(False)
            return ok

        def _record(self, error: bool) -> None:
            sg, self._sg = self._sg, None
            if sg is not None:
                sg[0].waited(sg[1], error)

        def is_completed(self) -> bool:
            return self._inner.is_completed()

        def is_success(self) -> bool:
            return self._inner.is_success()

        def exception(self) -> Any:
            return self._inner.exception()

        def source_rank(self) -> int:
            return self._inner.source_rank()

        def result(self) -> Any:
            return self._inner.result()

        def synchronize(self) -> None:
            self._inner.synchronize()

        def get_future(self) -> Any:
            return self._inner.get_future()

    return TimedWork


_c10d_cache: list = []


def _c10d() -> _C10d:
    if not _c10d_cache:
        _c10d_cache.append(_C10d())
    return _c10d_cache[0]


# --------------------------------------------------------------------- patch

_state: dict[str, Any] = {}


def _nccl_hook_loaded(env: dict[str, str]) -> bool:
    path = env.get("SLURMGUARD_NCCL_HOOK")
    if not path:
        return False
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(path) for line in f)
    except OSError:
        return False


def patch(env: dict[str, str] | None = None) -> bool:
    """Register the recording kernels (idempotent). Returns True if active."""
    if "lib" in _state:
        return True
    env = dict(os.environ if env is None else env)
    if not env.get("SLURMGUARD_RING_DIR"):
        return False
    try:
        import torch

        rec = _state.get("recorder") or Recorder(env, _nccl_hook_loaded(env))
        lib = torch.library.Library("c10d", "IMPL")
        dk = torch._C.DispatchKey
        # below BackendSelect only the backend kernels run; the full-after set
        # also holds the Python dispatcher's key (the highest of all), which
        # the call has passed already
        below = torch._C._dispatch_keyset_full_after(dk.BackendSelect).remove(dk.PythonDispatcher)
        devices = {dk.CPU: "cpu", dk.SparseCPU: "cpu", dk.CUDA: "cuda", dk.SparseCUDA: "cuda"}
        for name in _OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is None:
                continue  # not in this torch version
            lib.impl(
                name, _kernel(rec, name, packet.default, below, devices), "BackendSelect", with_keyset=True
            )
    except Exception as exc:
        _warn(f"cannot hook torch.distributed: {exc!r}")
        return False
    # the registrations live as long as the Library object
    _state["lib"] = lib
    if "recorder" not in _state:
        _state["recorder"] = rec
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=rec.forked)
        _wrap_destroy(rec)
        _wrap_os_exit(rec)
    return True


def _wrap_os_exit(rec: Recorder) -> None:
    """os._exit skips atexit: let finished work's callbacks write first."""
    real = os._exit
    if getattr(real, "__wrapped__", None) is not None:
        return

    @functools.wraps(real)
    def _exit(status: int) -> None:
        try:
            if rec.enabled and rec._pending:
                rec.settle()
                rec.give_up()
        except BaseException:
            pass
        real(status)

    os._exit = _exit  # type: ignore[assignment]


def _wrap_destroy(rec: Recorder) -> None:
    """Route destroy_process_group (both names a job may call it by)
    through Recorder.around_destroy; same signature, result and errors."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        original = c10d.destroy_process_group

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            return rec.around_destroy(original, *args, **kwargs)

        for module in (c10d, dist):
            if getattr(module, "destroy_process_group", None) is original:
                cast(Any, module).destroy_process_group = destroy_process_group
    except Exception as exc:  # recording goes on; only the final settle is missing
        _warn(f"cannot wrap destroy_process_group: {exc!r}")


def unpatch() -> None:
    """Remove the recording kernels again (the job continues unhooked);
    patch() puts them back. The ring stays open for a later patch()."""
    lib = _state.pop("lib", None)
    if lib is not None:
        lib._destroy()


def _kernel(rec: Recorder, name: str, op: Any, below: Any, devices: dict) -> Callable:
    """The BackendSelect kernel of one c10d op: times the call, then hands
    it to the backend kernel the dispatcher would have chosen (devices:
    that kernel's DispatchKey -> the hook's device type; calls on other
    devices pass untimed)."""
    # the OpOverload's own redispatch is one Python frame around this
    handle = getattr(op, "_handle", None)
    redispatch = getattr(handle, "redispatch_boxed", None) or op.redispatch

    def kernel(keyset: Any, *args: Any) -> Any:
        keyset = keyset & below
        if not rec.enabled:
            if rec.writer is not None:
                rec.missed()  # recording failed after the ring existed
            return redispatch(keyset, *args)
        try:
            device = devices.get(keyset.highestPriorityTypeId())
            ctx = None if device is None else rec.before(name, args, device)
        except Exception as exc:
            rec._fail(f"recording failed: {exc!r}")
            rec.missed()
            ctx = None
        if ctx is None:
            return redispatch(keyset, *args)
        try:
            out = redispatch(keyset, *args)
        except BaseException:
            try:
                rec.after(ctx, None, error=True)
            except Exception:
                _close(ctx)
            raise
        try:
            return rec.after(ctx, out)
        except Exception as exc:
            _close(ctx)
            rec._fail(f"recording failed: {exc!r}")
            rec.missed()
        return out

    kernel.__name__ = f"slurmguard_{name}"
    return kernel


class _Finder(importlib.abc.MetaPathFinder):
    """Patches once both `torch` and `torch.distributed` have finished
    importing (recent torch imports torch.distributed half-way through its
    own __init__, when torch.library is not there yet)."""

    torch_done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in ("torch", "torch.distributed"):
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        finder = self

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            if fullname == "torch":
                finder.torch_done = True
            if finder.torch_done and "torch.distributed" in sys.modules:
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                patch()

        try:
            spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        except (AttributeError, TypeError):
            pass
        return spec


def install(env: Mapping[str, str] | None = None) -> bool:
    """Arrange for patch() once torch.distributed is imported. Returns
    False (and does nothing) outside guarded jobs."""
    env = os.environ if env is None else env
    if not env.get("SLURMGUARD_RING_DIR"):
        return False
    if "torch.distributed" in sys.modules:
        return patch()
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
