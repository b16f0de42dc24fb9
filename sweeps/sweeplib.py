"""Measurement code shared by node_sweep.py and pair_sweep.py.

Two paths with one result schema (slurmguard.sweeps.result):

* GPU: torch.cuda. GEMMs timed with CUDA events, device-to-device copies for memory
  bandwidth, tensor copies between devices (cudaMemcpyPeer underneath) for the pairwise
  matrix, torch.distributed with NCCL for all-reduce and send/recv, one process per GPU.
* CPU: the same code on torch CPU tensors, gloo over TCP between processes; each CPU
  "device" is a set of buffers in host memory (1 by default, --cpu-devices N for more).

Fault injection (slurmguard.sweeps.inject) is a test/demo facility: it adds sleeps inside
the timed regions of the node it names and is recorded in the result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from slurmguard.config import SweepPolicy, load_policy
from slurmguard.errors import SlurmguardError
from slurmguard.sweeps.inject import NodeFault, extra_delay, load_faults
from slurmguard.sweeps.result import GEMM_DTYPES, SCHEMA_NAME, SCHEMA_VERSION, ResultError, parse_result

MIB = 1 << 20
NO_FAULT = NodeFault()

_TORCH_DTYPES = {"float32": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


# ---------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    device: str
    gemm_duration_s: float
    gemm_dtypes: tuple[str, ...]
    gemm_size: int
    membw_bytes: int
    message_sizes_mb: tuple[int, ...]
    repeats: int
    comm_timeout_s: float

    def to_schema(self) -> dict[str, Any]:
        return {"gemm_duration_s": self.gemm_duration_s, "gemm_dtypes": list(self.gemm_dtypes),
                "gemm_size": self.gemm_size, "membw_bytes": self.membw_bytes,
                "message_sizes_mb": list(self.message_sizes_mb), "repeats": self.repeats}


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="result JSON path (written atomically)")
    p.add_argument("--policy", default=None, help="policies.yaml (default: slurmguard lookup order)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=None)
    p.add_argument("--duration", type=float, default=None, help="GEMM seconds per dtype")
    p.add_argument("--gemm-size", type=int, default=None, help="square GEMM edge (elements)")
    p.add_argument("--dtypes", default=None, help="comma-separated GEMM dtypes")
    p.add_argument("--membw-bytes", type=int, default=None)
    p.add_argument("--message-sizes-mb", default=None, help="comma-separated MiB sizes")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--comm-timeout", type=float, default=None, help="seconds")
    p.add_argument("--cpu-devices", type=int, default=1, help="CPU path: logical devices per node")
    p.add_argument("--threads", type=int, default=None, help="CPU path: torch threads")
    p.add_argument("--node", default=None, help="node name (default $SLURMD_NODENAME, hostname)")
    p.add_argument("--hw-class", default=None, help="hardware class (default: device name x count)")


def settings_from(args: argparse.Namespace) -> Settings:
    """Policy values (slurmguard.config) with command-line overrides for tests."""
    pol: SweepPolicy = load_policy(args.policy).sweeps

    def ints(text: str | None, default: Sequence[int], what: str) -> tuple[int, ...]:
        if text is None:
            return tuple(default)
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise SlurmguardError(f"--{what}: expected comma-separated integers, got {text!r}") from None
        if not vals or min(vals) < 1:
            raise SlurmguardError(f"--{what}: expected positive integers, got {text!r}")
        return vals

    dtypes = tuple(pol.gemm_dtypes) if args.dtypes is None else tuple(
        d.strip() for d in args.dtypes.split(",") if d.strip())
    for d in dtypes:
        if d not in GEMM_DTYPES:
            raise SlurmguardError(f"unknown GEMM dtype {d!r} (known: {', '.join(GEMM_DTYPES)})")
    s = Settings(
        device=args.device or pol.device,
        gemm_duration_s=pol.gemm_duration_s if args.duration is None else args.duration,
        gemm_dtypes=dtypes,
        gemm_size=pol.gemm_size if args.gemm_size is None else args.gemm_size,
        membw_bytes=pol.membw_bytes if args.membw_bytes is None else args.membw_bytes,
        message_sizes_mb=ints(args.message_sizes_mb, pol.message_sizes_mb, "message-sizes-mb"),
        repeats=pol.repeats if args.repeats is None else args.repeats,
        comm_timeout_s=pol.comm_timeout_s if args.comm_timeout is None else args.comm_timeout,
    )
    if s.gemm_duration_s <= 0 or s.gemm_size < 1 or s.membw_bytes < 4 or s.repeats < 1:
        raise SlurmguardError("--duration, --gemm-size, --membw-bytes and --repeats must be positive")
    if args.cpu_devices < 1:
        raise SlurmguardError("--cpu-devices must be at least 1")
    return s


def pick_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda"
    if requested == "cuda":
        raise SlurmguardError("--device cuda: no CUDA device is visible to this process")
    return "cpu"


def node_name(override: str | None) -> str:
    return override or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def device_inventory(device: str, cpu_devices: int) -> tuple[str, int]:
    """(device model name, devices per node)."""
    if device == "cuda":
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    model = platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu {model}"[:128], cpu_devices


def default_hw_class(device_name: str, count: int) -> str:
    return f"{device_name} x{count}"[:128]


def torch_devices(device: str, count: int) -> list[torch.device]:
    if device == "cuda":
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu") for _ in range(count)]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def fault_for(node: str) -> tuple[NodeFault, dict[str, Any] | None]:
    """This node's injected faults (NO_FAULT when none) and the dict recorded in the result."""
    faults = load_faults()
    f = faults.get(node)
    return (f or NO_FAULT), ({node: f.to_dict()} if f is not None else None)


