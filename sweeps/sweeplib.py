"""Measurement code shared by node_sweep.py and pair_sweep.py.

Two paths with one result schema (slurmguard.sweeps.result):

* GPU: torch.cuda, one process per GPU for every phase, so all GPUs of the node run at
  once (full-node power and thermal limits show, as in training); the GEMM phases start on
  a shared barrier. GEMMs timed with CUDA events, each window's last product checked
  against a float64 reference (Freivalds' test: a wrong answer is silent data
  corruption and fails the sweep); device-to-device copies for memory bandwidth; tensor
  copies between devices (cudaMemcpyPeer underneath) for the pairwise matrix;
  torch.distributed with NCCL for all-reduce and send/recv, `comm_iters` back-to-back
  operations timed with CUDA events after `comm_warmup` untimed ones. Clocks, power,
  temperature and throttle reasons are sampled through NVML during the device phases
  (slurmguard.telemetry.nvml) and kept per GPU in the result.
* CPU: the same code on torch CPU tensors, gloo over TCP between processes; each CPU
  "device" is a set of buffers in host memory (1 by default, --cpu-devices N for more),
  measured one after another in this process (they share the cores); throughput is work
  over wall time, and the cgroup's CPU throttling during the run is kept as telemetry.

Bus bandwidth as nccl-tests computes it: algbw = bytes / time per operation; all-reduce
busbw = algbw * 2(n-1)/n; a send/recv moves `bytes` once (busbw = algbw).

Every timed region goes through one of two timers: `timed_ops` (operations on one device:
GEMM windows, copies, collectives, send/recv) or `timed_copy` (copies between two devices).
Nothing here can be told to measure a node as slower than it is; the development tools
slow a node from outside (slurmguard_dev.sweepfaults wraps these functions in its own
launcher), so this module has no notion of a fault.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurmguard.config import SweepPolicy, load_policy
from slurmguard.errors import SlurmguardError
from slurmguard.sweeps.result import (
    GEMM_DTYPES,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    ResultError,
    SweepSettings,
    parse_result,
)

MIB = 1 << 20


_TORCH_DTYPES = {
    "float32": torch.float32,
    "tf32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings(SweepSettings):
    """The recorded settings (slurmguard.sweeps.result.SweepSettings) plus the run-only ones."""

    device: str
    comm_timeout_s: float
    comm_iters: int = 20
    comm_warmup: int = 5
    telemetry_interval_s: float = 1.0


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
    p.add_argument("--comm-iters", type=int, default=None, help="back-to-back collectives per timing")
    p.add_argument("--comm-warmup", type=int, default=None, help="untimed collectives first")
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

    dtypes = (
        tuple(pol.gemm_dtypes)
        if args.dtypes is None
        else tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    )
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
        comm_iters=pol.comm_iters if args.comm_iters is None else args.comm_iters,
        comm_warmup=pol.comm_warmup if args.comm_warmup is None else args.comm_warmup,
        telemetry_interval_s=pol.telemetry_interval_s,
    )
    if s.gemm_duration_s <= 0 or s.gemm_size < 1 or s.membw_bytes < 4 or s.repeats < 1:
        raise SlurmguardError("--duration, --gemm-size, --membw-bytes and --repeats must be positive")
    if s.comm_iters < 1 or s.comm_warmup < 0:
        raise SlurmguardError("--comm-iters must be at least 1 and --comm-warmup at least 0")
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


def timed_ops(op: Callable[[], object], dev: torch.device, iters: int) -> float:
    """Seconds for `iters` back-to-back operations on `dev`: CUDA events on its current
    stream on GPU (NCCL work is ordered against it, so collectives are timed alike); on
    CPU the CPU time this process spent on them (all its threads; a gloo collective's
    wait for its peer is not CPU time). Every timed region of one device goes through
    here (GEMM, memory bandwidth, collectives).

    Why CPU time on CPU: a CPU "device" is a share of a host that other processes use
    too (the development cluster runs every emulated node on one machine), and wall
    time would count their work as this device's slowness. A node whose CPU is capped
    is caught by its cgroup's throttling counters, sampled during the run
    (`throttle_fail_reasons`: cpu_quota), not by a lower rate."""
    if dev.type == "cuda":
        with torch.cuda.device(dev):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(iters):
                op()
            en.record()
            en.synchronize()
            return st.elapsed_time(en) / 1000.0
    t0 = time.process_time()
    for _ in range(iters):
        op()
    return time.process_time() - t0


def err(where: str, exc: BaseException) -> dict[str, str]:
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    traceback.print_exc(file=sys.stderr)
    return {"where": where, "message": msg[:1000]}


# ---------------------------------------------------------------- GEMM
#: Unit roundoff of each dtype's result (float32: times sqrt(k) for the accumulation, set
#: in verify_gemm); tf32 rounds inputs to 10 mantissa bits.
VERIFY_UNIT = {"float32": 2.0**-24, "tf32": 2.0**-10, "bfloat16": 2.0**-8, "float16": 2.0**-11}
VERIFY_K = 16.0
"""A row's rounding error is a sum of k independent roundings (standard deviation about
u/(2 sqrt 3) |C_i|); 16 u |C_i| is far outside it (no false alarm), while a flipped
exponent or high mantissa bit of one element is far above it."""
_VERIFY_ROWS = 1024


def _rows_matvec(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """m @ v in float64, a block of rows at a time (no full float64 copy of m)."""
    out = torch.empty(m.shape[0], dtype=torch.float64, device=m.device)
    for i in range(0, m.shape[0], _VERIFY_ROWS):
        out[i : i + _VERIFY_ROWS] = m[i : i + _VERIFY_ROWS].to(torch.float64) @ v
    return out


def _row_norms(m: torch.Tensor) -> torch.Tensor:
    out = torch.empty(m.shape[0], dtype=torch.float64, device=m.device)
    for i in range(0, m.shape[0], _VERIFY_ROWS):
        out[i : i + _VERIFY_ROWS] = torch.linalg.vector_norm(m[i : i + _VERIFY_ROWS].to(torch.float64), dim=1)
    return out


def verify_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dtype: str, seed: int) -> float:
    """Freivalds' test of c = a @ b against a float64 reference: O(n^2), not O(n^3).

    With a random +-1 vector r: compares c r with a (b r), both in float64, row by row,
    against the rounding bound VERIFY_K * u * |c_i| (u: VERIFY_UNIT, for float32 scaled by
    sqrt(k) for the accumulation). Returns the largest error as a multiple of its bound:
    <= 1 is a correct product, > 1 (or inf for NaN/Inf) a wrong one.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = (torch.randint(0, 2, (c.shape[1],), generator=gen, dtype=torch.float64) * 2 - 1).to(c.device)
    ref = _rows_matvec(a, _rows_matvec(b, r))
    got = _rows_matvec(c, r)
    if not bool(torch.isfinite(got).all()):
        return math.inf
    k = a.shape[1]
    u = VERIFY_UNIT[dtype] * (math.sqrt(k) if dtype == "float32" else 1.0)
    bound = VERIFY_K * u * _row_norms(c) + 1e-300
    return float(((got - ref).abs() / bound).max())


