"""A faithful stand-in for the pynvml module, for machines without a GPU.

It exposes the pynvml functions NvmlSource calls, with pynvml's own constants
and its NVMLError classes (so `except nv.NVMLError` and `.value` behave as on a
GPU node), NVML's units (temperature C, clocks MHz, power mW, utilisation %),
and NVML's error behaviour: every call before nvmlInit fails with
NVML_ERROR_UNINITIALIZED, an unknown index with NVML_ERROR_INVALID_ARGUMENT, a
feature the GPU lacks with NVML_ERROR_NOT_SUPPORTED, a GPU that fell off the
bus with NVML_ERROR_GPU_IS_LOST, and nvmlEventSetWait_v2 with
NVML_ERROR_TIMEOUT when no event is pending. As with ctypes, the device of an
event is a new handle object that neither == nor id() matches with the
handle nvmlDeviceGetHandleByIndex gave; nvmlDeviceGetIndex maps it back.
nvmlDeviceGetFieldValues answers per field (the call succeeds, a field the GPU
lacks carries its own NVML_ERROR_NOT_SUPPORTED). A device lacking
"remapped_rows" answers nvmlDeviceGetRemappedRows with NOT_SUPPORTED
(pre-Ampere); an NVLink link's "unsupported" list names its DL counters that
answer NOT_SUPPORTED (Hopper drops some of them). A device with a "gpm" entry (percent values) has
GPM (Hopper+): metrics need two nvmlGpmSampleGet samples of that GPU, in order.

Device state comes from a dict in the layout of the recorded fixture
(tests/fixtures/telemetry/nvml_h100x8.json); `hang` names functions that block
until `release()` to reproduce a hung driver call.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import Any

import pynvml as _real

# constants and error classes straight from pynvml
NVMLError = _real.NVMLError
for _name in dir(_real):
    if _name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")):
        globals()[_name] = getattr(_real, _name)


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<nvmlDevice {self.index}>"


class _EventData:
    """Fields of c_nvmlEventData_t."""

    def __init__(self, device: _Handle, event_type: int, data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = data
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


class _Value:
    """c_nvmlValue_t (a union; only the member of the field's type is meaningful)."""

    def __init__(self, v: int) -> None:
        self.uiVal = self.ulVal = self.ullVal = v
        self.dVal = float(v)


class _FieldValue:
    """Fields of c_nvmlFieldValue_t."""

    def __init__(self, field_id: int, ret: int, value: int = 0) -> None:
        self.fieldId = field_id
        self.scopeId = 0
        self.timestamp = 0
        self.latencyUsec = 0
        self.valueType = _real.NVML_VALUE_TYPE_UNSIGNED_INT
        self.nvmlReturn = ret
        self.value = _Value(value)


class _GpmSupport:
    def __init__(self, supported: bool) -> None:
        self.version = _real.NVML_GPM_SUPPORT_VERSION
        self.isSupportedDevice = int(supported)


class _GpmSample:
    """An nvmlGpmSample_t: filled by nvmlGpmSampleGet."""

    def __init__(self) -> None:
        self.device: int | None = None
        self.seq = -1
        self.values: dict[str, float] = {}


class _GpmMetric:
    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = _real.NVML_SUCCESS
        self.value = 0.0


class _GpmMetricsGet:
    """c_nvmlGpmMetricsGet_t."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: _GpmSample | None = None
        self.sample2: _GpmSample | None = None
        self.metrics = [_GpmMetric() for _ in range(_real.NVML_GPM_METRIC_MAX)]


#: GPM metric id -> key of the device's "gpm" entry (percent over the interval)
_GPM_KEYS = {
    _real.NVML_GPM_METRIC_SM_UTIL: "sm_util_pct",
    _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "any_tensor_util_pct",
    _real.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_bw_util_pct",
}


class _Utilization:
    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu = gpu
        self.memory = memory


class FakeNvml:
    """Instance used in place of the pynvml module."""

    NVMLError = _real.NVMLError
    c_nvmlGpmMetricsGet_t = _GpmMetricsGet

    def __init__(self, devices: list[dict[str, Any]], hang: set[str] | None = None) -> None:
        self.devices = devices
        self.hang = set(hang or ())
        self._release = threading.Event()
        self._init = 0
        self._handles = [_Handle(i) for i in range(len(devices))]
        self._sets: list[dict[str, Any]] = []
        self._gpm_seq = 0
        for name in dir(_real):
            if name.startswith(("NVML_", "nvmlClocks", "nvmlEventType")):
                setattr(self, name, getattr(_real, name))

    @classmethod
    def from_fixture(cls, path: str | Path, **kw: Any) -> FakeNvml:
        data = json.loads(Path(path).read_text())
        return cls(data["devices"], **kw)

    # ---------------------------------------------------------------- control
    def release(self) -> None:
        self._release.set()

    def inject_xid(self, index: int, xid: int) -> None:
        for s in self._sets:
            if index in s["registered"]:
                # a fresh pointer object per event, as ctypes returns it
                s["queue"].append(_EventData(_Handle(index), _real.nvmlEventTypeXidCriticalError, xid))

    def _enter(self, fn: str) -> None:
        if fn in self.hang:
            self._release.wait()
        if not self._init and fn != "nvmlInit":
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)

    def _device(self, fn: str, handle: _Handle, feature: str | None = None) -> dict[str, Any]:
        """_enter, then the device a handle names, or the NVML error a real driver returns."""
        self._enter(fn)
        if not isinstance(handle, _Handle) or handle.index >= len(self.devices):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        dev = self.devices[handle.index]
        if dev.get("lost"):
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if feature is not None and feature in dev.get("unsupported", ()):
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return dev

    # ---------------------------------------------------------------- pynvml API
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        self._init += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._init = max(0, self._init - 1)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    def nvmlDeviceGetIndex(self, h: _Handle) -> int:
        self._device("nvmlDeviceGetIndex", h)
        return h.index

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return str(self._device("nvmlDeviceGetName", h)["name"])

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return str(self._device("nvmlDeviceGetUUID", h)["uuid"])

    def nvmlDeviceGetTemperature(self, h: _Handle, sensor: int) -> int:
        dev = self._device("nvmlDeviceGetTemperature", h, "temperature")
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return int(dev["temperature_gpu_c"])

    def nvmlDeviceGetClockInfo(self, h: _Handle, clock_type: int) -> int:
        dev = self._device("nvmlDeviceGetClockInfo", h, "clocks")
        key = {
            _real.NVML_CLOCK_GRAPHICS: "clock_graphics_mhz",
            _real.NVML_CLOCK_SM: "clock_sm_mhz",
            _real.NVML_CLOCK_MEM: "clock_mem_mhz",
        }.get(clock_type)
        if key is None:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return int(dev[key])

    def nvmlDeviceGetPowerUsage(self, h: _Handle) -> int:
        return int(self._device("nvmlDeviceGetPowerUsage", h, "power")["power_usage_mw"])

    def nvmlDeviceGetUtilizationRates(self, h: _Handle) -> _Utilization:
        dev = self._device("nvmlDeviceGetUtilizationRates", h, "utilization")
        return _Utilization(int(dev["utilization_gpu_pct"]), int(dev["utilization_memory_pct"]))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _Handle) -> int:
        return int(
            self._device("nvmlDeviceGetCurrentClocksEventReasons", h, "clocks_event_reasons")[
                "clocks_event_reasons"
            ]
        )

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetTotalEccErrors(self, h: _Handle, error_type: int, counter_type: int) -> int:
        dev = self._device("nvmlDeviceGetTotalEccErrors", h, "ecc")
        kind = "corrected" if error_type == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
        when = "volatile" if counter_type == _real.NVML_VOLATILE_ECC else "aggregate"
        return int(dev["ecc"][f"{when}_{kind}"])

    def nvmlDeviceGetPcieReplayCounter(self, h: _Handle) -> int:
        return int(self._device("nvmlDeviceGetPcieReplayCounter", h, "pcie_replay")["pcie_replay_counter"])

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        dev = self._device("nvmlDeviceGetNvLinkState", h, "nvlink")
        links = dev.get("nvlink", [])
        if link >= len(links):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return int(_real.NVML_FEATURE_ENABLED if links[link]["active"] else _real.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, h: _Handle, link: int, counter: int) -> int:
        dev = self._device("nvmlDeviceGetNvLinkErrorCounter", h, "nvlink")
        links = dev.get("nvlink", [])
        if link >= len(links):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        key = {
            _real.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
            _real.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
            _real.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
            _real.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
        }.get(counter)
        if key is None:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if key in links[link].get("unsupported", ()):
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return int(links[link][key])

    def nvmlDeviceGetRemappedRows(self, h: _Handle) -> tuple[int, int, int, int]:
        """(corrRows, uncRows, isPending, failureOccurred), as pynvml returns them."""
        dev = self._device("nvmlDeviceGetRemappedRows", h, "remapped_rows")
        rr = dev.get("remapped_rows")
        if rr is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return (
            int(rr.get("correctable", 0)),
            int(rr.get("uncorrectable", 0)),
            int(bool(rr.get("pending", False))),
            int(bool(rr.get("failure", False))),
        )

    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list[int]) -> list[_FieldValue]:
        dev = self._device("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            if fid == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and "gpu_recovery_action" in dev:
                out.append(_FieldValue(fid, _real.NVML_SUCCESS, int(dev["gpu_recovery_action"])))
            else:
                out.append(_FieldValue(fid, _real.NVML_ERROR_NOT_SUPPORTED))
        return out

    # GPM (Hopper+): a metric is computed between two samples of the same GPU
    def nvmlGpmQueryDeviceSupport(self, h: _Handle) -> _GpmSupport:
        return _GpmSupport("gpm" in self._device("nvmlGpmQueryDeviceSupport", h))

    def nvmlGpmSampleAlloc(self) -> _GpmSample:
        self._enter("nvmlGpmSampleAlloc")
        return _GpmSample()

    def nvmlGpmSampleFree(self, s: _GpmSample) -> None:
        self._enter("nvmlGpmSampleFree")

    def nvmlGpmSampleGet(self, h: _Handle, s: _GpmSample) -> _GpmSample:
        dev = self._device("nvmlGpmSampleGet", h)
        if "gpm" not in dev:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        self._gpm_seq += 1
        s.device, s.seq, s.values = h.index, self._gpm_seq, dict(dev["gpm"])
        return s

    def nvmlGpmMetricsGet(self, mg: _GpmMetricsGet) -> _GpmMetricsGet:
        self._enter("nvmlGpmMetricsGet")
        a, b = mg.sample1, mg.sample2
        if (
            mg.version != _real.NVML_GPM_METRICS_GET_VERSION
            or a is None
            or b is None
            or a.device is None
            or a.device != b.device
            or a.seq >= b.seq
        ):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        for m in mg.metrics[: mg.numMetrics]:
            key = _GPM_KEYS.get(m.metricId)
            if key is None or key not in b.values:
                m.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
            else:
                m.nvmlReturn, m.value = _real.NVML_SUCCESS, float(b.values[key])
        return mg

    def nvmlEventSetCreate(self) -> dict[str, Any]:
        self._enter("nvmlEventSetCreate")
        s: dict[str, Any] = {"registered": set(), "queue": deque()}
        self._sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: dict[str, Any]) -> None:
        self._device("nvmlDeviceRegisterEvents", h, "events")
        if event_types & _real.nvmlEventTypeXidCriticalError:
            event_set["registered"].add(h.index)

    def nvmlEventSetWait_v2(self, event_set: dict[str, Any], timeout_ms: int) -> _EventData:
        self._enter("nvmlEventSetWait_v2")
        if event_set["queue"]:
            ev: _EventData = event_set["queue"].popleft()
            return ev
        raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: dict[str, Any]) -> None:
        self._enter("nvmlEventSetFree")
        if event_set in self._sets:
            self._sets.remove(event_set)