def apply_start_faults(fault: NodeFault) -> None:
    if fault.hang_s > 0:
        time.sleep(fault.hang_s)
    if fault.crash:
        print("slurmguard sweep: injected crash", file=sys.stderr, flush=True)
        os._exit(3)


def err(where: str, exc: BaseException) -> dict[str, str]:
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    traceback.print_exc(file=sys.stderr)
    return {"where": where, "message": msg[:1000]}


# ---------------------------------------------------------------- GEMM
def gemm_all(devs: Sequence[torch.device], dtype: str, size: int, duration_s: float,
             slowdowns: Sequence[float]) -> list[dict[str, Any]]:
    """Sustained GEMM throughput of every device, TFLOP/s.

    CUDA devices run concurrently (the node under full load, as in training, so power
    and thermal limits show); CPU devices run one after another (they share the cores).
    Each runs for `duration_s`: sustained = FLOPs / time over the second half (thermal
    steady state), initial = the first timing window.
    """
    if devs and devs[0].type == "cuda":
        return _gemm_group(list(devs), dtype, size, duration_s, list(slowdowns))
    out = []
    for dev, s in zip(devs, slowdowns):
        out.extend(_gemm_group([dev], dtype, size, duration_s, [s]))
    return out


def _gemm_group(devs: list[torch.device], dtype: str, size: int, duration_s: float,
                slowdowns: list[float]) -> list[dict[str, Any]]:
    cuda = devs[0].type == "cuda"
    tdt = _TORCH_DTYPES[dtype]
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    # float32 means true FP32; tf32 is asked for explicitly
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        torch.manual_seed(1234)
        mats = []
        for dev in devs:
            # generated in place: an 8192^2 matrix made on the host and copied costs seconds
            a = torch.randn(size, size, device=dev, dtype=tdt)
            b = torch.randn(size, size, device=dev, dtype=tdt)
            c = torch.empty(size, size, device=dev, dtype=tdt)
            mats.append((a, b, c))
        flop = 2.0 * size ** 3

        def run_window(batch: int) -> list[float]:
            """Enqueue `batch` GEMMs on every device; seconds each device took."""
            if cuda:
                evs = []
                for dev, (a, b, c) in zip(devs, mats):
                    with torch.cuda.device(dev):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(batch):
                            torch.matmul(a, b, out=c)
                        e.record()
                        evs.append((s, e))
                res = []
                for s, e in evs:
                    e.synchronize()
                    res.append(s.elapsed_time(e) / 1000.0)
                return res
            a, b, c = mats[0]
            t0 = time.perf_counter()
            for _ in range(batch):
                torch.matmul(a, b, out=c)
            return [time.perf_counter() - t0]

        run_window(1)  # warm-up: kernel selection, clocks up
        one = max(run_window(1))
        window_s = min(5.0, max(0.02, duration_s / 20.0))
        batch = max(1, int(window_s / max(one, 1e-6)))
        windows: list[list[tuple[float, float]]] = [[] for _ in devs]  # (end offset, seconds)
        start = time.monotonic()
        while True:
            times = run_window(batch)
            extras = [extra_delay(t, s) for t, s in zip(times, slowdowns)]
            if max(extras) > 0:
                time.sleep(max(extras))
            now = time.monotonic() - start
            for i, (t, x) in enumerate(zip(times, extras)):
                windows[i].append((now, t + x))
            if now >= duration_s:
                break
        out = []
        for w in windows:
            steady = [t for end, t in w if end >= duration_s / 2] or [t for _, t in w]
            n_steady = len(steady)
            out.append({"dtype": dtype,
                        "tflops": n_steady * batch * flop / sum(steady) / 1e12,
                        "tflops_initial": batch * flop / w[0][1] / 1e12,
                        "iterations": len(w) * batch,
                        "seconds": sum(t for _, t in w)})
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


