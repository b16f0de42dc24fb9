"""The node agent: read this node's rings, analyse locally, sample telemetry,
report to the controller; shut down cleanly on SIGTERM.

Nothing a job writes may stop the agent: each ring is read and analysed in
isolation, a failure is counted (report.ring_errors) and logged once, and
the other rings and jobs go on; a failing cycle is logged and the next one
runs."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from slurmguard.agent.analysis import READ_AHEAD, RING_READ_S, RankAnalyzer
from slurmguard.agent.rings import RingTracker, SlurmJobs, TrackedRing
from slurmguard.agent.sender import ReportSender
from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy
from slurmguard.service import stop_on_signals
from slurmguard.slurm.client import SlurmClient
from slurmguard.telemetry.base import TelemetrySource, UnavailableSet
from slurmguard.wire import AgentReport, JobReport, RankReport, TelemetryRecord

log = logging.getLogger(__name__)


@dataclass
class Agent:
    node: str
    policy: Policy
    sender: ReportSender
    """Delivers every report to agent.controller_url."""
    also: list[ReportSender] = field(default_factory=list)
    """One more sender per agent.also_report_to (the other controllers of a pair)."""
    source: TelemetrySource | None = None
    clock: Clock = field(default_factory=SystemClock)
    ring_root: str | None = None
    slurm: SlurmClient | None = None
    """The Slurm client that says which jobs run on this node (required to read any ring)."""

    def __post_init__(self) -> None:
        p = self.policy.agent
        jobs = SlurmJobs(self.slurm, self.node) if self.slurm is not None else (lambda: None)
        self.tracker = RingTracker(self.ring_root or p.ring_root, self.node, jobs, p.max_ops_per_rank)
        self.analyzers: dict[tuple, RankAnalyzer] = {}
        #: (ring key, path) -> TrackedRing.appended at its analyser's last look
        self._looked: dict[tuple, int] = {}
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
            self._telemetry.append(
                TelemetryRecord(
                    signal=s.signal, value=s.value, unit=s.unit, timestamp=s.timestamp, gpu=s.gpu, nic=s.nic
                )
            )
        self._unavailable.update(reading.events, self.node)
        for e in reading.events:
            self._events.append(f"{e.source} {e.kind}: {e.detail}")
        # bounded even if reports cannot be built for a while
        self._telemetry = self._telemetry[-20000:]
        self._events = self._events[-100:]

    def _analyse(self, tr: TrackedRing, report: bool) -> RankReport | None:
        """The rank's report of its ring as it stands (report=True), else
        None, its analyser brought up to date (derive: the iterations fed to
        its detector); None too when the analysis failed (counted, logged)."""
        path = tr.reader.path
        key = (tr.key, path)
        an = self.analyzers.setdefault(key, RankAnalyzer(self.policy.agent, self.policy.detection))
        dropped = an.dropped
        self._looked[key] = tr.appended
        try:
            if report:
                return an.report(tr)
            an.derive(tr)
        except Exception as exc:  # noqa: BLE001 - one ring never stops the others
            self.tracker.problem(path, "analysis", f"analysis failed: {exc!r}")
        finally:
            if an.dropped > dropped:
                self.tracker.problem(
                    path,
                    "dropped_samples",
                    "iteration samples that make no sense (negative, NaN, absurd) dropped",
                    an.dropped - dropped,
                )
        return None

    def read_rings(self) -> None:
        """Read the rings between reports (every RING_READ_S): a rank with
        READ_AHEAD of agent.max_ops_per_rank ops its analyser has not seen is
        analysed now, so that a job issuing more ops than the tracker keeps
        between two reports loses none of its iterations."""
        ahead = READ_AHEAD * self.policy.agent.max_ops_per_rank
        for tr in self.tracker.poll():
            if tr.appended - self._looked.get((tr.key, tr.reader.path), 0) >= ahead:
                self._analyse(tr, report=False)

    def build_report(self) -> AgentReport:
        rings = self.tracker.poll()
        jobs: dict[int, list] = {}
        live = set()
        for tr in rings:
            live.add((tr.key, tr.reader.path))
            tr.look_at_io(self.clock.now())
            rep = self._analyse(tr, report=True)
            if rep is None:
                continue
            if tr.start_ns.size == 0:
                continue  # no collective yet (or never: a job that opts in and only computes)
            jobs.setdefault(tr.job_id, []).append((tr, rep))
        for key in list(self.analyzers):
            if key not in live:
                del self.analyzers[key]
                self._looked.pop(key, None)
        job_reports = []
        for j, rows in sorted(jobs.items()):
            ranks: dict[int, object] = {}
            # two rings may claim one rank (a later job step, a forked writer):
            # the one that progressed last is the rank's current ring
            for tr, r in sorted(rows, key=lambda row: row[1].last_progress or 0.0, reverse=True):
                if r.rank in ranks:
                    self.tracker.problem(
                        tr.reader.path,
                        "invalid",
                        f"rank {r.rank} of job {j} has a newer ring on this node; this one is not reported",
                    )
                    continue
                ranks[r.rank] = r
            job_reports.append(
                JobReport(
                    job_id=j,
                    world_size=rows[0][0].header.world_size or None,
                    ranks=[ranks[k] for k in sorted(ranks)],
                )
            )
        self.seq += 1
        report = AgentReport(
            node=self.node,
            seq=self.seq,
            sent_at=self.clock.now(),
            jobs=job_reports,
            telemetry=self._telemetry,
            events=self._events,
            unavailable=self._unavailable.records(),
            ring_errors={k: v for k, v in self.tracker.errors.items() if v},
        )
        self._telemetry, self._events = [], []
        return report

    def step(self) -> AgentReport:
        report = self.build_report()
        self.sender.enqueue(report)
        self.sender.flush()
        for other in self.also:
            # each sender stamps its own (epoch, seq) on its copy and retries on its
            # own, with its own backoff: a controller that is down holds back no other
            other.enqueue(report)
            other.flush()
        return report


#: while a rank on the node runs slow (RankReport.newest_slower past the
#: moderate tier's slowdown), the agent reports this fraction of
#: agent.report_interval_s apart: the controller's evidence for naming the node
#: spans a report interval of iterations (controller.assess._since_change), and
#: sooner reports bring it sooner; a healthy node keeps the configured interval
EARLY_REPORT_FRACTION = 0.5


def run(agent: Agent, stop: threading.Event | None = None, once: bool = False) -> int:
    stop = stop or threading.Event()
    p = agent.policy.agent
    slower = 1.0 + agent.policy.response.tiers.moderate_slowdown

    stop_on_signals(stop, log)
    next_report = next_sample = next_read = agent.clock.monotonic()
    read_every = min(RING_READ_S, p.report_interval_s)
    try:
        while not stop.is_set():
            if agent.clock.monotonic() >= next_read:
                next_read = agent.clock.monotonic() + read_every
                try:
                    agent.read_rings()
                except Exception:  # noqa: BLE001 - the report reads them again
                    log.exception("ring read failed")
            if agent.clock.monotonic() >= next_sample:
                next_sample = agent.clock.monotonic() + p.sample_interval_s
                try:
                    agent.sample_telemetry()
                except Exception:  # noqa: BLE001 - a daemon never dies of one bad sample
                    log.exception("telemetry sample failed")
            if agent.clock.monotonic() >= next_report:
                next_report = agent.clock.monotonic() + p.report_interval_s
                try:
                    rep = agent.step()
                except Exception:  # noqa: BLE001 - the next cycle may well succeed
                    log.exception("report cycle failed")
                else:
                    if any(r.newest_slower(slower) for j in rep.jobs for r in j.ranks):
                        next_report -= (1.0 - EARLY_REPORT_FRACTION) * p.report_interval_s
                    log.debug(
                        "report %d: %d job(s), %d telemetry sample(s), %d queued",
                        rep.seq,
                        len(rep.jobs),
                        len(rep.telemetry),
                        len(agent.sender.queue),
                    )
            if once:
                break
            # the waits are real seconds, as the clock's own sleep is not (a fake one)
            due = min(next_sample, next_report, next_read) - agent.clock.monotonic()
            stop.wait(min(max(due, 0.01), p.sample_interval_s, p.report_interval_s, read_every))
    finally:
        agent.tracker.close()
        if agent.source is not None and hasattr(agent.source, "close"):
            agent.source.close()
        log.info("agent stopped (%d sent, %d dropped)", agent.sender.sent, agent.sender.dropped)
    return 0
