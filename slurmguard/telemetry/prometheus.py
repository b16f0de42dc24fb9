"""Telemetry scraped from Prometheus exporters: dcgm-exporter and node_exporter.

The text exposition format is parsed with prometheus_client's parser. Metric
names are the exporters' own:
- dcgm-exporter (labels gpu, UUID, device, modelName, Hostname):
  DCGM_FI_DEV_GPU_TEMP (C), DCGM_FI_DEV_SM_CLOCK (MHz), DCGM_FI_DEV_POWER_USAGE (W),
  DCGM_FI_DEV_GPU_UTIL (%), DCGM_FI_DEV_MEM_COPY_UTIL (%), DCGM_FI_DEV_XID_ERRORS
  (the last XID, 0 = none), DCGM_FI_DEV_CLOCK_THROTTLE_REASONS /
  DCGM_FI_DEV_CLOCKS_EVENT_REASONS (bitmask), DCGM_FI_DEV_ECC_{SBE,DBE}_VOL_TOTAL,
  DCGM_FI_DEV_PCIE_REPLAY_COUNTER, DCGM_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL.
  DCGM reports an unavailable value as a "blank" sentinel (int64 values from
  0x7ffffffffffffff0, fp64 from 2^47); those are treated as absent.
- node_exporter infiniband collector (labels device, port):
  node_infiniband_state_id, node_infiniband_physical_state_id,
  node_infiniband_rate_bytes_per_second, node_infiniband_port_data_{transmitted,
  received}_bytes_total, node_infiniband_link_downed_total, error and
  congestion counters (node_infiniband_port_transmit_wait_total, ...).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import CounterRates, Deadline, Reading, Signal, SourceEvent, SourceTimeout, sample
from slurmguard.telemetry.nvml import THERMAL_BITS

DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0  # 2**47

DCGM_GAUGES = {
    "DCGM_FI_DEV_GPU_TEMP": Signal.GPU_TEMP,
    "DCGM_FI_DEV_SM_CLOCK": Signal.SM_CLOCK,
    "DCGM_FI_DEV_POWER_USAGE": Signal.POWER,
    "DCGM_FI_DEV_GPU_UTIL": Signal.GPU_UTIL,
    "DCGM_FI_DEV_MEM_COPY_UTIL": Signal.MEM_UTIL,
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": Signal.ECC_SBE,
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": Signal.ECC_DBE,
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": Signal.PCIE_REPLAY,
}
DCGM_THROTTLE = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
DCGM_NVLINK = ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
               "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL")
IB_ERRORS = ("node_infiniband_port_errors_received_total", "node_infiniband_port_discards_transmitted_total",
             "node_infiniband_port_discards_received_total", "node_infiniband_link_error_recovery_total",
             "node_infiniband_port_constraint_errors_received_total",
             "node_infiniband_port_constraint_errors_transmitted_total")


def is_blank(value: float) -> bool:
    """DCGM's 'no value' sentinels (blank, not found, not supported, no permission)."""
    return value != value or value >= DCGM_FP64_BLANK


@dataclass(frozen=True)
class Target:
    url: str
    node: str  # used when the metric has no Hostname label (node_exporter)


