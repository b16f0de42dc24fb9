"""GPU telemetry through NVML (pynvml from nvidia-ml-py).

Units as NVML documents them: temperature in degrees C
(nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)), SM clock in MHz
(nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)), power in milliwatts
(nvmlDeviceGetPowerUsage, converted to W), utilisation in percent
(nvmlDeviceGetUtilizationRates().gpu/.memory), the clocks-event (throttle)
reasons as a bitmask, volatile ECC counts, the PCIe replay counter, and NVLink
DL error counters per link, HBM row remapping (nvmlDeviceGetRemappedRows ->
corrected rows, uncorrected rows, pending, failure; Ampere and newer) and the
GPU recovery action (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, an
nvmlDeviceGpuRecoveryAction_t; set with XID 154), and on Hopper and newer the
GPU performance metrics (GPM) that match DCGM's profiling ratios: SM util, any
tensor util, DRAM bandwidth util, in percent (0-100) between two GPM samples,
reported as ratios (0..1) like DCGM's. XIDs arrive as
nvmlEventTypeXidCriticalError events on an event set polled with a 0 ms wait;
an event's device handle is a fresh ctypes pointer, so its GPU is found with
nvmlDeviceGetIndex, never by comparing handles.

Error handling: NVML_ERROR_NOT_SUPPORTED (and NO_PERMISSION) means the signal
is absent on this GPU: reported once as "unavailable" for that signal only
(one NVLink counter of one link, not every NVLink counter of the GPU);
NVML_ERROR_GPU_IS_LOST is a hard failure (sample gpu_lost = 1 and a
hard_failure event); any other NVML error is an "error" event; a call that
does not return within the timeout is a "timeout" event. The module object is
injected, so the same code runs against pynvml on a GPU node and against
`FakeNvml` in tests.
"""

from __future__ import annotations

from typing import Any

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import (
    WHOLE_SOURCE,
    XID_RECOVERY_ACTION,
    CounterRates,
    Deadline,
    Reading,
    Signal,
    SourceEvent,
    SourceTimeout,
    Unavailable,
    sample,
)

THERMAL_BITS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown


def load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


