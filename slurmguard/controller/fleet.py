"""The controller's in-memory view of what the agents reported.

Only the latest report of each node is kept: reports carry rolling windows,
so the latest one is all the controller needs, and a restarted controller is
whole again after one report per node. Sequence numbers from one agent must
grow; a replayed or reordered report is ignored.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from slurmguard.reports import AgentReport, RankReport
from slurmguard.telemetry.base import TelemetrySample


@dataclass(frozen=True)
class Received:
    report: AgentReport
    received_at: float


class FleetView:
    """Thread-safe: the HTTP server ingests while the control loop reads."""

    def __init__(self, stale_s: float = 120.0) -> None:
        self.stale_s = stale_s
        self._latest: dict[str, Received] = {}
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.rejected = 0

    def ingest(self, report: AgentReport, received_at: float) -> bool:
        """Keep the report unless it is older than one already seen from that node."""
        with self._lock:
            last = self._seq.get(report.node)
            if last is not None and report.seq <= last and report.seq != 0:
                self.rejected += 1
                return False
            self._seq[report.node] = report.seq
            self._latest[report.node] = Received(report, received_at)
            return True

    def _live(self, now: float) -> list[Received]:
        with self._lock:
            return [r for r in self._latest.values() if now - r.received_at <= self.stale_s]

    def nodes_reporting(self, now: float) -> set[str]:
        return {r.report.node for r in self._live(now)}

    def report_lag(self, now: float) -> dict[str, float]:
        with self._lock:
            return {n: now - r.received_at for n, r in self._latest.items()}

    def ring_errors(self) -> dict[str, dict[str, int]]:
        """node -> ring problems its agent counted, by kind (latest report)."""
        with self._lock:
            return {n: dict(r.report.ring_errors) for n, r in self._latest.items()}

    def job_ids(self, now: float) -> set[int]:
        return {j.job_id for r in self._live(now) for j in r.report.jobs}

    def job_ranks(self, job_id: int, now: float) -> list[tuple[str, RankReport]]:
        """(node, rank report) for every rank of the job reported by a live agent."""
        out = []
        for r in self._live(now):
            for j in r.report.jobs:
                if j.job_id == job_id:
                    out.extend((r.report.node, rk) for rk in j.ranks)
        return out

    def telemetry(self, since: float, until: float, now: float) -> list[TelemetrySample]:
        """Samples with since < timestamp <= until from live agents."""
        out = []
        for r in self._live(now):
            for t in r.report.telemetry:
                if since < t.timestamp <= until:
                    out.append(TelemetrySample(node=r.report.node, signal=t.signal, value=t.value,
                                               unit=t.unit, timestamp=t.timestamp, gpu=t.gpu, nic=t.nic))
        return out