class PrometheusSource:
    """Scrapes each target and maps exporter metrics to signals."""

    name = "prometheus"

    def __init__(self, targets: list[Target], *, clock: Clock | None = None, timeout_s: float = 5.0,
                 fetch=None) -> None:
        self.targets = targets
        self.clock = clock or SystemClock()
        self.timeout_s = timeout_s
        self.deadline = Deadline(timeout_s + 1.0)
        self.rates = CounterRates()
        self._fetch = fetch or self._http_get

    def close(self) -> None:
        pass

    def _http_get(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # noqa: S310 (admin-set URL)
            return resp.read().decode("utf-8", "replace")

    def sample(self) -> Reading:
        out = Reading()
        for t in self.targets:
            ts = self.clock.now()
            try:
                text = self.deadline.call(self._fetch, t.url)
            except SourceTimeout as exc:
                out.events.append(SourceEvent(t.node, self.name, "timeout", f"{t.url}: {exc}", ts))
                continue
            except (urllib.error.URLError, OSError, ValueError) as exc:
                out.events.append(SourceEvent(t.node, self.name, "error", f"{t.url}: {exc}", ts))
                continue
            try:
                out.extend(self.parse(text, t.node, ts))
            except ValueError as exc:
                out.events.append(SourceEvent(t.node, self.name, "error",
                                              f"{t.url}: bad exposition format: {exc}", ts))
        return out

    def parse(self, text: str, default_node: str, ts: float) -> Reading:
        """Signals from one exposition-format document."""
        out = Reading()
        nvlink: dict[tuple[str, int], float] = {}
        ib_err: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name, labels, v = s.name, s.labels, float(s.value)
                if name.startswith("DCGM_FI_") and name.endswith("_total"):
                    # the parser appends "_total" to counter samples; DCGM names carry none
                    name = name[: -len("_total")]
                if name.startswith("DCGM_FI_"):
                    if "gpu" not in labels or is_blank(v):
                        continue
                    node = labels.get("Hostname") or default_node
                    gpu = int(labels["gpu"])
                    if name in DCGM_GAUGES:
                        sig = DCGM_GAUGES[name]
                        out.samples.append(sample(node, sig, v, ts, gpu=gpu))
                        if sig == Signal.ECC_DBE:
                            d = self.rates.delta((node, gpu, "dbe"), v)
                            if d is not None:
                                out.samples.append(sample(node, Signal.ECC_DBE_DELTA, d, ts, gpu=gpu))
                        elif sig == Signal.PCIE_REPLAY:
                            r = self.rates.rate((node, gpu, "pcie"), v, ts)
                            if r is not None:
                                out.samples.append(sample(node, Signal.PCIE_REPLAY_RATE, r, ts, gpu=gpu))
                    elif name in DCGM_THROTTLE:
                        out.samples.append(sample(node, Signal.THROTTLE_REASONS, v, ts, gpu=gpu))
                        out.samples.append(sample(node, Signal.THERMAL_THROTTLE,
                                                  1 if int(v) & THERMAL_BITS else 0, ts, gpu=gpu))
                    elif name == "DCGM_FI_DEV_XID_ERRORS":
                        if v > 0:
                            out.samples.append(sample(node, Signal.XID, v, ts, gpu=gpu))
                    elif name in DCGM_NVLINK:
                        nvlink[(node, gpu)] = nvlink.get((node, gpu), 0.0) + v
                elif name.startswith("node_infiniband_"):
                    if "device" not in labels:
                        continue
                    nic = f"{labels['device']}:{labels.get('port', '1')}"
                    node = default_node
                    if name == "node_infiniband_state_id":
                        out.samples.append(sample(node, Signal.NIC_STATE, 1 if v == 4 else 0, ts, nic=nic))
                    elif name == "node_infiniband_physical_state_id":
                        out.samples.append(sample(node, Signal.NIC_PHYS_STATE, v, ts, nic=nic))
                    elif name == "node_infiniband_rate_bytes_per_second":
                        out.samples.append(sample(node, Signal.NIC_RATE, v * 8 / 1e9, ts, nic=nic))
                    elif name == "node_infiniband_port_data_transmitted_bytes_total":
                        out.samples.append(sample(node, Signal.NIC_TX_BYTES, v, ts, nic=nic))
                        r = self.rates.rate((node, nic, "tx"), v, ts)
                        if r is not None:
                            out.samples.append(sample(node, Signal.NIC_TX_GBPS, r * 8 / 1e9, ts, nic=nic))
                    elif name == "node_infiniband_port_data_received_bytes_total":
                        out.samples.append(sample(node, Signal.NIC_RX_BYTES, v, ts, nic=nic))
                    elif name == "node_infiniband_link_downed_total":
                        out.samples.append(sample(node, Signal.NIC_LINK_DOWNED, v, ts, nic=nic))
                    elif name == "node_infiniband_port_transmit_wait_total":
                        out.samples.append(sample(node, Signal.NIC_CONGESTION, v, ts, nic=nic))
                        r = self.rates.rate((node, nic, "cong"), v, ts)
                        if r is not None:
                            out.samples.append(sample(node, Signal.NIC_CONGESTION_RATE, r, ts, nic=nic))
                    elif name in IB_ERRORS:
                        ib_err[(node, nic)] = ib_err.get((node, nic), 0.0) + v
        for (node, gpu), total in nvlink.items():
            out.samples.append(sample(node, Signal.NVLINK_ERRORS, total, ts, gpu=gpu))
            r = self.rates.rate((node, gpu, "nvlink"), total, ts)
            if r is not None:
                out.samples.append(sample(node, Signal.NVLINK_ERROR_RATE, r, ts, gpu=gpu))
        for (node, nic), total in ib_err.items():
            out.samples.append(sample(node, Signal.NIC_ERRORS, total, ts, nic=nic))
            r = self.rates.rate((node, nic, "err"), total, ts)
            if r is not None:
                out.samples.append(sample(node, Signal.NIC_ERROR_RATE, r, ts, nic=nic))
        return out