# ---------------------------------------------------------------- memory bandwidth
def _timed(fn: Callable[[], None], dev: torch.device, inner: int) -> float:
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(inner):
                fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1000.0
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def _inner_count(fn: Callable[[], None], dev: torch.device, target_s: float = 0.01) -> int:
    fn()
    sync(dev)
    one = _timed(fn, dev, 1)
    return max(1, min(1000, int(target_s / max(one, 1e-7))))


def membw(dev: torch.device, nbytes: int, repeats: int, slowdown: float) -> float:
    """Device memory bandwidth, GB/s, counting bytes read plus bytes written of a copy."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    inner = _inner_count(copy, dev)
    times = []
    for _ in range(repeats):
        t = _timed(copy, dev, inner)
        x = extra_delay(t, slowdown)
        if x:
            time.sleep(x)
        times.append((t + x) / inner)
    return 2.0 * n * 4 / statistics.median(times) / 1e9


def p2p_matrix(devs: Sequence[torch.device], node: str, nbytes: int, repeats: int,
               fault: NodeFault) -> list[dict[str, Any]]:
    """Directed copy bandwidth between every pair of devices of the node, GB/s.

    Reports each pair's asymmetry with its reverse and its deviation from the node's
    median pair, so a degraded NVLink or a PCIe detour is visible per pair.
    """
    n = max(1, nbytes // 4)
    g = len(devs)
    bw: dict[tuple[int, int], float] = {}
    bufs = [torch.ones(n, dtype=torch.float32, device=d) for d in devs]
    dsts = [torch.empty(n, dtype=torch.float32, device=d) for d in devs]
    for i in range(g):
        for j in range(g):
            if i == j:
                continue
            def timed(inner: int, src: torch.Tensor = bufs[i], dst: torch.Tensor = dsts[j],
                      a: torch.device = devs[i], b: torch.device = devs[j]) -> float:
                # host clock around both devices' syncs: a peer copy involves two GPUs
                sync(a), sync(b)
                t0 = time.perf_counter()
                for _ in range(inner):
                    dst.copy_(src, non_blocking=True)
                sync(a), sync(b)
                return time.perf_counter() - t0

            timed(1)
            inner = max(1, min(1000, int(0.01 / max(timed(1), 1e-7))))
            slow = fault.p2p_slowdown if (fault.hits_gpu(i) or fault.hits_gpu(j)) else 0.0
            times = []
            for _ in range(repeats):
                t = timed(inner)
                x = extra_delay(t, slow)
                if x:
                    time.sleep(x)
                times.append((t + x) / inner)
            bw[(i, j)] = n * 4 / statistics.median(times) / 1e9
    if not bw:
        return []
    med = statistics.median(bw.values())
    out = []
    for (i, j), v in sorted(bw.items()):
        rev = bw[(j, i)]
        out.append({"node": node, "src": i, "dst": j, "gbps": v,
                    "asymmetry": abs(v - rev) / max(v, rev) if max(v, rev) > 0 else 0.0,
                    "vs_node_median": v / med - 1.0 if med > 0 else 0.0})
    return out


# ---------------------------------------------------------------- torch.distributed
@dataclass(frozen=True)
class WorkerSpec:
    """Everything one distributed worker process needs (picklable for spawn)."""

    task: str  # "allreduce_intra" | "passes"
    backend: str
    store_host: str
    store_port: int
    rank: int
    world: int
    device: str
    local_index: int
    node_rank: int
    gpus_per_node: int
    settings: Settings
    fault: NodeFault
    node_names: tuple[str, ...] = ()
    schedules: tuple[tuple[str, tuple[tuple[tuple[int, int], ...], ...]], ...] = ()


def worker_device(spec: WorkerSpec) -> torch.device:
    if spec.device == "cuda":
        torch.cuda.set_device(spec.local_index)
        return torch.device("cuda", spec.local_index)
    return torch.device("cpu")


def init_group(spec: WorkerSpec, store: Any | None = None) -> torch.device:
    """Join the sweep's process group (NCCL on GPU, gloo on CPU) through the TCP store."""
    dev = worker_device(spec)
    timeout = datetime.timedelta(seconds=spec.settings.comm_timeout_s)
    if store is None:
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
    kw: dict[str, Any] = {}
    if spec.backend == "nccl":
        kw["device_id"] = dev
    dist.init_process_group(spec.backend, store=dist.PrefixStore(f"pg/{spec.task}", store),
                            rank=spec.rank, world_size=spec.world, timeout=timeout, **kw)
    return dev


