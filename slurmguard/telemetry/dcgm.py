"""GPU telemetry through DCGM's own Python bindings, when DCGM is installed.

DCGM ships its bindings (DcgmReader.py, dcgm_fields.py, pydcgm.py) under
/usr/share/datacenter-gpu-manager-4/bindings/python3 (DCGM 4) or
/usr/local/dcgm/bindings/python3 (DCGM 3); they are not on PyPI. The source
watches the fields of `FIELDS` through `DcgmReader` and reads
`GetLatestGpuValuesAsFieldIdDict()` -> {gpu_id: {field_id: value}}.

Field ids and units are dcgm_fields' (C, MHz, W, %, profiling ratios 0..1).
Semantics that matter:
- field 230 (DCGM_FI_DEV_XID_ERRORS) holds the *last* XID, not a count: a
  value is reported when it changes, not on every sample (`ValueChange`); the
  value found at start is an old XID of unknown time, noted, not flagged. The
  same XID twice in a row leaves the field unchanged: only NVML's XID events
  (the nvml source) see every occurrence;
- 393-396 are the HBM row remapper (Ampere+): uncorrectable / correctable
  remapped rows, remap failure, remap pending; 1523 the GPU recovery action
  set with XID 154 (DCGM 4.x; older DCGM does not know the field);
- 1002/1004/1005 are profiling (DCP) ratios: SM active, tensor active, DRAM
  active. They need the profiling module and a supported GPU;
- DcgmReader drops blank values (not supported, not watched yet) from its
  dict, and when nv-hostengine is gone it logs, disconnects and returns an
  empty dict: an empty answer is the host engine being unreachable, an error,
  never "no data". Each watched field missing for a GPU is reported
  unavailable once.
The reader is injected so tests run against recorded values.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import (
    WHOLE_SOURCE,
    CounterRates,
    Deadline,
    Reading,
    Signal,
    SourceEvent,
    SourceTimeout,
    Unavailable,
    ValueChange,
    sample,
)
from slurmguard.telemetry.nvml import THERMAL_BITS

BINDING_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")

DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0  # 2**47


def is_blank(value: float) -> bool:
    """DCGM's 'no value' sentinels (blank, not found, not supported, no permission)."""
    return value != value or value >= DCGM_FP64_BLANK


@dataclass(frozen=True)
class DcgmField:
    fid: int
    names: tuple[str, ...]  # dcgm-exporter metric names; the first is the current one
    signal: str

    @property
    def key(self) -> str:
        """What is reported unavailable: the signal, or for the NVLink totals that
        are summed into one signal, the field itself (one missing counter is not
        every NVLink counter missing)."""
        return f"{self.signal}:{self.names[0]}" if self.signal == Signal.NVLINK_ERRORS else self.signal


