"""GPU checks through NVML: the count Slurm expects, and hard health faults.

`gpu_count`: NVML must enumerate at least the expected number of GPUs and
hand out a handle for each (a GPU that fell off the bus disappears from the
count or fails nvmlDeviceGetHandleByIndex). More GPUs than expected passes:
that is a configuration mismatch for slurmd's own Gres check, not a fault.

`gpu_health`: one NvmlSource sample (slurmguard.telemetry.nvml) judged by
`slurmguard.detect.peers.hard_failures` (XID of broken hardware, GPU lost,
NVLink down), plus what a one-shot check can see of the past: the volatile
uncorrectable ECC count since driver load (the DBE *delta* the detector uses
needs two samples), and row remapping (nvmlDeviceGetRemappedRows: a failed
remap means the GPU must be replaced, a pending one that it needs a reset).
NVML reports XIDs only as events after registration, so XIDs from before the
prolog started are seen through their lasting effects (lost GPU, ECC, remap).

No NVIDIA driver (NVML_ERROR_LIBRARY_NOT_FOUND / DRIVER_NOT_LOADED) is
healthy only where 0 GPUs are expected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slurmguard.detect.peers import hard_failures
from slurmguard.nodecheck.checks import Progress
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.nvml import NvmlSource, load_pynvml

NvmlLoader = Callable[[], Any]


def _no_driver(nv: Any, exc: Exception) -> bool:
    return getattr(exc, "value", None) in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED)


def _shutdown(nv: Any, progress: Progress) -> None:
    progress.at("nvmlShutdown")
    try:
        nv.nvmlShutdown()
    except nv.NVMLError:
        pass


class GpuCountCheck:
    """NVML sees at least `expected` usable GPUs."""

    name = "gpu_count"

    def __init__(self, expected: int, loader: NvmlLoader = load_pynvml) -> None:
        self.expected = expected
        self.loader = loader

    def run(self, progress: Progress) -> list[str]:
        progress.at("import pynvml")
        nv = self.loader()
        progress.at("nvmlInit")
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            if _no_driver(nv, exc) and self.expected == 0:
                return []
            return [f"NVML unavailable ({exc}); expected {self.expected} GPU(s)"]
        try:
            progress.at("nvmlDeviceGetCount")
            count = nv.nvmlDeviceGetCount()
            broken = []
            for i in range(count):
                progress.at(f"nvmlDeviceGetHandleByIndex({i})")
                try:
                    nv.nvmlDeviceGetHandleByIndex(i)
                except nv.NVMLError as exc:
                    broken.append(f"GPU {i}: {exc}")
        finally:
            _shutdown(nv, progress)
        usable = count - len(broken)
        if usable >= self.expected:
            return []
        why = f"{usable} usable GPU(s), {self.expected} expected (NVML counts {count})"
        if broken:
            why += "; " + "; ".join(broken)
        return [why]


class GpuHealthCheck:
    """No hard GPU fault: lost GPU, hardware XID, NVLink down, ECC DBE, failed/pending remap."""

    name = "gpu_health"

    def __init__(
        self,
        node: str,
        *,
        expected: int,
        max_ecc_dbe: int = 0,
        call_timeout_s: float = 2.0,
        loader: NvmlLoader = load_pynvml,
    ) -> None:
        self.node = node
        self.expected = expected
        self.max_ecc_dbe = max_ecc_dbe
        self.call_timeout_s = call_timeout_s
        self.loader = loader

    def run(self, progress: Progress) -> list[str]:
        progress.at("import pynvml")
        nv = self.loader()
        progress.at("nvmlInit")
        try:
            nv.nvmlInit()  # NVML reference-counts init: NvmlSource's own is nested
        except nv.NVMLError as exc:
            if _no_driver(nv, exc) and self.expected == 0:
                return []
            return [f"NVML unavailable: {exc}"]
        try:
            progress.at("NvmlSource init")
            # per-call timeout below the check's own, so a hung GPU is named
            src = NvmlSource(self.node, nv, timeout_s=self.call_timeout_s)
            try:
                progress.at("NvmlSource.sample")
                reading = src.sample()
                problems = self._judge(reading)
                if not any(ev.kind == "timeout" for ev in reading.events):
                    # direct calls: skipped once NVML has hung, so the named timeout stands
                    problems += self._remapped_rows(nv, progress)
            finally:
                progress.at("NvmlSource.close")
                src.close()
        finally:
            _shutdown(nv, progress)
        return list(dict.fromkeys(problems))  # each once, in order

    def _judge(self, reading: Any) -> list[str]:
        out = []
        for ev in reading.events:
            if (
                ev.kind in ("timeout", "hard_failure")
                or ev.kind == "error"
                and ev.gpu is None
                and "init" in ev.detail
            ):
                out.append(ev.detail)
        for flag in hard_failures(reading.samples):
            if flag.device.startswith("gpu"):
                out.extend(f"{flag.device}: {why}" for why in flag.reasons)
        for s in reading.samples:
            if s.signal == Signal.ECC_DBE and s.value > self.max_ecc_dbe:
                out.append(
                    f"gpu{s.gpu}: {int(s.value)} uncorrectable ECC error(s) since driver "
                    f"load (tolerated: {self.max_ecc_dbe})"
                )
        return out

    def _remapped_rows(self, nv: Any, progress: Progress) -> list[str]:
        getter = getattr(nv, "nvmlDeviceGetRemappedRows", None)
        if getter is None:
            return []
        out = []
        progress.at("nvmlDeviceGetCount")
        for i in range(nv.nvmlDeviceGetCount()):
            progress.at(f"nvmlDeviceGetRemappedRows({i})")
            try:
                _corr, _unc, pending, failed = getter(nv.nvmlDeviceGetHandleByIndex(i))
            except nv.NVMLError:
                continue  # NOT_SUPPORTED before Ampere; lost GPUs are reported above
            if failed:
                out.append(f"gpu{i}: row remapping failed (uncorrectable memory, replace the GPU)")
            elif pending:
                out.append(f"gpu{i}: row remapping pending (GPU reset required)")
        return out