def _barrier(dev: torch.device) -> None:
    # a tiny all-reduce is a barrier on both backends and needs no extra communicator
    t = torch.zeros(1, device=dev)
    dist.all_reduce(t)
    sync(dev)


def allreduce_bench(dev: torch.device, sizes_mb: Sequence[int], repeats: int, slow: float,
                    scope: str) -> list[dict[str, Any]]:
    """All-reduce bus bandwidth per message size (same numbers on every rank).

    time = median over repeats of the slowest rank; algbw = bytes / time;
    busbw = algbw * 2(n-1)/n (nccl-tests' convention for ring all-reduce).
    """
    n = dist.get_world_size()
    out = []
    for size in sizes_mb:
        buf = torch.ones(size * MIB // 4, dtype=torch.float32, device=dev)
        dist.all_reduce(buf)  # warm-up: connections, NCCL channels
        sync(dev)
        times = []
        for _ in range(repeats):
            _barrier(dev)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync(dev)
            t = time.perf_counter() - t0
            x = extra_delay(t, slow)
            if x:
                time.sleep(x)
            tt = torch.tensor([t + x], dtype=torch.float64, device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            times.append(float(tt.item()))
        t_med = statistics.median(times)
        algbw = size * MIB / t_med / 1e9
        out.append({"scope": scope, "size_mb": size, "ranks": n, "time_s": t_med,
                    "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n})
    return out


def passes_bench(spec: WorkerSpec, dev: torch.device) -> list[dict[str, Any]]:
    """Send/recv of every scheduled link, one pass at a time, all rails of a pass at once.

    Link (a -> b) on rail g is global rank a*G+g sending to b*G+g. Each endpoint times
    its own side; a link's time is the max of both sides, median over repeats. Two
    untimed warm-up rounds open the connections. Returns the transfers on rank 0.

    An injected link slowdown (tests/demo) must delay the transfer itself, not only the
    throttled side's clock: a throttled sender sleeps before sending, a throttled
    receiver after receiving, by the slowdown of the link's last un-throttled time.
    """
    G, world, rank = spec.gpus_per_node, dist.get_world_size(), dist.get_rank()
    warmup = 2
    out = []
    for sched, passes in spec.schedules:
        for size in spec.settings.message_sizes_mb:
            buf = torch.ones(size * MIB // 4, dtype=torch.float32, device=dev)
            samples: list[list[torch.Tensor]] = [[] for _ in passes]
            real_est: dict[int, float] = {}
            for rep in range(spec.settings.repeats + warmup):
                for p_i, links in enumerate(passes):
                    role, peer = None, -1
                    for s, d in links:
                        if s == spec.node_rank:
                            role, peer = "send", d * G + spec.local_index
                        elif d == spec.node_rank:
                            role, peer = "recv", s * G + spec.local_index
                    x = 0.0
                    if role is not None and rep >= warmup - 1 and p_i in real_est:
                        x = extra_delay(real_est[p_i], spec.fault.link_factor(role == "send"))
                    _barrier(dev)
                    t = 0.0
                    if role is not None:
                        t0 = time.perf_counter()
                        if role == "send":
                            if x:
                                time.sleep(x)
                            dist.send(buf, peer)
                            sync(dev)
                        else:
                            dist.recv(buf, peer)
                            sync(dev)
                            if x:
                                time.sleep(x)
                        t = time.perf_counter() - t0
                    vec = torch.zeros(world, dtype=torch.float64, device=dev)
                    vec[rank] = t
                    dist.all_reduce(vec)  # gather everyone's time
                    host = vec.cpu()
                    if role is not None:
                        link_t = max(float(host[rank]), float(host[peer]))
                        real_est[p_i] = max(link_t - x, 1e-7)
                    if rep >= warmup:
                        samples[p_i].append(host)
            if rank != 0:
                continue
            for p_i, links in enumerate(passes):
                for s, d in links:
                    for g in range(G):
                        ts = [max(float(v[s * G + g]), float(v[d * G + g])) for v in samples[p_i]]
                        t_med = statistics.median(ts)
                        out.append({"schedule": sched, "pass_index": p_i,
                                    "src_node": spec.node_names[s], "src_gpu": g,
                                    "dst_node": spec.node_names[d], "dst_gpu": g, "size_mb": size,
                                    "time_s": t_med, "gbps": size * MIB / t_med / 1e9})
    return out


def run_worker(spec: WorkerSpec, store: Any | None = None) -> dict[str, Any]:
    """Run one worker's task; returns {"data": ..., "errors": [...]} (data on rank 0)."""
    errors: list[dict[str, str]] = []
    data: Any = None
    try:
        dev = init_group(spec, store)
        try:
            if spec.task == "allreduce_intra":
                slow = spec.fault.p2p_slowdown if spec.fault.hits_gpu(spec.local_index) else 0.0
                data = allreduce_bench(dev, spec.settings.message_sizes_mb, spec.settings.repeats,
                                       slow, "intra")
            elif spec.task == "passes":
                data = {"transfers": passes_bench(spec, dev),
                        "allreduce": allreduce_bench(
                            dev, spec.settings.message_sizes_mb, spec.settings.repeats,
                            max(spec.fault.link_factor(True), spec.fault.link_factor(False)), "cross")}
            else:
                raise ValueError(f"unknown task {spec.task}")
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # recorded in the result: a failed measurement fails the sweep
        errors.append(err(f"{spec.task} rank {spec.rank}", exc))
    return {"data": data if spec.rank == 0 else None, "errors": errors}


def _spawn_target(spec: WorkerSpec, queue: Any) -> None:
    if spec.device == "cpu":
        torch.set_num_threads(1)
    queue.put((spec.local_index, run_worker(spec)))


def run_local_workers(specs: Sequence[WorkerSpec], timeout_s: float) -> list[dict[str, Any]]:
    """Run one process per local device (spawned: CUDA and fork do not mix)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawn_target, args=(s, queue), daemon=True) for s in specs]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(specs):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                idx, res = queue.get(timeout=min(left, 1.0))
                results[idx] = res
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    out = []
    for s, p in zip(specs, procs):
        out.append(results.get(s.local_index) or {"data": None, "errors": [
            {"where": f"{s.task} rank {s.rank}",
             "message": f"worker exited with code {p.exitcode} without a result"}]})
    return out


# ---------------------------------------------------------------- result
def build_result(**kw: Any) -> dict[str, Any]:
    doc = {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION}
    doc.update(kw)
    return doc


def write_result(path: str, doc: dict[str, Any], fault: NodeFault) -> bool:
    """Validate and write atomically. Returns False when the document is invalid (a bug)."""
    text = json.dumps(doc, indent=1)
    ok = True
    try:
        parse_result(json.loads(text), path)
    except ResultError as exc:
        print(f"slurmguard sweep: invalid result: {exc}", file=sys.stderr)
        ok = False
    if fault.corrupt_output:
        text = text[: len(text) // 2]
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return ok


def now() -> float:
    return time.time()


def main_guard(fn: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """User mistakes (bad policy, bad options) are one line on stderr and exit 2."""
    try:
        return fn(argv)
    except SlurmguardError as exc:
        print(f"slurmguard sweep: error: {exc}", file=sys.stderr)
        return 2