#: dcgm_fields ids (stable across DCGM 2-4) and the signal each one feeds
FIELDS: tuple[DcgmField, ...] = (
    DcgmField(100, ("DCGM_FI_DEV_SM_CLOCK",), Signal.SM_CLOCK),
    DcgmField(150, ("DCGM_FI_DEV_GPU_TEMP",), Signal.GPU_TEMP),
    DcgmField(155, ("DCGM_FI_DEV_POWER_USAGE",), Signal.POWER),
    DcgmField(203, ("DCGM_FI_DEV_GPU_UTIL",), Signal.GPU_UTIL),
    DcgmField(204, ("DCGM_FI_DEV_MEM_COPY_UTIL",), Signal.MEM_UTIL),
    DcgmField(
        112,
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
        Signal.THROTTLE_REASONS,
    ),
    DcgmField(230, ("DCGM_FI_DEV_XID_ERRORS",), Signal.XID),
    DcgmField(202, ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), Signal.PCIE_REPLAY),
    DcgmField(310, ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",), Signal.ECC_SBE),
    DcgmField(311, ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",), Signal.ECC_DBE),
    DcgmField(393, ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",), Signal.REMAPPED_ROWS_UNC),
    DcgmField(394, ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",), Signal.REMAPPED_ROWS_COR),
    DcgmField(395, ("DCGM_FI_DEV_ROW_REMAP_FAILURE",), Signal.ROW_REMAP_FAILURE),
    DcgmField(396, ("DCGM_FI_DEV_ROW_REMAP_PENDING",), Signal.ROW_REMAP_PENDING),
    DcgmField(
        1523,
        ("DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION", "DCGM_FI_DEV_GPU_RECOVERY_ACTION"),
        Signal.RECOVERY_ACTION,
    ),
    DcgmField(1002, ("DCGM_FI_PROF_SM_ACTIVE",), Signal.SM_ACTIVE),
    DcgmField(1004, ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",), Signal.TENSOR_ACTIVE),
    DcgmField(1005, ("DCGM_FI_PROF_DRAM_ACTIVE",), Signal.DRAM_ACTIVE),
    # CRC flit / CRC data / replay / recovery, totals over the links: summed
    DcgmField(409, ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",), Signal.NVLINK_ERRORS),
    DcgmField(419, ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",), Signal.NVLINK_ERRORS),
    DcgmField(429, ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",), Signal.NVLINK_ERRORS),
    DcgmField(439, ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",), Signal.NVLINK_ERRORS),
)
BY_ID = {f.fid: f for f in FIELDS}
BY_NAME = {n: f for f in FIELDS for n in f.names}


def field_names(key: str) -> str:
    """'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL (311)' for the field(s) behind an unavailable key."""
    return ", ".join(f"{f.names[0]} ({f.fid})" for f in FIELDS if f.key == key)


class DcgmSignals:
    """Field values -> samples, shared by the DCGM and dcgm-exporter sources so
    both read DCGM's fields the same way (derived signals, rates, last XID)."""

    def __init__(self) -> None:
        self.rates = CounterRates()
        self.xid = ValueChange()

    def emit(
        self, out: Reading, node: str, gpu: int, values: dict[str, float], ts: float, source: str = "dcgm"
    ) -> None:
        """values: signal -> value for one GPU (NVLink parts already summed)."""
        for sig, v in values.items():
            if sig == Signal.XID:
                # the last XID, held until the next one: report a new value only
                seen = self.xid.update((node, gpu), v)
                if seen == "changed" and v > 0:
                    out.samples.append(sample(node, sig, v, ts, gpu=gpu))
                elif seen == "first" and v > 0:
                    out.events.append(
                        SourceEvent(
                            node,
                            source,
                            "info",
                            f"GPU {gpu}: last XID {int(v)} happened "
                            "before this source started (time unknown): not flagged; "
                            "see the kernel log",
                            ts,
                            gpu=gpu,
                        )
                    )
                continue
            out.samples.append(sample(node, sig, v, ts, gpu=gpu))
            if sig == Signal.THROTTLE_REASONS:
                out.samples.append(
                    sample(node, Signal.THERMAL_THROTTLE, 1 if int(v) & THERMAL_BITS else 0, ts, gpu=gpu)
                )
            elif sig == Signal.ECC_DBE:
                d = self.rates.delta((node, gpu, "dbe"), v)
                if d is not None:
                    out.samples.append(sample(node, Signal.ECC_DBE_DELTA, d, ts, gpu=gpu))
            elif sig == Signal.PCIE_REPLAY:
                r = self.rates.rate((node, gpu, "pcie"), v, ts)
                if r is not None:
                    out.samples.append(sample(node, Signal.PCIE_REPLAY_RATE, r, ts, gpu=gpu))
            elif sig == Signal.NVLINK_ERRORS:
                r = self.rates.rate((node, gpu, "nvlink"), v, ts)
                if r is not None:
                    out.samples.append(sample(node, Signal.NVLINK_ERROR_RATE, r, ts, gpu=gpu))


def load_reader(update_frequency_us: int = 1_000_000) -> tuple[Any, list[int]]:
    """A DcgmReader watching our fields, and the field ids this DCGM does not
    know (left out: DcgmReader refuses a field group with an unknown id).
    ImportError when DCGM is not installed."""
    for d in BINDING_DIRS:
        if Path(d).is_dir() and d not in sys.path:
            sys.path.append(d)
    import dcgm_fields  # type: ignore[import-not-found]
    from DcgmReader import DcgmReader  # type: ignore[import-not-found]

    lookup = getattr(dcgm_fields, "DcgmFieldGetById", None)
    ids = [f.fid for f in FIELDS]
    unknown = [fid for fid in ids if lookup is not None and lookup(fid) is None]
    reader = DcgmReader(
        fieldIds=[fid for fid in ids if fid not in unknown], updateFrequency=update_frequency_us
    )
    return reader, unknown


class DcgmSource:
    name = "dcgm"

    def __init__(
        self,
        node: str,
        reader: Any | None = None,
        *,
        clock: Clock | None = None,
        timeout_s: float = 2.0,
        reader_factory: Callable[[], tuple[Any, list[int]]] = load_reader,
    ) -> None:
        self.node = node
        self.clock = clock or SystemClock()
        self.deadline = Deadline(timeout_s)
        self.signals = DcgmSignals()
        self.unavailable = Unavailable(self.name)
        self.reader = reader
        self._factory = reader_factory
        self._unknown: list[int] = []
        self._no_bindings: str | None = None

    def close(self) -> None:
        shutdown = getattr(self.reader, "Shutdown", None)
        if shutdown is not None:
            try:
                self.deadline.call(shutdown)
            except Exception:
                pass

    def _connect(self, out: Reading, ts: float) -> bool:
        """Build the reader (again): nv-hostengine may come up after the agent."""
        if self.reader is not None:
            return True
        if self._no_bindings is None:
            try:
                self.reader, self._unknown = self.deadline.call(self._factory)
                for fid in self._unknown:
                    f = BY_ID[fid]
                    self.unavailable.mark(
                        out,
                        self.node,
                        f.key,
                        f"{f.names[0]} ({fid}): this DCGM version does not know the field",
                        ts,
                    )
                return True
            except ImportError as exc:
                self._no_bindings = (
                    f"DCGM Python bindings not found ({exc}); looked in {', '.join(BINDING_DIRS)}"
                )
            except SourceTimeout as exc:
                self._down(out, f"connecting to nv-hostengine: {exc}", ts)
                return False
            except Exception as exc:  # DCGM raises its own DCGMError_* classes
                self._down(out, f"cannot connect to nv-hostengine: {exc}", ts)
                return False
        self._down(out, self._no_bindings, ts)
        return False

    def _down(self, out: Reading, detail: str, ts: float) -> None:
        out.events.append(SourceEvent(self.node, self.name, "error", detail, ts))
        self.unavailable.mark(out, self.node, WHOLE_SOURCE, detail, ts)

    def sample(self) -> Reading:
        out = Reading()
        ts = self.clock.now()
        if not self._connect(out, ts) or self.reader is None:
            return out
        try:
            data = self.deadline.call(self.reader.GetLatestGpuValuesAsFieldIdDict)
        except SourceTimeout as exc:
            out.events.append(SourceEvent(self.node, self.name, "timeout", str(exc), ts))
            return out
        except Exception as exc:
            self._down(out, f"DCGM read failed: {exc}", ts)
            return out
        if not data:
            # DcgmReader's answer when nv-hostengine is gone (it logs, disconnects,
            # returns {}); a node whose GPUs DCGM cannot see is no better
            self._down(out, "nv-hostengine unreachable or sees no GPU (DcgmReader returned no values)", ts)
            return out
        self.unavailable.clear(out, self.node, WHOLE_SOURCE, ts)
        watched = [f for f in FIELDS if f.fid not in self._unknown]
        for gpu, fields in sorted(data.items()):
            gpu = int(gpu)
            values: dict[str, float] = {}
            got: set[str] = set()
            for fid, raw in fields.items():
                f = BY_ID.get(int(fid))
                if f is None:
                    continue
                try:
                    v = float(raw)
                except (TypeError, ValueError):
                    continue
                if is_blank(v):
                    continue
                got.add(f.key)
                values[f.signal] = values.get(f.signal, 0.0) + v if f.signal == Signal.NVLINK_ERRORS else v
            for f in watched:
                if f.key in got:
                    self.unavailable.clear(out, self.node, f.key, ts, gpu=gpu)
                else:
                    self.unavailable.mark(
                        out,
                        self.node,
                        f.key,
                        f"GPU {gpu}: {field_names(f.key)}: no value "
                        "(blank: not supported on this GPU, or a module such as profiling "
                        "is not loaded)",
                        ts,
                        gpu=gpu,
                    )
            self.signals.emit(out, self.node, gpu, values, ts)
        return out
