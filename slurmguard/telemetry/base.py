"""Telemetry records, the source protocol, and bounded calls.

Every source returns a `Reading`: typed samples plus events (a timeout, an
error, a hard failure). A source call never hangs the agent: `Deadline` runs
the blocking call in a daemon thread and turns an overrun into an event; while
an earlier call is still stuck, later calls fail fast instead of piling up
threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast


class Signal:
    """Signal names (strings, so they travel in JSON reports unchanged)."""

    GPU_TEMP = "gpu_temp"  # degrees C
    SM_CLOCK = "sm_clock"  # MHz
    POWER = "power"  # W
    GPU_UTIL = "gpu_util"  # %
    MEM_UTIL = "mem_util"  # %
    THROTTLE_REASONS = "throttle_reasons"  # NVML clocks-event bitmask
    THERMAL_THROTTLE = "thermal_throttle"  # 1 if a thermal slowdown bit is set
    XID = "xid"  # XID code of a critical error event
    GPU_LOST = "gpu_lost"  # 1 = NVML_ERROR_GPU_IS_LOST
    ECC_SBE = "ecc_sbe_volatile"  # count since driver load
    ECC_DBE = "ecc_dbe_volatile"  # count since driver load
    ECC_DBE_DELTA = "ecc_dbe_new"  # new uncorrectable errors since last sample
    PCIE_REPLAY = "pcie_replay"  # counter
    PCIE_REPLAY_RATE = "pcie_replay_rate"  # per second
    NVLINK_ERRORS = "nvlink_errors"  # CRC/replay/recovery counters summed
    NVLINK_ERROR_RATE = "nvlink_error_rate"  # per second
    NVLINK_DOWN = "nvlink_down"  # links reported inactive
    NIC_STATE = "nic_state"  # 1 = ACTIVE, 0 otherwise
    NIC_PHYS_STATE = "nic_phys_state"  # 5 = LinkUp
    NIC_RATE = "nic_rate"  # Gb/s, negotiated
    NIC_RX_BYTES = "nic_rx_bytes"  # counter, bytes
    NIC_TX_BYTES = "nic_tx_bytes"  # counter, bytes
    NIC_TX_GBPS = "nic_tx_gbps"  # Gb/s, from counter deltas
    NIC_ERRORS = "nic_errors"  # error counters summed
    NIC_ERROR_RATE = "nic_error_rate"  # per second
    NIC_LINK_DOWNED = "nic_link_downed"  # counter (flaps)
    NIC_CONGESTION = "nic_congestion"  # xmit_wait ticks + CNPs handled
    NIC_CONGESTION_RATE = "nic_congestion_rate"  # per second
    CPU_BUSY = "cpu_busy"  # % of allocated cores busy with other work
    STEP_TIME = "step_time"  # seconds, from the detectors
    # HBM row remapping (Ampere and newer; the H100 memory-health signal)
    ROW_REMAP_PENDING = "row_remap_pending"  # 1 = a remap waits for a GPU reset
    ROW_REMAP_FAILURE = "row_remap_failure"  # 1 = a remap failed (out of spare rows)
    REMAPPED_ROWS_UNC = "remapped_rows_unc"  # rows remapped for uncorrectable errors
    REMAPPED_ROWS_COR = "remapped_rows_cor"  # rows remapped for correctable errors
    RECOVERY_ACTION = "gpu_recovery_action"  # nvmlDeviceGpuRecoveryAction_t, 0 = none
    # DCGM profiling (DCP) ratios, 0..1 of elapsed cycles
    SM_ACTIVE = "sm_active"  # an SM has at least one warp assigned
    TENSOR_ACTIVE = "tensor_active"  # a tensor pipe is active
    DRAM_ACTIVE = "dram_active"  # the device memory interface is busy


T = TypeVar("T")

UNITS = {
    Signal.GPU_TEMP: "C",
    Signal.SM_CLOCK: "MHz",
    Signal.POWER: "W",
    Signal.GPU_UTIL: "%",
    Signal.MEM_UTIL: "%",
    Signal.THROTTLE_REASONS: "bitmask",
    Signal.THERMAL_THROTTLE: "bool",
    Signal.XID: "code",
    Signal.GPU_LOST: "bool",
    Signal.ECC_SBE: "count",
    Signal.ECC_DBE: "count",
    Signal.ECC_DBE_DELTA: "count",
    Signal.PCIE_REPLAY: "count",
    Signal.PCIE_REPLAY_RATE: "1/s",
    Signal.NVLINK_ERRORS: "count",
    Signal.NVLINK_ERROR_RATE: "1/s",
    Signal.NVLINK_DOWN: "links",
    Signal.NIC_STATE: "bool",
    Signal.NIC_PHYS_STATE: "code",
    Signal.NIC_RATE: "Gb/s",
    Signal.NIC_RX_BYTES: "B",
    Signal.NIC_TX_BYTES: "B",
    Signal.NIC_TX_GBPS: "Gb/s",
    Signal.NIC_ERRORS: "count",
    Signal.NIC_ERROR_RATE: "1/s",
    Signal.NIC_LINK_DOWNED: "count",
    Signal.NIC_CONGESTION: "count",
    Signal.NIC_CONGESTION_RATE: "1/s",
    Signal.CPU_BUSY: "%",
    Signal.STEP_TIME: "s",
    Signal.ROW_REMAP_PENDING: "bool",
    Signal.ROW_REMAP_FAILURE: "bool",
    Signal.REMAPPED_ROWS_UNC: "rows",
    Signal.REMAPPED_ROWS_COR: "rows",
    Signal.RECOVERY_ACTION: "code",
    Signal.SM_ACTIVE: "ratio",
    Signal.TENSOR_ACTIVE: "ratio",
    Signal.DRAM_ACTIVE: "ratio",
}

#: XIDs that mean broken hardware (NVIDIA XID catalogue): 48 DBE, 63/64 row
#: remap, 74 NVLink, 79 fallen off the bus, 92 high SBE rate, 94/95 contained/
#: uncontained ECC, 119/120 GSP errors. Application XIDs (13, 31, 43, 45) are not.
HARD_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})

#: XID 154 "GPU recovery action changed": what to do is in the GPU's recovery
#: action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, DCGM field 1523), not in the XID.
XID_RECOVERY_ACTION = 154

#: nvmlDeviceGpuRecoveryAction_t (NVML; DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION has the same values)
RECOVERY_ACTIONS = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "PCIe bus reset",
    7: "system reboot",
}


@dataclass(frozen=True)
class TelemetrySample:
    """One reading: node, GPU index or NIC name (port as "mlx5_0:1"), signal, value, unit, time (s)."""

    node: str
    signal: str
    value: float
    unit: str
    timestamp: float
    gpu: int | None = None
    nic: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "nic": self.nic,
            "signal": self.signal,
            "value": self.value,
            "unit": self.unit,
            "timestamp": self.timestamp,
        }


def sample(
    node: str, signal: str, value: float, ts: float, *, gpu: int | None = None, nic: str | None = None
) -> TelemetrySample:
    return TelemetrySample(node, signal, float(value), UNITS.get(signal, ""), ts, gpu, nic)


@dataclass(frozen=True)
class SourceEvent:
    """Something a source could not measure.

    kind: timeout | error | hard_failure (each time it happens), or
    unavailable / available (a signal that cannot be read, and its return;
    each reported once per change, see `Unavailable`). `signal` names the
    signal ("source" = the whole source) for unavailable/available.
    """

    node: str
    source: str
    kind: str
    detail: str
    timestamp: float
    gpu: int | None = None
    nic: str | None = None
    signal: str | None = None


@dataclass
class Reading:
    samples: list[TelemetrySample] = field(default_factory=list)
    events: list[SourceEvent] = field(default_factory=list)

    def extend(self, other: Reading) -> None:
        self.samples.extend(other.samples)
        self.events.extend(other.events)

    def values(self, signal: str) -> dict[tuple[str, int | None, str | None], float]:
        return {(s.node, s.gpu, s.nic): s.value for s in self.samples if s.signal == signal}


#: signal name of an `Unavailable` entry that covers everything a source reads
WHOLE_SOURCE = "source"


class Unavailable:
    """Signals of one source that cannot be read, reported once per change.

    `mark` emits an "unavailable" event the first time a (node, gpu, nic,
    signal) cannot be read; `clear` emits "available" when it can be read
    again. The agent keeps the current set (`UnavailableSet`) and sends it
    with every report, so a signal that cannot be read is visible, never
    silently absent, without repeating the same event every sample.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._on: dict[tuple[Any, ...], str] = {}

    def mark(
        self,
        out: Reading,
        node: str,
        signal: str,
        detail: str,
        ts: float,
        *,
        gpu: int | None = None,
        nic: str | None = None,
    ) -> None:
        key = (node, gpu, nic, signal)
        if key in self._on:
            return
        self._on[key] = detail
        out.events.append(SourceEvent(node, self.source, "unavailable", detail, ts, gpu, nic, signal))

    def clear(
        self,
        out: Reading,
        node: str,
        signal: str,
        ts: float,
        *,
        gpu: int | None = None,
        nic: str | None = None,
    ) -> None:
        if self._on.pop((node, gpu, nic, signal), None) is not None:
            out.events.append(
                SourceEvent(node, self.source, "available", f"{signal} readable again", ts, gpu, nic, signal)
            )


