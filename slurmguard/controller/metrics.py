"""Prometheus metrics of the controller (its own registry, served on /metrics)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slurmguard.store import NodeState
from slurmguard.wire import UnavailableSignal

if TYPE_CHECKING:  # the loop imports this module
    from slurmguard.controller.loop import Controller, CycleResult


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.nodes = Gauge("slurmguard_nodes", "Nodes by lifecycle state", ["state"], registry=r)
        self.actions = Counter(
            "slurmguard_actions_total", "Slurm actions taken by the controller", ["action"], registry=r
        )
        self.suppressed = Counter(
            "slurmguard_actions_suppressed_total",
            "Actions held back by the breaker, rate limit or ownership",
            registry=r,
        )
        self.detection_delay = Histogram(
            "slurmguard_detection_delay_seconds",
            "Slowdown onset to detection",
            buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.breaker = Gauge(
            "slurmguard_breaker_open", "1 while the circuit breaker holds actions back", registry=r
        )
        self.report_lag = Gauge(
            "slurmguard_report_lag_seconds", "Seconds since the node's last report", ["node"], registry=r
        )
        self.reports = Counter("slurmguard_reports_total", "Agent reports received", ["outcome"], registry=r)
        self.http_refused = Counter(
            "slurmguard_http_refused_total",
            "HTTP requests refused other than reports (overload, rate, access)",
            ["reason"],
            registry=r,
        )
        self.http_connections = Counter(
            "slurmguard_http_connections_total",
            "Connections accepted by the controller's listeners (kept alive: about one per agent)",
            registry=r,
        )
        self.foreign_ranks = Counter(
            "slurmguard_foreign_ranks_total",
            "Ranks reported for a job by a node outside its Slurm allocation (dropped)",
            registry=r,
        )
        self.cycle_errors = Counter(
            "slurmguard_cycle_errors_total", "Errors inside controller cycles", registry=r
        )
        self.ring_errors = Gauge(
            "slurmguard_agent_ring_errors",
            "Ring problems a node's agent counted since it started, by kind "
            "(rings skipped or repaired, samples dropped)",
            ["node", "kind"],
            registry=r,
        )
        self.last_cycle = Gauge(
            "slurmguard_last_cycle_timestamp_seconds", "Unix time of the last cycle", registry=r
        )
        self.leader = Gauge(
            "slurmguard_controller_active",
            "1 while this controller holds the lease and acts, 0 while standby "
            "(PostgreSQL; always 1 on SQLite)",
            registry=r,
        )
        self.leader.set(1)
        self.lease_epoch = Gauge(
            "slurmguard_lease_epoch", "Lease epoch this controller holds (0: none)", registry=r
        )
        self._dropped_seen = 0
        self.telemetry_dropped = Counter(
            "slurmguard_telemetry_dropped",
            "Telemetry samples dropped unscored because a node queued more "
            "than controller.keep_samples_per_node",
            registry=r,
        )
        self.unavailable = Gauge(
            "slurmguard_telemetry_unavailable",
            "1 per signal a node's agent cannot read now (signal=source: the whole source)",
            ["node", "source", "signal", "device"],
            registry=r,
        )

    def observe_cycle(self, controller: Controller, res: CycleResult) -> None:
        for action, _ in res.actions:
            self.actions.labels(action).inc()
        if res.suppressed:
            self.suppressed.inc(len(res.suppressed))
        if res.foreign_ranks:
            self.foreign_ranks.inc(res.foreign_ranks)
        if res.errors:
            self.cycle_errors.inc(len(res.errors))
        self.breaker.set(1 if controller.breaker_open else 0)
        counts = {s.value: 0 for s in NodeState}
        counts.update(controller.store.node_counts())
        for state, n in counts.items():
            self.nodes.labels(state).set(n)
        for node, lag in controller.fleet.report_lag(res.at).items():
            self.report_lag.labels(node).set(lag)
        for node, kinds in controller.fleet.ring_errors().items():
            for kind, n in kinds.items():
                self.ring_errors.labels(node, kind).set(n)
        dropped = controller.fleet.dropped_samples
        if dropped > self._dropped_seen:
            self.telemetry_dropped.inc(dropped - self._dropped_seen)
            self._dropped_seen = dropped
        self.last_cycle.set(res.at)
        self.observe_unavailable(controller.fleet.unavailable(res.at))

    def forget_nodes(self, nodes: Iterable[str]) -> None:
        """Drop the per-node series of nodes that left the cluster, so /metrics
        does not grow with every node that ever reported."""
        gone = set(nodes)
        for node in gone:
            try:
                self.report_lag.remove(node)
            except KeyError:
                pass
        for labels in [k for k in self.ring_errors._metrics if k[0] in gone]:  # noqa: SLF001
            self.ring_errors.remove(*labels)

    def observe_unavailable(self, by_node: Mapping[str, Iterable[UnavailableSignal]]) -> None:
        """Exactly the signals the live reports say cannot be read (a signal that
        is readable again, or a node gone stale, drops out)."""
        self.unavailable.clear()
        for node, rows in by_node.items():
            for u in rows:
                device = f"gpu{u.gpu}" if u.gpu is not None else (u.nic or "node")
                self.unavailable.labels(node, u.source, u.signal, device).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
