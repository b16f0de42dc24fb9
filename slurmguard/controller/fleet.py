"""The controller's in-memory view of what the agents reported.

Only the latest report of each node is kept: reports carry rolling windows,
so the latest one is all the controller needs, and a restarted controller is
whole again after one report per node. (epoch, seq) from one node must grow
(epoch: the agent process's start): a replayed or reordered report is refused,
a restarted agent's first report is taken.

Nothing a node reports about a job is trusted beyond that node: `job_ranks`
keeps only ranks reported by nodes Slurm allocated to the job, and counts the
others (`foreign_ranks`). Reports from nodes Slurm does not know are refused
(`set_known_nodes`), so the table cannot grow past the cluster.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from slurmguard.reports import AgentReport, RankReport, UnavailableSignal
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
        self._seq: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._known: frozenset[str] | None = None
        self.rejected = 0
        self.unknown_nodes = 0
        self.foreign_ranks = 0
        """Ranks dropped because their node is not in the job's allocation (cumulative)."""

    def set_known_nodes(self, nodes) -> None:
        """The nodes Slurm knows (from the last cycle); None = accept any node."""
        with self._lock:
            self._known = None if nodes is None else frozenset(nodes)
            if self._known is not None:
                for gone in set(self._latest) - self._known:
                    self._latest.pop(gone, None)
                    self._seq.pop(gone, None)

    def known(self, node: str) -> bool:
        k = self._known
        return k is None or node in k

    def ingest(self, report: AgentReport, received_at: float) -> bool:
        """Keep the report unless (epoch, seq) is not newer than the node's last one,
        or Slurm does not know the node."""
        key = (report.epoch, report.seq)
        with self._lock:
            if not self.known(report.node):
                self.unknown_nodes += 1
                return False
            last = self._seq.get(report.node)
            if last is not None and key <= last:
                self.rejected += 1
                return False
            self._seq[report.node] = key
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

    def job_ranks(self, job_id: int, now: float,
                  allocation: tuple[str, ...] | None = None) -> tuple[list[tuple[str, RankReport]], int]:
        """(node, rank report) for every rank of the job reported by a live agent on a
        node of `allocation` (Slurm's node list of the job; None = any), and how many
        ranks other nodes claimed for the job (dropped, added to foreign_ranks)."""
        out, dropped = [], 0
        for r in self._live(now):
            for j in r.report.jobs:
                if j.job_id != job_id:
                    continue
                if allocation is not None and r.report.node not in allocation:
                    dropped += len(j.ranks)
                    continue
                out.extend((r.report.node, rk) for rk in j.ranks)
        with self._lock:
            self.foreign_ranks += dropped
        return out, dropped

    def unavailable(self, now: float) -> dict[str, list[UnavailableSignal]]:
        """node -> the signals its agent cannot read now (latest live report)."""
        return {r.report.node: list(r.report.unavailable) for r in self._live(now)}

    def telemetry(self, since: float, until: float, now: float) -> list[TelemetrySample]:
        """Samples with since < timestamp <= until from live agents."""
        out = []
        for r in self._live(now):
            for t in r.report.telemetry:
                if since < t.timestamp <= until:
                    out.append(TelemetrySample(node=r.report.node, signal=t.signal, value=t.value,
                                               unit=t.unit, timestamp=t.timestamp, gpu=t.gpu, nic=t.nic))
        return out
