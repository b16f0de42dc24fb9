"""torch.distributed hook: ring records for collectives that bypass NCCL.

For guarded jobs (SLURMGUARD_RING_DIR set by the SPANK plugin) the
sitecustomize.py next to this package calls :func:`install`. Nothing is
imported or patched until the job itself imports ``torch.distributed``;
jobs that never do are untouched.

Where it hooks. DDP, FSDP and the functional collectives call the process
group from C++, so wrapping the Python functions of torch.distributed would
miss most of a real job's traffic. Every c10d collective and p2p call goes
through the torch dispatcher as a ``c10d::*`` operator, so the hook
registers a kernel for each of them at the Autograd dispatch keys (which
run before the backend kernels and where c10d has none of its own): it
notes the start time, redispatches to the real kernel below autograd with
the same arguments, and returns its result unchanged. Work with a future
(all gloo collectives) gets its end time from a done-callback on that
future and the ASYNC flag. That callback runs on the completing thread
ahead of the job's own continuations, so it only takes a timestamp and
queues the call; a daemon thread writes the queued records every
DRAIN_INTERVAL_S (and at exit). The callback needs the interpreter lock,
so the end can lag the real completion when the lock is busy; records
appear in completion order, up to DRAIN_INTERVAL_S late. start_ns is
exact, which is what period detection uses. Work without a future (gloo
p2p) ends when the call returns and is written at once. Tensors created
under torch.inference_mode() carry no autograd keys and are not seen (those
calls run normally, untimed).

What a call costs (all_reduce on a 1-rank gloo group pinned to one core of
the 2-core development machine, interleaved hook on/off blocks; `slurmguard
bench hook` measures 2 ranks): 25-35 us of wall time, of which about 45% is
the dispatcher's round trip through Python (arguments boxed into Python
objects and back; any Python kernel pays it), about 30% the done-callback
(a Python callable on a C++ future: wrapping it, then the interpreter lock
and a thread state on the completing thread), and the rest the start time,
the hold check, the future and the queueing. Per training step that is
collectives per step x this, against steps of tens of milliseconds or more.

NCCL-backed calls are left to the C hook when it is loaded in the process
(SLURMGUARD_NCCL_HOOK mapped), so nothing is recorded twice.

The hook must never change a result or break a job: every step of its own
bookkeeping is guarded; on its first internal error it prints one line to
stderr and stops recording, while calls keep going to the real kernels.
"""

from __future__ import annotations

import atexit
import collections
import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

if __package__:
    from . import ring as _ring
else:  # loaded by sitecustomize.py under a private name, ring.py likewise
    import _slurmguard_ring as _ring  # type: ignore[no-redef]

_monotonic_ns = time.monotonic_ns

