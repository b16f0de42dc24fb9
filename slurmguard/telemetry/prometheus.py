"""Telemetry scraped from Prometheus exporters: dcgm-exporter and node_exporter.

The text exposition format is parsed with prometheus_client's parser. Metric
names are the exporters' own:
- dcgm-exporter (labels gpu, UUID, device, modelName, Hostname): one metric per
  DCGM field, named as the field (slurmguard.telemetry.dcgm.FIELDS: GPU temp,
  SM clock, power, utilisation, clocks-event reasons, the *last* XID, ECC,
  PCIe replays, NVLink error totals, row remapping, recovery action, the
  profiling ratios SM/tensor/DRAM active). DCGM reports an unavailable value
  as a "blank" sentinel (int64 values from 0x7ffffffffffffff0, fp64 from 2^47).
  Which fields are exported is the exporter's counters CSV: the default
  (etc/default-counters.csv) has no ECC, NVLink error, clocks-event, row-remap
  pending or profiling fields; dcp-metrics-included.csv adds the profiling
  ratios. A field the page lacks is reported unavailable once per node, naming
  the field to add, never silently absent.
- node_exporter infiniband collector (labels device, port):
  node_infiniband_state_id, node_infiniband_physical_state_id,
  node_infiniband_rate_bytes_per_second, node_infiniband_port_data_{transmitted,
  received}_bytes_total, node_infiniband_link_downed_total, error and
  congestion counters (node_infiniband_port_transmit_wait_total, ...). These
  are the sysfs counters, with their widths and saturation, and the same
  expected-port rule as the sysfs source (slurmguard.telemetry.infiniband).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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
    sample,
)
from slurmguard.telemetry.dcgm import BY_NAME, FIELDS, DcgmSignals, field_names, is_blank
from slurmguard.telemetry.infiniband import STATE_ACTIVE, CounterSet, ExpectedPorts, emit_rate

#: node_exporter metric -> the sysfs counter it reads (for its width)
IB_ERRORS = {
    "node_infiniband_port_errors_received_total": "port_rcv_errors",
    "node_infiniband_port_discards_transmitted_total": "port_xmit_discards",
    "node_infiniband_port_discards_received_total": "port_rcv_discards",
    "node_infiniband_link_error_recovery_total": "link_error_recovery",
    "node_infiniband_port_constraint_errors_received_total": "port_rcv_constraint_errors",
    "node_infiniband_port_constraint_errors_transmitted_total": "port_xmit_constraint_errors",
}
#: what every dcgm-exporter page should carry (the rest is derived from it)
DCGM_EXPECTED = tuple(dict.fromkeys(f.key for f in FIELDS))


@dataclass(frozen=True)
class Target:
    url: str
    node: str  # used when the metric has no Hostname label (node_exporter)


class PrometheusSource:
    """Scrapes each target and maps exporter metrics to signals."""

    name = "prometheus"

    def __init__(
        self,
        targets: list[Target],
        *,
        clock: Clock | None = None,
        timeout_s: float = 5.0,
        fetch: Callable[[str], str] | None = None,
        expected_ports: tuple[str, ...] | list[str] | None = (),
    ) -> None:
        self.targets = targets
        self.clock = clock or SystemClock()
        self.timeout_s = timeout_s
        self.deadline = Deadline(timeout_s + 1.0)
        self.rates = CounterRates()
        self.dcgm = DcgmSignals()
        self.expected = ExpectedPorts(expected_ports)
        self.unavailable = Unavailable(self.name)
        self._fetch = fetch or self._http_get

    def close(self) -> None:
        pass

    def _http_get(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # noqa: S310 (admin-set URL)
            body: bytes = resp.read()
            return body.decode("utf-8", "replace")

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
                self._target_down(out, t, f"{t.url}: {exc}", ts)
                continue
            try:
                out.extend(self.parse(text, t.node, ts))
            except ValueError as exc:
                self._target_down(out, t, f"{t.url}: bad exposition format: {exc}", ts)
                continue
            self.unavailable.clear(out, t.node, f"{WHOLE_SOURCE}:{t.url}", ts)
        return out

    def _target_down(self, out: Reading, t: Target, detail: str, ts: float) -> None:
        out.events.append(SourceEvent(t.node, self.name, "error", detail, ts))
        self.unavailable.mark(out, t.node, f"{WHOLE_SOURCE}:{t.url}", detail, ts)

    def parse(self, text: str, default_node: str, ts: float) -> Reading:
        """Signals from one exposition-format document."""
        out = Reading()
        gpus: dict[tuple[str, int], dict[str, float]] = {}
        blank: dict[tuple[str, int], set[str]] = {}
        got: dict[tuple[str, int], set[str]] = {}
        exported: dict[str, set[str]] = {}  # node -> field keys the page carries
        ports: dict[str, dict[str, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name, labels, v = s.name, s.labels, float(s.value)
                if name.startswith("DCGM_FI_") and name.endswith("_total") and name not in BY_NAME:
                    # the parser appends "_total" to counter samples; DCGM names carry none
                    name = name[: -len("_total")]
                if name.startswith("DCGM_FI_"):
                    f = BY_NAME.get(name)
                    if not labels.get("gpu", "").isdigit():
                        continue  # not a per-GPU sample (or a MIG/entity label we do not map)
                    node = labels.get("Hostname") or default_node
                    gpu = int(labels["gpu"])
                    exported.setdefault(node, set())
                    if f is None:
                        continue
                    exported[node].add(f.key)
                    if is_blank(v):
                        blank.setdefault((node, gpu), set()).add(f.key)
                        continue
                    got.setdefault((node, gpu), set()).add(f.key)
                    vals = gpus.setdefault((node, gpu), {})
                    vals[f.signal] = vals.get(f.signal, 0.0) + v if f.signal == Signal.NVLINK_ERRORS else v
                elif name.startswith("node_infiniband_") and "device" in labels:
                    ports.setdefault(f"{labels['device']}:{labels.get('port', '1')}", {})[name] = v
        for key in sorted(set(gpus) | set(blank)):
            node, gpu = key
            for k in sorted(got.get(key, ())):
                self.unavailable.clear(out, node, k, ts, gpu=gpu)
            for k in sorted(blank.get(key, set()) - got.get(key, set())):
                self.unavailable.mark(
                    out,
                    node,
                    k,
                    f"GPU {gpu}: {field_names(k)}: blank (not supported on this GPU or not collected)",
                    ts,
                    gpu=gpu,
                )
            self.dcgm.emit(out, node, gpu, gpus.get(key, {}), ts, self.name)
        for node, keys in exported.items():
            for k in DCGM_EXPECTED:
                if k in keys:
                    self.unavailable.clear(out, node, k, ts)
                else:
                    self.unavailable.mark(
                        out,
                        node,
                        k,
                        f"{field_names(k)}: not exported by dcgm-exporter "
                        "(add it to the exporter's counters CSV)",
                        ts,
                    )
        for nic, m in sorted(ports.items()):
            self._ib_port(out, default_node, nic, m, ts)
        return out

    def _ib_port(self, out: Reading, node: str, nic: str, m: dict[str, float], ts: float) -> None:
        state = m.get("node_infiniband_state_id")
        active = state == STATE_ACTIVE
        if state is None or not self.expected.expected(node, nic, active):
            return
        out.samples.append(sample(node, Signal.NIC_STATE, 1 if active else 0, ts, nic=nic))
        if "node_infiniband_physical_state_id" in m:
            out.samples.append(
                sample(node, Signal.NIC_PHYS_STATE, m["node_infiniband_physical_state_id"], ts, nic=nic)
            )
        if "node_infiniband_rate_bytes_per_second" in m:
            rate = m["node_infiniband_rate_bytes_per_second"] * 8 / 1e9
            out.samples.append(sample(node, Signal.NIC_RATE, rate if active else 0.0, ts, nic=nic))
        # the "legacy" metrics read counters_ext/*_64 (64-bit): preferred where present
        wide = m.get("node_infiniband_legacy_data_transmitted_bytes_total")
        tx = wide if wide is not None else m.get("node_infiniband_port_data_transmitted_bytes_total")
        if tx is not None:
            out.samples.append(sample(node, Signal.NIC_TX_BYTES, tx, ts, nic=nic))
            cs = CounterSet()
            # the exporter multiplies the 4-octet words by 4
            cs.add("port_xmit_data_64" if wide is not None else "port_xmit_data", int(tx) // 4, scale=4)
            emit_rate(out, self.rates, self.unavailable, node, nic, Signal.NIC_TX_GBPS, "tx", cs, ts, 8 / 1e9)
        rx = m.get(
            "node_infiniband_legacy_data_received_bytes_total",
            m.get("node_infiniband_port_data_received_bytes_total"),
        )
        if rx is not None:
            out.samples.append(sample(node, Signal.NIC_RX_BYTES, rx, ts, nic=nic))
        downed = m.get("node_infiniband_link_downed_total")
        if downed is not None:
            out.samples.append(sample(node, Signal.NIC_LINK_DOWNED, downed, ts, nic=nic))
        wait = m.get("node_infiniband_port_transmit_wait_total")
        if wait is not None:
            out.samples.append(sample(node, Signal.NIC_CONGESTION, wait, ts, nic=nic))
            cong = CounterSet()
            cong.add("port_xmit_wait", int(wait))
            emit_rate(
                out, self.rates, self.unavailable, node, nic, Signal.NIC_CONGESTION_RATE, "cong", cong, ts
            )
        errs = CounterSet()
        for metric, counter in IB_ERRORS.items():
            if metric in m:
                errs.add(counter, int(m[metric]))
        if any(metric in m for metric in IB_ERRORS):
            out.samples.append(sample(node, Signal.NIC_ERRORS, errs.total, ts, nic=nic))
            emit_rate(out, self.rates, self.unavailable, node, nic, Signal.NIC_ERROR_RATE, "err", errs, ts)