def gemm_run(
    dev: torch.device,
    dtype: str,
    size: int,
    duration_s: float,
    *,
    seed: int = 0,
    align: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Sustained GEMM throughput of one device, TFLOP/s, with the results verified.

    Runs for `duration_s` in timing windows of about duration/20 (0.02-5 s); sustained =
    FLOPs / time over the second half (thermal steady state), initial = the first window.
    Window time from `timed_ops`: CUDA events on GPU (the GPU's own busy time), the
    process's CPU time on CPU, so other work on a shared host does not count against
    the device, and a CPU quota shows in the throttling the sweep samples. `align` (a
    barrier) starts every GPU of the node together. The last product of every window is
    verified (verify_gemm), outside the timed region.
    """
    tdt = _TORCH_DTYPES[dtype]
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    # float32 means true FP32; tf32 is asked for explicitly
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        gen = torch.Generator(device=dev).manual_seed(1234 + seed)
        # generated in place: an 8192^2 matrix made on the host and copied costs seconds
        a = torch.randn(size, size, device=dev, dtype=tdt, generator=gen)
        b = torch.randn(size, size, device=dev, dtype=tdt, generator=gen)
        c = torch.empty(size, size, device=dev, dtype=tdt)
        flop = 2.0 * size**3
        matmul = functools.partial(torch.matmul, a, b, out=c)

        timed_ops(matmul, dev, 1)  # warm-up: kernel selection, clocks up
        one = timed_ops(matmul, dev, 1)
        window_s = min(5.0, max(0.02, duration_s / 20.0))
        batch = max(1, int(window_s / max(one, 1e-6)))
        if align is not None:
            align()
        windows: list[tuple[float, float, float]] = []  # (start offset, end offset, seconds)
        worst, checks = 0.0, 0
        start = time.monotonic()
        while True:
            w0 = time.monotonic() - start
            t = timed_ops(matmul, dev, batch)
            now = time.monotonic() - start
            c0 = time.monotonic()
            worst = max(worst, verify_gemm(a, b, c, dtype, seed))
            checks += 1
            spent = time.monotonic() - c0
            windows.append((w0, now, t))
            start += spent  # the check is not part of the measured run
            if now >= duration_s:
                break
        steady = [w for w in windows if w[1] >= duration_s / 2] or windows
        busy = sum(w[2] for w in steady)
        return {
            "dtype": dtype,
            "tflops": len(steady) * batch * flop / busy / 1e12,
            "tflops_initial": batch * flop / windows[0][2] / 1e12,
            "iterations": len(windows) * batch,
            "seconds": sum(w[2] for w in windows),
            "checks": checks,
            "max_error": worst if math.isfinite(worst) else 1e300,
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def device_phase(
    dev: torch.device,
    index: int,
    settings: Settings,
    align: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Everything measured on one device alone: GEMM per dtype (verified), memory bandwidth.

    Returns {"gemm": [...], "membw_gbps": float | None, "errors": [...]}; a wrong GEMM
    result is an error record ("wrong result (silent data corruption)"), so it fails the
    sweep with the error's size as evidence.
    """
    out: dict[str, Any] = {"gemm": [], "membw_gbps": None, "errors": []}
    for dtype in settings.gemm_dtypes:
        try:
            g = gemm_run(
                dev,
                dtype,
                settings.gemm_size,
                settings.gemm_duration_s,
                seed=index,
                align=align,
            )
            out["gemm"].append(g)
            if g["max_error"] > 1.0:
                out["errors"].append(
                    {
                        "where": f"gemm {dtype} gpu{index}",
                        "message": (
                            f"wrong result (silent data corruption): error {g['max_error']:.3g} x the rounding"
                            f" bound against a float64 reference ({g['checks']} products checked)"
                        ),
                    }
                )
        except Exception as exc:  # a failed kernel is evidence, recorded and failed on
            out["errors"].append(err(f"gemm {dtype} gpu{index}", exc))
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    try:
        if align is not None:
            align()
        out["membw_gbps"] = membw(dev, settings.membw_bytes, settings.repeats)
    except Exception as exc:
        out["errors"].append(err(f"membw gpu{index}", exc))
    return out


# ---------------------------------------------------------------- telemetry during the run
#: NVML clocks-event (throttle) reason bits, nvml.h nvmlClocksEventReason*.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit] + (
        [f"unknown_0x{mask & ~sum(THROTTLE_BITS):x}"] if mask & ~sum(THROTTLE_BITS) else []
    )


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


class RunTelemetry:
    """Samples the node while the device phases run (a thread in the sweep's main process).

    GPU: slurmguard.telemetry.nvml.NvmlSource every `interval_s`: SM clock, power,
    temperature and the throttle-reason bitmask per GPU. CPU: the cgroup's CPU throttling
    (cpu.stat nr_throttled / throttled time) over the run, which is what a CPU quota or a
    shared host does to the CPU path. Never raises: a source that cannot be read is
    recorded as {"source": "none", "error": ...}.
    """

    def __init__(
        self, device: str, node: str, count: int, interval_s: float, nvml: Any | None = None
    ) -> None:
        self.device, self.node, self.count, self.interval = device, node, count, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: dict[tuple[int, str], list[float]] = {}
        self._error: str | None = None
        self._src: Any = None
        self._nvml = nvml
        self._cg_start: dict[str, float] | None = None
        self._t0 = 0.0

    def start(self) -> RunTelemetry:
        self._t0 = time.monotonic()
        if self.device == "cuda":
            try:
                from slurmguard.telemetry.nvml import NvmlSource

                self._src = NvmlSource(self.node, self._nvml)
            except Exception as exc:  # pynvml missing, no driver: recorded, not fatal
                self._error = f"NVML unavailable: {type(exc).__name__}: {exc}"
                return self
            self._thread = threading.Thread(target=self._loop, name="sweep-telemetry", daemon=True)
            self._thread.start()
        else:
            self._cg_start = cgroup_cpu_stat()
        return self

    def _loop(self) -> None:
        from slurmguard.telemetry.base import Signal

        want = {
            Signal.SM_CLOCK: "sm_clock_mhz",
            Signal.POWER: "power_w",
            Signal.GPU_TEMP: "temperature_c",
            Signal.THROTTLE_REASONS: "throttle",
        }
        while True:
            try:
                reading = self._src.sample()
                for smp in reading.samples:
                    if smp.gpu is not None and smp.signal in want:
                        self._samples.setdefault((smp.gpu, want[smp.signal]), []).append(smp.value)
                for ev in reading.events:
                    if ev.kind in ("error", "timeout") and self._error is None:
                        self._error = f"{ev.kind}: {ev.detail}"
            except Exception as exc:
                self._error = f"{type(exc).__name__}: {exc}"
            if self._stop.wait(self.interval):
                return

    def stop(self) -> list[dict[str, Any]]:
        """Per-device telemetry records (result schema DeviceMetrics.telemetry)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 10)
        if self._src is not None:
            try:
                self._src.close()
            except Exception:
                pass
        out = []
        for i in range(self.count):
            if self.device == "cuda":
                t: dict[str, Any] = {
                    "source": "nvml" if self._src is not None else "none",
                    "samples": len(self._samples.get((i, "sm_clock_mhz"), [])),
                }
                for key in ("sm_clock_mhz", "power_w", "temperature_c"):
                    st = _stats(self._samples.get((i, key), []))
                    if st is not None:
                        t[key] = st
                masks = self._samples.get((i, "throttle"), [])
                if masks:
                    count: dict[str, int] = {}
                    for m in masks:
                        for n in throttle_names(int(m)):
                            count[n] = count.get(n, 0) + 1
                    t["throttle_reasons"] = list(count)
                    t["throttle_share"] = {n: k / len(masks) for n, k in count.items()}
            else:
                end = cgroup_cpu_stat()
                if self._cg_start is not None and end is not None:
                    t = {
                        "source": "cgroup",
                        "samples": 2,
                        "throttled_s": max(0.0, end["throttled_s"] - self._cg_start["throttled_s"]),
                    }
                    periods = end["nr_periods"] - self._cg_start["nr_periods"]
                    throttled = end["nr_throttled"] - self._cg_start["nr_throttled"]
                    if throttled > 0:
                        t["throttle_reasons"] = ["cpu_quota"]
                        t["throttle_share"] = {"cpu_quota": throttled / max(periods, 1.0)}
                else:
                    t = {"source": "none", "samples": 0, "error": "no cgroup cpu.stat for this process"}
            if self._error and t.get("samples", 0) == 0:
                t["error"] = self._error[:500]
            out.append(t)
        return out


def cgroup_cpu_stat(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> dict[str, float] | None:
    """This process's cgroup CPU throttling: {"nr_periods", "nr_throttled", "throttled_s"}.

    cgroup v1: <root>/cpu/<path>/cpu.stat (throttled_time, ns); v2: <root>/<path>/cpu.stat
    (throttled_usec). The cap may sit on an ancestor: the deepest group with periods counted
    is used. None when nothing can be read.
    """
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "cpu" in parts[1].split(","):
            paths.append(os.path.join(root, "cpu", parts[2].lstrip("/")))
        elif parts[0] == "0" and parts[1] == "":
            paths.append(os.path.join(root, parts[2].lstrip("/")))
    first = None
    for base in paths:
        d = base
        while True:
            st = _read_cpu_stat(os.path.join(d, "cpu.stat"))
            if st is not None and st["nr_periods"] > 0:
                return st
            first = first or st
            if os.path.normpath(d) == os.path.normpath(root) or len(d) <= len(root):
                break
            d = os.path.dirname(d)
    return first  # no quota anywhere above this process: nothing throttled it


def _read_cpu_stat(path: str) -> dict[str, float] | None:
    try:
        with open(path, encoding="utf-8") as f:
            kv = dict(line.split() for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return None
    try:
        if "throttled_usec" in kv:
            thr = int(kv["throttled_usec"]) / 1e6
        elif "throttled_time" in kv:
            thr = int(kv["throttled_time"]) / 1e9
        else:
            return None
        return {
            "nr_periods": float(kv.get("nr_periods", 0)),
            "nr_throttled": float(kv.get("nr_throttled", 0)),
            "throttled_s": thr,
        }
    except ValueError:
        return None


# ---------------------------------------------------------------- memory bandwidth
def _inner_count(fn: Callable[[], None], dev: torch.device, target_s: float = 0.01) -> int:
    fn()
    sync(dev)
    one = timed_ops(fn, dev, 1)
    return max(1, min(1000, int(target_s / max(one, 1e-7))))


def membw(dev: torch.device, nbytes: int, repeats: int) -> float:
    """Device memory bandwidth, GB/s, counting bytes read plus bytes written of a copy."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    inner = _inner_count(copy, dev)
    times = []
    for _ in range(repeats):
        times.append(timed_ops(copy, dev, inner) / inner)
    return 2.0 * n * 4 / statistics.median(times) / 1e9


def timed_copy(src: torch.Tensor, dst: torch.Tensor, inner: int) -> float:
    """Seconds for `inner` back-to-back copies of `src` into `dst` (on two devices): the
    host clock around both devices' syncs, as a peer copy involves two GPUs."""
    sync(src.device)
    sync(dst.device)
    t0 = time.perf_counter()
    for _ in range(inner):
        dst.copy_(src, non_blocking=True)
    sync(src.device)
    sync(dst.device)
    return time.perf_counter() - t0


def pair_gbps(
    bufs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], i: int, j: int, repeats: int
) -> float:
    """Copy bandwidth from device i to device j (bufs[i] into dsts[j]), GB/s: the median
    over `repeats` of about 10 ms of back-to-back copies each (timed_copy)."""
    src, dst = bufs[i], dsts[j]
    timed_copy(src, dst, 1)
    inner = max(1, min(1000, int(0.01 / max(timed_copy(src, dst, 1), 1e-7))))
    times = [timed_copy(src, dst, inner) / inner for _ in range(repeats)]
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def p2p_matrix(devs: Sequence[torch.device], node: str, nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Directed copy bandwidth between every pair of devices of the node, GB/s (pair_gbps).

    Reports each pair's asymmetry with its reverse and its deviation from the node's
    median pair, so a degraded NVLink or a PCIe detour is visible per pair.
    """
    n = max(1, nbytes // 4)
    g = len(devs)
    bufs = [torch.ones(n, dtype=torch.float32, device=d) for d in devs]
    dsts = [torch.empty(n, dtype=torch.float32, device=d) for d in devs]
    bw = {(i, j): pair_gbps(bufs, dsts, i, j, repeats) for i in range(g) for j in range(g) if i != j}
    if not bw:
        return []
    med = statistics.median(bw.values())
    out = []
    for (i, j), v in sorted(bw.items()):
        rev = bw[(j, i)]
        out.append(
            {
                "node": node,
                "src": i,
                "dst": j,
                "gbps": v,
                "asymmetry": abs(v - rev) / max(v, rev) if max(v, rev) > 0 else 0.0,
                "vs_node_median": v / med - 1.0 if med > 0 else 0.0,
            }
        )
    return out


# ---------------------------------------------------------------- torch.distributed
@dataclass(frozen=True)
class WorkerSpec:
    """Everything one distributed worker process needs (picklable for spawn)."""

    task: str  # "device" | "allreduce_intra" | "passes"
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
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(f"pg/{spec.task}", store),
        rank=spec.rank,
        world_size=spec.world,
        timeout=timeout,
        **kw,
    )
    return dev


def _barrier(dev: torch.device) -> None:
    # a tiny all-reduce is a barrier on both backends and needs no extra communicator
    t = torch.zeros(1, device=dev)
    dist.all_reduce(t)
    sync(dev)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md): busbw = algbw * factor."""
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def allreduce_bench(
    dev: torch.device,
    sizes_mb: Sequence[int],
    repeats: int,
    scope: str,
    iters: int = 20,
    warmup: int = 5,
) -> list[dict[str, Any]]:
    """All-reduce bus bandwidth per message size (same numbers on every rank).

    Per repeat: `warmup` untimed all-reduces, then `iters` back-to-back ones timed
    together (timed_ops); time = that / iters, the slowest rank's; median over repeats.
    algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests). The buffer holds zeros,
    so repeated sums stay finite.
    """
    n = dist.get_world_size()
    out = []
    for size in sizes_mb:
        buf = torch.zeros(size * MIB // 4, dtype=torch.float32, device=dev)
        for _ in range(max(1, warmup)):  # connections, NCCL channels, clocks
            dist.all_reduce(buf)
        sync(dev)
        times = []
        for _ in range(repeats):
            _barrier(dev)
            t = timed_ops(functools.partial(dist.all_reduce, buf), dev, iters)
            tt = torch.tensor([t / iters], dtype=torch.float64, device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            times.append(float(tt.item()))
        t_med = statistics.median(times)
        algbw = size * MIB / t_med / 1e9
        out.append(
            {
                "scope": scope,
                "size_mb": size,
                "ranks": n,
                "time_s": t_med,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * busbw_factor("all_reduce", n),
            }
        )
    return out


def transfer_time(role: str, buf: torch.Tensor, peer: int, dev: torch.device, n_ops: int) -> float:
    """Seconds for `n_ops` back-to-back sends (`role` "send") or receives ("recv") of `buf`
    to or from global rank `peer` (timed_ops): one endpoint's side of a link."""
    op = dist.send if role == "send" else dist.recv
    return timed_ops(functools.partial(op, buf, peer), dev, n_ops)


def passes_bench(spec: WorkerSpec, dev: torch.device) -> list[dict[str, Any]]:
    """Send/recv of every scheduled link, one pass at a time, all rails of a pass at once.

    Link (a -> b) on rail g is global rank a*G+g sending to b*G+g. Each endpoint times
    `comm_iters` back-to-back sends (or receives) of its side (transfer_time); a link's
    time per transfer is the max of both sides / iters, median over repeats. `comm_warmup`
    untimed rounds open the connections first. Returns the transfers on rank 0.
    """
    G, world, rank = spec.gpus_per_node, dist.get_world_size(), dist.get_rank()
    iters = spec.settings.comm_iters
    warmup = max(1, min(2, spec.settings.comm_warmup))
    out = []
    for sched, passes in spec.schedules:
        for size in spec.settings.message_sizes_mb:
            buf = torch.zeros(size * MIB // 4, dtype=torch.float32, device=dev)
            samples: list[list[torch.Tensor]] = [[] for _ in passes]
            for rep in range(spec.settings.repeats + warmup):
                for p_i, links in enumerate(passes):
                    role, peer = None, -1
                    for s, d in links:
                        if s == spec.node_rank:
                            role, peer = "send", d * G + spec.local_index
                        elif d == spec.node_rank:
                            role, peer = "recv", s * G + spec.local_index
                    n_ops = iters if rep >= warmup else 1
                    _barrier(dev)
                    t = 0.0 if role is None else transfer_time(role, buf, peer, dev, n_ops) / n_ops
                    vec = torch.zeros(world, dtype=torch.float64, device=dev)
                    vec[rank] = t
                    dist.all_reduce(vec)  # gather everyone's time
                    host = vec.cpu()
                    if rep >= warmup:
                        samples[p_i].append(host)
            if rank != 0:
                continue
            for p_i, links in enumerate(passes):
                for s, d in links:
                    for g in range(G):
                        ts = [max(float(v[s * G + g]), float(v[d * G + g])) for v in samples[p_i]]
                        t_med = statistics.median(ts)
                        out.append(
                            {
                                "schedule": sched,
                                "pass_index": p_i,
                                "src_node": spec.node_names[s],
                                "src_gpu": g,
                                "dst_node": spec.node_names[d],
                                "dst_gpu": g,
                                "size_mb": size,
                                "time_s": t_med,
                                "gbps": size * MIB / t_med / 1e9,
                            }
                        )
    return out


def run_worker(spec: WorkerSpec, store: Any | None = None, barrier: Any | None = None) -> dict[str, Any]:
    """Run one worker's task; returns {"data": ..., "errors": [...]} (collectives: data on
    rank 0; the device phase: every worker's own device)."""
    errors: list[dict[str, str]] = []
    data: Any = None
    s = spec.settings
    if spec.task == "device":
        dev = worker_device(spec)
        align_s = min(s.comm_timeout_s, 120.0)

        def align() -> None:
            # all GPUs start each phase together; a GPU that died does not stop the others
            if barrier is not None:
                try:
                    barrier.wait(timeout=align_s)
                except threading.BrokenBarrierError:
                    pass

        res = device_phase(dev, spec.local_index, s, align)
        return {"data": res, "errors": res.pop("errors")}
    try:
        dev = init_group(spec, store)
        try:
            if spec.task == "allreduce_intra":
                data = allreduce_bench(
                    dev, s.message_sizes_mb, s.repeats, "intra", s.comm_iters, s.comm_warmup
                )
            elif spec.task == "passes":
                data = {
                    "transfers": passes_bench(spec, dev),
                    "allreduce": allreduce_bench(
                        dev,
                        s.message_sizes_mb,
                        s.repeats,
                        "cross",
                        s.comm_iters,
                        s.comm_warmup,
                    ),
                }
            else:
                raise ValueError(f"unknown task {spec.task}")
            # the steps of slurmguard.teardown.finish, without its exit: this worker
            # still hands its result back (its process then ends at once, _spawn_target)
            _barrier(dev)
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # recorded in the result: a failed measurement fails the sweep
        errors.append(err(f"{spec.task} rank {spec.rank}", exc))
    return {"data": data if spec.rank == 0 else None, "errors": errors}


def _spawn_target(spec: WorkerSpec, queue: Any, barrier: Any | None = None) -> None:
    if spec.device == "cpu":
        torch.set_num_threads(1)
    queue.put((spec.local_index, run_worker(spec, barrier=barrier)))
    # gloo's threads can race interpreter finalisation (slurmguard.teardown):
    # the result is handed over, so leave without it once the queue has flushed
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_workers(specs: Sequence[WorkerSpec], timeout_s: float) -> list[dict[str, Any]]:
    """Run one process per local device (spawned: CUDA and fork do not mix). Device-phase
    workers share a barrier, so every GPU runs each phase at the same time."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    barrier = ctx.Barrier(len(specs)) if specs and specs[0].task == "device" else None
    procs = [ctx.Process(target=_spawn_target, args=(s, queue, barrier), daemon=True) for s in specs]
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
        out.append(
            results.get(s.local_index)
            or {
                "data": None,
                "errors": [
                    {
                        "where": f"{s.task} rank {s.rank}",
                        "message": f"worker exited with code {p.exitcode} without a result",
                    }
                ],
            }
        )
    return out


# ---------------------------------------------------------------- result
def build_result(**kw: Any) -> dict[str, Any]:
    doc = {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION}
    doc.update(kw)
    return doc


def write_result(path: str, doc: dict[str, Any]) -> bool:
    """Validate and write atomically. Returns False when the document is invalid (a bug)."""
    text = json.dumps(doc, indent=1)
    ok = True
    try:
        parse_result(json.loads(text), path)
    except ResultError as exc:
        print(f"slurmguard sweep: invalid result: {exc}", file=sys.stderr)
        ok = False
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