class NvmlSource:
    """Samples every GPU of this node through NVML."""

    name = "nvml"

    def __init__(
        self, node: str, nvml: Any | None = None, *, clock: Clock | None = None, timeout_s: float = 2.0
    ) -> None:
        self.node = node
        self.nv = nvml if nvml is not None else load_pynvml()
        self.clock = clock or SystemClock()
        self.deadline = Deadline(timeout_s)
        self.rates = CounterRates()
        self._unsupported: set[tuple[int, str]] = set()
        self.unavailable = Unavailable(self.name)
        self._handles: list[Any] = []
        self._links: dict[int, list[int]] = {}
        self._gpm: dict[int, list[Any]] = {}  # GPU -> [previous sample, current sample]
        self._gpm_primed: set[int] = set()  # GPUs with a previous GPM sample
        self._events: Any = None
        self._init_error: str | None = None
        self._pending = Reading()  # events from setup, handed out with the first sample
        self._init()

    # ------------------------------------------------------------ setup
    def _init(self) -> None:
        nv = self.nv
        try:
            self.deadline.call(nv.nvmlInit)
            count = self.deadline.call(nv.nvmlDeviceGetCount)
            self._handles = [self.deadline.call(nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        except SourceTimeout as exc:
            self._init_error = f"nvmlInit timed out: {exc}"
            return
        except nv.NVMLError as exc:
            self._init_error = f"NVML init failed: {exc}"
            return
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            self._events = None
        for i, h in enumerate(self._handles):
            if self._events is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
                except nv.NVMLError as exc:
                    self._unsupported.add((i, Signal.XID))
                    self.unavailable.mark(
                        self._pending,
                        self.node,
                        Signal.XID,
                        f"GPU {i}: XID events: {exc}",
                        self.clock.now(),
                        gpu=i,
                    )
            links = []
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                try:
                    nv.nvmlDeviceGetNvLinkState(h, link)
                except nv.NVMLError:
                    continue  # link index not present on this GPU
                links.append(link)
            self._links[i] = links
            self._gpm_init(i, h)

    def _gpm_init(self, i: int, h: Any) -> None:
        """Two GPM sample buffers per GPU that supports GPM (Hopper+); else unavailable."""
        nv = self.nv
        why = None
        try:
            if getattr(nv, "nvmlGpmQueryDeviceSupport", None) is None:
                why = "this NVML has no GPM"
            elif not nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                why = "GPM not supported on this GPU (before Hopper)"
            else:
                self._gpm[i] = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        except nv.NVMLError as exc:
            why = f"GPM: {exc}"
        if why is not None:
            for sig in GPM_METRICS.values():
                self._unsupported.add((i, sig))
                self.unavailable.mark(
                    self._pending, self.node, sig, f"GPU {i}: {sig} via NVML: {why}", self.clock.now(), gpu=i
                )

    def close(self) -> None:
        nv = self.nv
        try:
            for bufs in self._gpm.values():
                for b in bufs:
                    nv.nvmlGpmSampleFree(b)
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            self.deadline.call(nv.nvmlShutdown)
        except (nv.NVMLError, SourceTimeout):
            pass

    # ------------------------------------------------------------ sampling
    def sample(self) -> Reading:
        out = Reading()
        ts = self.clock.now()
        out.extend(self._pending)
        self._pending = Reading()
        if self._init_error is not None:
            out.events.append(SourceEvent(self.node, self.name, "error", self._init_error, ts))
            self.unavailable.mark(out, self.node, WHOLE_SOURCE, self._init_error, ts)
            return out
        for i, h in enumerate(self._handles):
            try:
                out.extend(self.deadline.call(self._sample_gpu, i, h, ts))
            except SourceTimeout as exc:
                out.events.append(SourceEvent(self.node, self.name, "timeout", f"GPU {i}: {exc}", ts, gpu=i))
        try:
            out.extend(self.deadline.call(self._drain_xids, ts))
        except SourceTimeout as exc:
            out.events.append(SourceEvent(self.node, self.name, "timeout", f"XID events: {exc}", ts))
        return out

    def _get(
        self,
        out: Reading,
        i: int,
        signal: str,
        ts: float,
        fn: Any,
        *args: Any,
        what: str | None = None,
        report: bool = True,
    ) -> Any:
        """One NVML getter: value, or None after recording why it is absent.

        `what` names the exact reading when one signal is read in parts (an
        NVLink counter of one link): only that part is switched off.
        report=False: the caller reports the part unavailable itself (grouped).
        """
        nv = self.nv
        key = what or signal
        if (i, key) in self._unsupported:
            return None
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NO_PERMISSION):
                self._unsupported.add((i, key))
                if report:
                    self.unavailable.mark(out, self.node, key, f"GPU {i}: {key}: {exc}", ts, gpu=i)
                return None
            if code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost() from None
            out.events.append(
                SourceEvent(self.node, self.name, "error", f"GPU {i}: {signal}: {exc}", ts, gpu=i)
            )
            return None

    def _sample_gpu(self, i: int, h: Any, ts: float) -> Reading:
        nv = self.nv
        out = Reading()
        node = self.node
        try:
            v = self._get(
                out, i, Signal.GPU_TEMP, ts, nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU
            )
            if v is not None:
                out.samples.append(sample(node, Signal.GPU_TEMP, v, ts, gpu=i))
            v = self._get(out, i, Signal.SM_CLOCK, ts, nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            if v is not None:
                out.samples.append(sample(node, Signal.SM_CLOCK, v, ts, gpu=i))
            v = self._get(out, i, Signal.POWER, ts, nv.nvmlDeviceGetPowerUsage, h)
            if v is not None:
                out.samples.append(sample(node, Signal.POWER, v / 1000.0, ts, gpu=i))  # mW -> W
            u = self._get(out, i, Signal.GPU_UTIL, ts, nv.nvmlDeviceGetUtilizationRates, h)
            if u is not None:
                out.samples.append(sample(node, Signal.GPU_UTIL, u.gpu, ts, gpu=i))
                out.samples.append(sample(node, Signal.MEM_UTIL, u.memory, ts, gpu=i))
            # newer drivers name it "clocks event reasons"; the old name is deprecated
            getter = (
                getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                or nv.nvmlDeviceGetCurrentClocksThrottleReasons
            )
            v = self._get(out, i, Signal.THROTTLE_REASONS, ts, getter, h)
            if v is not None:
                out.samples.append(sample(node, Signal.THROTTLE_REASONS, v, ts, gpu=i))
                out.samples.append(
                    sample(node, Signal.THERMAL_THROTTLE, 1 if v & THERMAL_BITS else 0, ts, gpu=i)
                )
            v = self._get(
                out,
                i,
                Signal.ECC_SBE,
                ts,
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
            if v is not None:
                out.samples.append(sample(node, Signal.ECC_SBE, v, ts, gpu=i))
            v = self._get(
                out,
                i,
                Signal.ECC_DBE,
                ts,
                nv.nvmlDeviceGetTotalEccErrors,
                h,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
            if v is not None:
                out.samples.append(sample(node, Signal.ECC_DBE, v, ts, gpu=i))
                d = self.rates.delta((i, "dbe"), v)
                if d is not None:
                    out.samples.append(sample(node, Signal.ECC_DBE_DELTA, d, ts, gpu=i))
            v = self._get(out, i, Signal.PCIE_REPLAY, ts, nv.nvmlDeviceGetPcieReplayCounter, h)
            if v is not None:
                out.samples.append(sample(node, Signal.PCIE_REPLAY, v, ts, gpu=i))
                r = self.rates.rate((i, "pcie"), v, ts)
                if r is not None:
                    out.samples.append(sample(node, Signal.PCIE_REPLAY_RATE, r, ts, gpu=i))
            rows = self._get(
                out, i, Signal.ROW_REMAP_PENDING, ts, nv.nvmlDeviceGetRemappedRows, h, what="row_remapping"
            )
            if rows is not None:
                corr, unc, pending, failure = rows
                out.samples += [
                    sample(node, Signal.REMAPPED_ROWS_COR, corr, ts, gpu=i),
                    sample(node, Signal.REMAPPED_ROWS_UNC, unc, ts, gpu=i),
                    sample(node, Signal.ROW_REMAP_PENDING, 1 if pending else 0, ts, gpu=i),
                    sample(node, Signal.ROW_REMAP_FAILURE, 1 if failure else 0, ts, gpu=i),
                ]
            action = self._recovery_action(out, i, h, ts)
            if action is not None:
                out.samples.append(sample(node, Signal.RECOVERY_ACTION, action, ts, gpu=i))
            self._nvlink(out, i, h, ts)
            self._gpm_metrics(out, i, h, ts)
        except _GpuLost:
            out.samples.append(sample(node, Signal.GPU_LOST, 1, ts, gpu=i))
            out.events.append(
                SourceEvent(node, self.name, "hard_failure", f"GPU {i}: NVML_ERROR_GPU_IS_LOST", ts, gpu=i)
            )
        return out

    def _recovery_action(self, out: Reading, i: int, h: Any, ts: float) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION through nvmlDeviceGetFieldValues.

        The call can succeed while the field itself answers NOT_SUPPORTED
        (older drivers): that field's own nvmlReturn decides.
        """
        nv = self.nv
        fid = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if fid is None or (i, Signal.RECOVERY_ACTION) in self._unsupported:
            return None
        vals = self._get(out, i, Signal.RECOVERY_ACTION, ts, nv.nvmlDeviceGetFieldValues, h, [fid])
        if not vals:
            return None
        fv = vals[0]
        if fv.nvmlReturn != nv.NVML_SUCCESS:
            if fv.nvmlReturn in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NO_PERMISSION):
                self._unsupported.add((i, Signal.RECOVERY_ACTION))
            self.unavailable.mark(
                out,
                self.node,
                Signal.RECOVERY_ACTION,
                f"GPU {i}: {Signal.RECOVERY_ACTION}: {nv.NVMLError(fv.nvmlReturn)}",
                ts,
                gpu=i,
            )
            return None
        self.unavailable.clear(out, self.node, Signal.RECOVERY_ACTION, ts, gpu=i)
        return int(fv.value.uiVal)

    def _gpm_metrics(self, out: Reading, i: int, h: Any, ts: float) -> None:
        """SM / tensor / DRAM activity between this sample and the previous one."""
        nv = self.nv
        bufs = self._gpm.get(i)
        if bufs is None:
            return
        prev, cur = bufs
        if self._get(out, i, Signal.SM_ACTIVE, ts, nv.nvmlGpmSampleGet, h, cur, what="gpm") is None:
            return
        bufs.reverse()  # this sample is the next one's "previous"
        if i not in self._gpm_primed:
            self._gpm_primed.add(i)  # a metric needs two samples
            return
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(GPM_METRICS)
        mg.sample1, mg.sample2 = prev, cur
        for k, mid in enumerate(GPM_METRICS):
            mg.metrics[k].metricId = getattr(nv, mid)
        if self._get(out, i, Signal.SM_ACTIVE, ts, nv.nvmlGpmMetricsGet, mg, what="gpm") is None:
            return
        for k, sig in enumerate(GPM_METRICS.values()):
            m = mg.metrics[k]
            if m.nvmlReturn == nv.NVML_SUCCESS:
                out.samples.append(sample(self.node, sig, m.value / 100.0, ts, gpu=i))  # % -> ratio
                self.unavailable.clear(out, self.node, sig, ts, gpu=i)
            else:
                self.unavailable.mark(
                    out,
                    self.node,
                    sig,
                    f"GPU {i}: {sig} via NVML GPM: {nv.NVMLError(m.nvmlReturn)}",
                    ts,
                    gpu=i,
                )

    def _nvlink(self, out: Reading, i: int, h: Any, ts: float) -> None:
        nv = self.nv
        links = self._links.get(i, [])
        if not links:
            return
        total = 0
        down = 0
        got = False
        for link in links:
            st = self._get(
                out,
                i,
                Signal.NVLINK_DOWN,
                ts,
                nv.nvmlDeviceGetNvLinkState,
                h,
                link,
                what=f"nvlink_state.link{link}",
                report=False,
            )
            if st is not None and st != nv.NVML_FEATURE_ENABLED:
                down += 1
            for counter, cname in NVLINK_COUNTERS:
                # Hopper answers NOT_SUPPORTED for some DL counters: switch off that
                # counter of that link only, never every NVLink counter of the GPU
                v = self._get(
                    out,
                    i,
                    Signal.NVLINK_ERRORS,
                    ts,
                    nv.nvmlDeviceGetNvLinkErrorCounter,
                    h,
                    link,
                    getattr(nv, counter),
                    what=f"nvlink_{cname}.link{link}",
                    report=False,
                )
                if v is not None:
                    total += v
                    got = True
        # one unavailable entry per GPU and counter, naming its links (not one per link)
        for cname in ("state", *(c for _, c in NVLINK_COUNTERS)):
            off = [link for link in links if (i, f"nvlink_{cname}.link{link}") in self._unsupported]
            if off:
                self.unavailable.mark(
                    out,
                    self.node,
                    f"nvlink_{cname}",
                    f"GPU {i}: NVLink {cname} not "
                    f"supported on link(s) {_ranges(off)}; the other counters still count",
                    ts,
                    gpu=i,
                )
        out.samples.append(sample(self.node, Signal.NVLINK_DOWN, down, ts, gpu=i))
        if got:
            out.samples.append(sample(self.node, Signal.NVLINK_ERRORS, total, ts, gpu=i))
            r = self.rates.rate((i, "nvlink"), total, ts)
            if r is not None:
                out.samples.append(sample(self.node, Signal.NVLINK_ERROR_RATE, r, ts, gpu=i))

    def _drain_xids(self, ts: float) -> Reading:
        """Collect pending XID events (0 ms waits until NVML_ERROR_TIMEOUT)."""
        nv = self.nv
        out = Reading()
        if self._events is None:
            return out
        for _ in range(1024):  # bound: a flood of events cannot spin forever
            try:
                ev = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    out.events.append(SourceEvent(self.node, self.name, "error", f"XID wait: {exc}", ts))
                break
            if not ev.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            # ev.device is a new ctypes pointer object on every event: == and id()
            # never match the handles we hold, the index NVML gives does
            try:
                gpu = int(nv.nvmlDeviceGetIndex(ev.device))
            except nv.NVMLError as exc:
                out.events.append(
                    SourceEvent(
                        self.node,
                        self.name,
                        "error",
                        f"XID {ev.eventData}: cannot tell which GPU ({exc})",
                        ts,
                    )
                )
                gpu = None
            out.samples.append(sample(self.node, Signal.XID, ev.eventData, ts, gpu=gpu))
            if ev.eventData == XID_RECOVERY_ACTION and gpu is not None and gpu < len(self._handles):
                # the XID only says the action changed; the action itself is the field
                try:
                    action = self._recovery_action(out, gpu, self._handles[gpu], ts)
                except _GpuLost:
                    action = None  # the GPU's own sample reports it lost
                if action is not None:
                    out.samples.append(sample(self.node, Signal.RECOVERY_ACTION, action, ts, gpu=gpu))
        return out


class _GpuLost(Exception):
    pass


#: GPM metric (pynvml constant) -> signal: the GPM metrics closest to DCGM's profiling
#: fields 1002/1004/1005 (DRAM: bandwidth used vs peak, DCGM: cycles the interface is
#: busy). NVML gives percent, DCGM ratios; the signals are ratios
GPM_METRICS = {
    "NVML_GPM_METRIC_SM_UTIL": Signal.SM_ACTIVE,
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL": Signal.TENSOR_ACTIVE,
    "NVML_GPM_METRIC_DRAM_BW_UTIL": Signal.DRAM_ACTIVE,
}

#: NVLink DL error counters summed into nvlink_errors (pynvml constant, short name)
NVLINK_COUNTERS = (
    ("NVML_NVLINK_ERROR_DL_REPLAY", "replay"),
    ("NVML_NVLINK_ERROR_DL_RECOVERY", "recovery"),
    ("NVML_NVLINK_ERROR_DL_CRC_FLIT", "crc_flit"),
    ("NVML_NVLINK_ERROR_DL_CRC_DATA", "crc_data"),
)


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for k, x in enumerate(xs):
        if start is None:
            start = x
        if k + 1 == len(xs) or xs[k + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ",".join(out)
