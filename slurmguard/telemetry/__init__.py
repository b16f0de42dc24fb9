"""Telemetry sources behind one protocol (TelemetrySource.sample() -> Reading).

    NvmlSource(node, nvml=None)            pynvml; FakeNvml for machines without GPUs
    DcgmSource(node, reader=None)          DCGM's DcgmReader bindings when installed
    PrometheusSource([Target(url, node)])  dcgm-exporter / node_exporter scrape
    InfinibandSource(node, root=...)       /sys/class/infiniband
    SimTelemetrySource(nodes, profiles)    deterministic fault profiles
    MultiSource([...])                     several of them read as one
`open_source(kind, node, ...)` builds one from agent.telemetry_source and
agent.telemetry. A signal a source cannot read is an "unavailable" event,
once per change; the agent keeps the set (`UnavailableSet`) and reports it.
"""

from __future__ import annotations

from typing import Any

from slurmguard.errors import ConfigError
from slurmguard.telemetry.base import (
    HARD_XIDS,
    Deadline,
    Reading,
    Signal,
    SourceEvent,
    TelemetrySample,
    TelemetrySource,
    UnavailableSet,
)

__all__ = [
    "HARD_XIDS",
    "Deadline",
    "MultiSource",
    "Reading",
    "Signal",
    "SourceEvent",
    "TelemetrySample",
    "TelemetrySource",
    "UnavailableSet",
    "open_source",
]

DEFAULT_TARGETS = ("http://127.0.0.1:9400/metrics", "http://127.0.0.1:9100/metrics")


class MultiSource:
    """Several sources sampled as one (GPU telemetry and the node's IB ports)."""

    def __init__(self, sources: list[Any]) -> None:
        self.sources = sources
        self.name = "+".join(s.name for s in sources)

    def sample(self) -> Reading:
        out = Reading()
        for s in self.sources:
            out.extend(s.sample())
        return out

    def close(self) -> None:
        for s in self.sources:
            s.close()


def open_source(
    kind: str,
    node: str,
    *,
    infiniband: bool = False,
    ib_root: str = "/sys/class/infiniband",
    expected_ports: tuple[str, ...] | list[str] = (),
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    **kw: Any,
) -> TelemetrySource | None:
    """A source for agent.telemetry_source: sim | nvml | dcgm | prometheus | none.

    infiniband (nvml, dcgm): also sample the IB/RoCE ports under ib_root, with
    expected_ports (fnmatch patterns; empty = learned from ACTIVE ports), as
    agent.telemetry says. targets: the prometheus source's pages. Other keyword
    arguments go to the source (clock, timeout_s, profiles/nodes/seed for sim).
    """
    if kind == "none":
        return None
    if kind == "sim":
        from slurmguard.telemetry.sim import SimTelemetrySource

        return SimTelemetrySource(kw.pop("nodes", [node]), kw.pop("profiles", None), **kw)
    if kind == "prometheus":
        from slurmguard.telemetry.prometheus import PrometheusSource, Target

        return PrometheusSource(
            [Target(u, node) for u in targets], expected_ports=tuple(expected_ports), **kw
        )
    if kind == "nvml":
        from slurmguard.telemetry.nvml import NvmlSource

        gpu: TelemetrySource = NvmlSource(node, **kw)
    elif kind == "dcgm":
        from slurmguard.telemetry.dcgm import DcgmSource

        gpu = DcgmSource(node, **kw)
    else:
        raise ConfigError(f"agent.telemetry_source: unknown source '{kind}'")
    if not infiniband:
        return gpu
    from slurmguard.telemetry.infiniband import InfinibandSource

    ib = InfinibandSource(
        node,
        ib_root,
        clock=kw.get("clock"),
        timeout_s=kw.get("timeout_s", 2.0),
        expected_ports=tuple(expected_ports),
    )
    return MultiSource([gpu, ib])
