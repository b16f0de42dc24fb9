"""The node agent: read this node's rings, analyse locally, sample telemetry,
report to the controller; shut down cleanly on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

from slurmguard.agent.analysis import RankAnalyzer
from slurmguard.agent.rings import RingTracker
from slurmguard.agent.sender import ReportSender
from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy
from slurmguard.reports import AgentReport, JobReport, TelemetryRecord
from slurmguard.telemetry.base import UnavailableSet

log = logging.getLogger("slurmguard.agent")


@dataclass
class Agent:
    node: str
    policy: Policy
    sender: ReportSender
    source: object | None = None
    clock: Clock = field(default_factory=SystemClock)
    ring_root: str | None = None

    def __post_init__(self) -> None:
        p = self.policy.agent
        self.tracker = RingTracker(self.ring_root or p.ring_root, self.node, p.max_ops_per_rank)
        self.analyzers: dict[tuple, RankAnalyzer] = {}
        self.seq = 0
        self._telemetry: list[TelemetryRecord] = []
        self._events: list[str] = []
        self._unavailable = UnavailableSet()  # what cannot be read now: sent with every report

    def sample_telemetry(self) -> None:
        if self.source is None:
            return
        reading = self.source.sample()
        for s in reading.samples:
            if s.node != self.node:
                continue
            self._telemetry.append(TelemetryRecord(signal=s.signal, value=s.value, unit=s.unit,
                                                   timestamp=s.timestamp, gpu=s.gpu, nic=s.nic))
        self._unavailable.update(reading.events, self.node)
        for e in reading.events:
            self._events.append(f"{e.source} {e.kind}: {e.detail}")
        # bounded even if reports cannot be built for a while
        self._telemetry = self._telemetry[-20000:]
        self._events = self._events[-100:]

    def build_report(self) -> AgentReport:
        rings = self.tracker.poll()
        jobs: dict[int, list] = {}
        live = set()
        for tr in rings:
            key = (tr.key, tr.reader.path)
            live.add(key)
            an = self.analyzers.setdefault(key, RankAnalyzer(self.policy.agent, self.policy.detection))
            jobs.setdefault(tr.job_id, []).append((tr, an.report(tr)))
        for key in list(self.analyzers):
            if key not in live:
                del self.analyzers[key]
        job_reports = [JobReport(job_id=j, world_size=rows[0][0].header.world_size or None,
                                 ranks=sorted((r for _, r in rows), key=lambda r: r.rank))
                       for j, rows in sorted(jobs.items()) if j > 0]
        self.seq += 1
        report = AgentReport(node=self.node, seq=self.seq, sent_at=self.clock.now(), jobs=job_reports,
                             telemetry=self._telemetry, events=self._events,
                             unavailable=self._unavailable.records())
        self._telemetry, self._events = [], []
        return report

    def step(self) -> AgentReport:
        report = self.build_report()
        self.sender.enqueue(report)
        self.sender.flush()
        return report


def run(agent: Agent, stop: threading.Event | None = None, once: bool = False) -> int:
    stop = stop or threading.Event()
    p = agent.policy.agent

    def _stop(signum, _frame) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    next_report = agent.clock.monotonic()
    try:
        while not stop.is_set():
            agent.sample_telemetry()
            if agent.clock.monotonic() >= next_report:
                rep = agent.step()
                log.debug("report %d: %d job(s), %d telemetry sample(s), %d queued", rep.seq,
                          len(rep.jobs), len(rep.telemetry), len(agent.sender.queue))
                next_report = agent.clock.monotonic() + p.report_interval_s
            if once:
                break
            stop.wait(min(p.sample_interval_s, p.report_interval_s))
    finally:
        agent.tracker.close()
        if agent.source is not None and hasattr(agent.source, "close"):
            agent.source.close()
        log.info("agent stopped (%d sent, %d dropped)", agent.sender.sent, agent.sender.dropped)
    return 0