class UnavailableSet:
    """The agent's view of what cannot be read now, built from source events."""

    def __init__(self) -> None:
        self._on: dict[tuple[Any, ...], dict[str, Any]] = {}

    def update(self, events: list[SourceEvent], node: str | None = None) -> None:
        for e in events:
            if e.kind not in ("unavailable", "available") or (node is not None and e.node != node):
                continue
            key = (e.source, e.signal, e.gpu, e.nic)
            if e.kind == "unavailable":
                self._on.setdefault(
                    key,
                    {
                        "source": e.source,
                        "signal": e.signal or WHOLE_SOURCE,
                        "gpu": e.gpu,
                        "nic": e.nic,
                        "detail": e.detail,
                        "since": e.timestamp,
                    },
                )
            else:
                self._on.pop(key, None)

    def records(self) -> list[dict[str, Any]]:
        return [dict(v) for _, v in sorted(self._on.items(), key=lambda kv: repr(kv[0]))]


class ValueChange:
    """Fields that hold the *last* value of an event (DCGM field 230, the last
    XID): a value is new when it differs from the one seen before, not on every
    sample. The first value seen is a baseline, not a change: it happened at an
    unknown time before the source started (flagging it would drain, again,
    every node with an old XID each time its agent restarts)."""

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], float] = {}

    def update(self, key: tuple[Any, ...], value: float) -> str:
        """'first' (no earlier value), 'changed' or 'same'."""
        prev = self._last.get(key)
        self._last[key] = value
        if prev is None:
            return "first"
        return "same" if prev == value else "changed"


