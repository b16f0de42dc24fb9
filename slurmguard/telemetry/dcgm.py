"""GPU telemetry through DCGM's own Python bindings, when DCGM is installed.

DCGM ships its bindings (DcgmReader.py, dcgm_fields.py, pydcgm.py) under
/usr/share/datacenter-gpu-manager-4/bindings/python3 (DCGM 4) or
/usr/local/dcgm/bindings/python3 (DCGM 3); they are not on PyPI. The source
watches the fields below through `DcgmReader` and reads
`GetLatestGpuValuesAsFieldIdDict()` -> {gpu_id: {field_id: value}}.
Field ids are dcgm_fields' (DCGM_FI_DEV_SM_CLOCK = 100, ...); units are DCGM's:
C, MHz, W, %. Blank sentinels are treated as absent. The reader is injected so
tests run against recorded values.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import CounterRates, Deadline, Reading, Signal, SourceEvent, SourceTimeout, sample
from slurmguard.telemetry.nvml import THERMAL_BITS
from slurmguard.telemetry.prometheus import is_blank

BINDING_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")

# dcgm_fields ids (stable across DCGM 2-4)
FIELDS: dict[int, str] = {
    100: Signal.SM_CLOCK,          # DCGM_FI_DEV_SM_CLOCK
    150: Signal.GPU_TEMP,          # DCGM_FI_DEV_GPU_TEMP
    155: Signal.POWER,             # DCGM_FI_DEV_POWER_USAGE
    203: Signal.GPU_UTIL,          # DCGM_FI_DEV_GPU_UTIL
    204: Signal.MEM_UTIL,          # DCGM_FI_DEV_MEM_COPY_UTIL
    112: Signal.THROTTLE_REASONS,  # DCGM_FI_DEV_CLOCKS_EVENT_REASONS
    230: Signal.XID,               # DCGM_FI_DEV_XID_ERRORS
    202: Signal.PCIE_REPLAY,       # DCGM_FI_DEV_PCIE_REPLAY_COUNTER
    310: Signal.ECC_SBE,           # DCGM_FI_DEV_ECC_SBE_VOL_TOTAL
    311: Signal.ECC_DBE,           # DCGM_FI_DEV_ECC_DBE_VOL_TOTAL
}
NVLINK_FIELDS = (409, 419, 429, 439)  # CRC flit / CRC data / replay / recovery, totals


def load_reader(update_frequency_us: int = 1_000_000) -> Any:
    """A DcgmReader watching our fields; ImportError when DCGM is not installed."""
    for d in BINDING_DIRS:
        if Path(d).is_dir() and d not in sys.path:
            sys.path.append(d)
    from DcgmReader import DcgmReader  # type: ignore[import-not-found]

    return DcgmReader(fieldIds=list(FIELDS) + list(NVLINK_FIELDS), updateFrequency=update_frequency_us)


class DcgmSource:
    name = "dcgm"

    def __init__(self, node: str, reader: Any | None = None, *, clock: Clock | None = None,
                 timeout_s: float = 2.0, reader_factory: Callable[[], Any] = load_reader) -> None:
        self.node = node
        self.clock = clock or SystemClock()
        self.deadline = Deadline(timeout_s)
        self.rates = CounterRates()
        self._error: str | None = None
        self.reader = reader
        if reader is None:
            try:
                self.reader = reader_factory()
            except ImportError as exc:
                self._error = f"DCGM Python bindings not found ({exc}); looked in {', '.join(BINDING_DIRS)}"
            except Exception as exc:  # DCGM raises its own DCGMError_* classes
                self._error = f"cannot connect to DCGM: {exc}"

    def close(self) -> None:
        shutdown = getattr(self.reader, "Shutdown", None)
        if shutdown is not None:
            try:
                self.deadline.call(shutdown)
            except Exception:
                pass

    def sample(self) -> Reading:
        out = Reading()
        ts = self.clock.now()
        if self._error:
            out.events.append(SourceEvent(self.node, self.name, "error", self._error, ts))
            return out
        try:
            data = self.deadline.call(self.reader.GetLatestGpuValuesAsFieldIdDict)
        except SourceTimeout as exc:
            out.events.append(SourceEvent(self.node, self.name, "timeout", str(exc), ts))
            return out
        except Exception as exc:
            out.events.append(SourceEvent(self.node, self.name, "error", f"DCGM read failed: {exc}", ts))
            return out
        for gpu, fields in sorted(data.items()):
            gpu = int(gpu)
            nvl = 0.0
            got_nvl = False
            for fid, raw in fields.items():
                fid = int(fid)
                try:
                    v = float(raw)
                except (TypeError, ValueError):
                    continue
                if is_blank(v):
                    continue
                if fid in NVLINK_FIELDS:
                    nvl += v
                    got_nvl = True
                    continue
                sig = FIELDS.get(fid)
                if sig is None:
                    continue
                if sig == Signal.XID:
                    if v > 0:
                        out.samples.append(sample(self.node, sig, v, ts, gpu=gpu))
                    continue
                out.samples.append(sample(self.node, sig, v, ts, gpu=gpu))
                if sig == Signal.THROTTLE_REASONS:
                    out.samples.append(sample(self.node, Signal.THERMAL_THROTTLE,
                                              1 if int(v) & THERMAL_BITS else 0, ts, gpu=gpu))
                elif sig == Signal.ECC_DBE:
                    d = self.rates.delta((gpu, "dbe"), v)
                    if d is not None:
                        out.samples.append(sample(self.node, Signal.ECC_DBE_DELTA, d, ts, gpu=gpu))
                elif sig == Signal.PCIE_REPLAY:
                    r = self.rates.rate((gpu, "pcie"), v, ts)
                    if r is not None:
                        out.samples.append(sample(self.node, Signal.PCIE_REPLAY_RATE, r, ts, gpu=gpu))
            if got_nvl:
                out.samples.append(sample(self.node, Signal.NVLINK_ERRORS, nvl, ts, gpu=gpu))
        return out