#: how often the drain thread writes records of completed async work (s)
DRAIN_INTERVAL_S = 0.2
#: records the drain thread writes before it lets other threads have the
#: interpreter lock (about 10 us each): a job's thread that wants the lock
#: meanwhile waits for at most one batch, not for up to sys.getswitchinterval()
DRAIN_BATCH = 64

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
    "torch.int8": "int8", "torch.uint8": "uint8", "torch.int32": "int32",
    "torch.uint32": "uint32", "torch.int64": "int64", "torch.uint64": "uint64",
    "torch.float16": "float16", "torch.float32": "float32", "torch.float64": "float64",
    "torch.bfloat16": "bfloat16", "torch.float8_e4m3fn": "float8_e4m3",
    "torch.float8_e5m2": "float8_e5m2", "torch.bool": "bool", "torch.int16": "int16",
    "torch.uint16": "uint16", "torch.complex64": "complex64", "torch.complex128": "complex128",
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

    def __init__(self, env: dict[str, str], nccl_hook_loaded: bool) -> None:
        self.env = env
        self.nccl_hook_loaded = nccl_hook_loaded
        self.enabled = True
        self.writer: _ring.RingWriter | None = None
        self._init_lock = threading.Lock()
        self._done: collections.deque = collections.deque()  # (ctx, end_ns) to write
        self._drainer: threading.Thread | None = None
        self._groups: dict[tuple, tuple] = {}  # (group name, device) -> (comm_id, skip)
        self._announced: set = set()

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
        world = (dist.get_world_size() if dist.is_initialized()
                 else _env_int(env, ("WORLD_SIZE", "SLURM_NTASKS"), 0))
        step = _env_int(env, ("SLURMGUARD_STEP_ID",), _ring.STEP_PENDING)
        directory = env["SLURMGUARD_RING_DIR"]
        meta = dict(
            capacity=_env_int(env, ("SLURMGUARD_RING_RECORDS",), _ring.DEFAULT_CAPACITY),
            job_id=_env_int(env, ("SLURMGUARD_JOB_ID",), 0), step_id=step,
            global_rank=rank, local_rank=_env_int(env, ("LOCAL_RANK", "SLURM_LOCALID"), -1),
            world_size=world, source=_ring.SOURCE_TORCH,
            node_name=env.get("SLURMD_NODENAME") or os.uname().nodename)
        name = _ring.ring_file_name(rank, step, "torch")
        path = os.path.join(directory, name)
        try:
            return _ring.RingWriter(path, **meta)
        except FileExistsError:
            path = os.path.join(directory, name[:-len(".ring")] + f".pid-{os.getpid()}.ring")
            try:
                return _ring.RingWriter(path, **meta)
            except OSError as exc:
                return self._fail(f"cannot create {path}: {exc.strerror}")
        except OSError as exc:
            return self._fail(f"cannot create {path}: {exc.strerror}")

    def forked(self) -> None:
        """In a forked child: never write into the parent's ring (its lock
        stayed in the parent); a child that runs collectives gets its own."""
        self.writer = None
        self._init_lock = threading.Lock()
        self._done = collections.deque()
        self._drainer = None
        self._groups = {}
        self._announced = set()

    def _fail(self, msg: str) -> None:
        if self.enabled:
            self.enabled = False
            _warn(msg)

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
                w.append(_ring.OP["comm_init"], comm_id=cid, count=pg.size(), peer=pg.rank(),
                         start_ns=t, end_ns=t)
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
        return (w, opname, args, device_type, _monotonic_ns())

    def after(self, ctx: tuple, out: Any, error: bool = False) -> None:
        if not error:
            # (outputs, work) or a bare work; the work arrives boxed as a
            # TorchScript object
            work = out[-1] if type(out) is tuple and out else out
            try:
                fut = _c10d().work_unbox(work).get_future()
            except Exception:
                fut = None  # e.g. gloo p2p work has no future: end = return
            if fut is not None:
                done = self._done
                # Runs on the thread that completes the work (a future that
                # is already done runs it here, at once), ahead of the job's
                # own continuations: only a timestamp and a deque append;
                # the drain thread writes the record.
                fut.add_done_callback(lambda _f, ctx=ctx: done.append((ctx, _monotonic_ns())))
                if self._drainer is None:
                    self._start_drain()
                return
        self._emit(ctx, _monotonic_ns(), error, False)

    def _start_drain(self) -> None:
        if self._drainer is not None:
            return
        with self._init_lock:
            if self._drainer is None:
                t = threading.Thread(target=self._drain_loop, name="slurmguard-ring", daemon=True)
                self._drainer = t
                t.start()
                atexit.register(self.drain)

    def _drain_loop(self) -> None:
        while self.enabled:
            time.sleep(DRAIN_INTERVAL_S)
            self.drain()

    def drain(self) -> None:
        """Write the records of completed async work (oldest first)."""
        done = self._done
        try:
            n = 0
            while done:
                ctx, end = done.popleft()
                self._emit(ctx, end, False, True)
                n += 1
                if n % DRAIN_BATCH == 0:
                    time.sleep(0)  # releases the lock; returns at once if nobody waits
        except Exception as exc:  # pragma: no cover - defensive
            self._fail(f"recording failed: {exc!r}")

    def _emit(self, ctx: tuple, end: int, error: bool, is_async: bool) -> None:
        w, opname, args, device_type, start = ctx
        op, pg_i, t_i, kind, peer_i, red_i, coalesced = _OPS[opname]
        cid, _ = self._group(args[pg_i], device_type, start)
        count, dt = _count(args, t_i, kind, args[pg_i])
        flags = _ring.F_COALESCED if coalesced and _list_len(args, t_i) > 1 else 0
        if error:
            flags |= _ring.F_ERROR
        if is_async:
            flags |= _ring.F_ASYNC
        w.append(_ring.OP[op], comm_id=cid, count=count,
                 nbytes=count * _ring.DATATYPE_SIZES[dt], start_ns=start, end_ns=end,
                 peer=int(args[peer_i]) if peer_i is not None and peer_i < len(args) else -1,
                 datatype=dt,
                 redop=_redop(args[red_i]) if red_i is not None and red_i < len(args) else 0,
                 flags=flags, status=1 if error else 0)


def _env_int(env: dict[str, str], names: tuple, default: int) -> int:
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

    def work_unbox(self, work: Any) -> Any:
        return work if type(work) is self.work_cls else self.work_cls.unbox(work)

    def pg(self, obj: Any) -> Any:
        """The ProcessGroup of a dispatcher argument (a boxed TorchScript
        object there; a ProcessGroup when called directly)."""
        return self.pg_cls.unbox(obj) if type(obj) is self.script_object else obj


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
        below = torch._C._after_autograd_keyset
        for key, device in (("AutogradCPU", "cpu"), ("AutogradCUDA", "cuda")):
            for name in _OPS:
                packet = getattr(torch.ops.c10d, name, None)
                if packet is None:
                    continue  # not in this torch version
                lib.impl(name, _kernel(rec, name, packet.default, below, device), key,
                         with_keyset=True)
    except Exception as exc:
        _warn(f"cannot hook torch.distributed: {exc!r}")
        return False
    # the registrations live as long as the Library object
    _state["lib"] = lib
    if "recorder" not in _state:
        _state["recorder"] = rec
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=rec.forked)
    return True


def unpatch() -> None:
    """Remove the recording kernels again (the job continues unhooked);
    patch() puts them back. The ring stays open for a later patch()."""
    lib = _state.pop("lib", None)
    if lib is not None:
        lib._destroy()


def _kernel(rec: Recorder, name: str, op: Any, below: Any, device: str) -> Callable:
    # the OpOverload's own redispatch is one Python frame around this
    handle = getattr(op, "_handle", None)
    redispatch = getattr(handle, "redispatch_boxed", None) or op.redispatch

    def kernel(keyset: Any, *args: Any) -> Any:
        if not rec.enabled:
            return redispatch(keyset & below, *args)
        try:
            ctx = rec.before(name, args, device)
        except Exception as exc:
            rec._fail(f"recording failed: {exc!r}")
            ctx = None
        if ctx is None:
            return redispatch(keyset & below, *args)
        try:
            out = redispatch(keyset & below, *args)
        except BaseException:
            try:
                rec.after(ctx, None, error=True)
            except Exception:
                pass
            raise
        try:
            rec.after(ctx, out)
        except Exception as exc:
            rec._fail(f"recording failed: {exc!r}")
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


def install(env: dict[str, str] | None = None) -> bool:
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
