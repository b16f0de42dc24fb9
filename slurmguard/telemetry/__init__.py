"""Telemetry sources behind one protocol (TelemetrySource.sample() -> Reading).

    NvmlSource(node, nvml=None)            pynvml; FakeNvml for machines without GPUs
    DcgmSource(node, reader=None)          DCGM's DcgmReader bindings when installed
    PrometheusSource([Target(url, node)])  dcgm-exporter / node_exporter scrape
    InfinibandSource(node, root=...)       /sys/class/infiniband
    SimTelemetrySource(nodes, profiles)    deterministic fault profiles
`open_source(kind, node, ...)` builds one from agent.telemetry_source.
"""

from __future__ import annotations

from typing import Any

from slurmguard.errors import ConfigError
from slurmguard.telemetry.base import (HARD_XIDS, Deadline, Reading, Signal, SourceEvent, TelemetrySample,
                                       TelemetrySource)

__all__ = ["HARD_XIDS", "Deadline", "Reading", "Signal", "SourceEvent", "TelemetrySample",
           "TelemetrySource", "open_source"]


def open_source(kind: str, node: str, **kw: Any) -> TelemetrySource | None:
    """A source for agent.telemetry_source: sim | nvml | dcgm | prometheus | none.

    Keyword arguments go to the source (clock, timeout_s, profiles/nodes/seed for
    sim, targets for prometheus, root for infiniband).
    """
    if kind == "none":
        return None
    if kind == "sim":
        from slurmguard.telemetry.sim import SimTelemetrySource

        return SimTelemetrySource(kw.pop("nodes", [node]), kw.pop("profiles", None), **kw)
    if kind == "nvml":
        from slurmguard.telemetry.nvml import NvmlSource

        return NvmlSource(node, **kw)
    if kind == "dcgm":
        from slurmguard.telemetry.dcgm import DcgmSource

        return DcgmSource(node, **kw)
    if kind == "prometheus":
        from slurmguard.telemetry.prometheus import PrometheusSource, Target

        targets = kw.pop("targets", None) or [Target("http://127.0.0.1:9400/metrics", node),
                                              Target("http://127.0.0.1:9100/metrics", node)]
        return PrometheusSource(targets, **kw)
    if kind == "infiniband":
        from slurmguard.telemetry.infiniband import InfinibandSource

        return InfinibandSource(node, **kw)
    raise ConfigError(f"agent.telemetry_source: unknown source '{kind}'")