class TelemetrySource(Protocol):
    """A telemetry source. sample() never raises for a device fault and never
    blocks longer than its timeout: problems become events."""

    name: str

    def sample(self) -> Reading: ...

    def close(self) -> None: ...


class SourceTimeout(Exception):
    pass


class Deadline:
    """Run blocking calls with a timeout in a daemon thread.

    A call that overruns raises SourceTimeout; its thread is abandoned (a hung
    driver call cannot be cancelled). While it is still stuck, further calls
    raise SourceTimeout immediately rather than stacking more stuck threads.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stuck: threading.Thread | None = None

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        if self._stuck is not None:
            if self._stuck.is_alive():
                raise SourceTimeout("an earlier call is still hung")
            self._stuck = None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # carried to the caller's thread
                box["error"] = exc

        th = threading.Thread(target=run, daemon=True, name="slurmguard-telemetry-call")
        th.start()
        th.join(self.timeout_s if timeout_s is None else timeout_s)
        if th.is_alive():
            self._stuck = th
            raise SourceTimeout(f"call did not return within {self.timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return cast(T, box.get("value"))  # what fn returned, stored by run()


class CounterRates:
    """Per-second rates from monotonically increasing counters.

    A counter that goes backwards (driver reload, counter reset) restarts its
    baseline instead of producing a negative rate.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[Any, ...], tuple[float, float]] = {}

    def rate(self, key: tuple[Any, ...], value: float, ts: float) -> float | None:
        prev = self._last.get(key)
        self._last[key] = (value, ts)
        if prev is None or ts <= prev[1] or value < prev[0]:
            return None
        return (value - prev[0]) / (ts - prev[1])

    def delta(self, key: tuple[Any, ...], value: float) -> float | None:
        prev = self._last.get(key)
        self._last[key] = (value, prev[1] + 1 if prev else 0.0)
        if prev is None or value < prev[0]:
            return None
        return value - prev[0]
