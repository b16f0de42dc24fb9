"""One controller cycle: Slurm view + agent reports -> decisions -> audited actions.

Every decision is derived from the database (open incidents, the audit log)
plus the Slurm view (who drained a node, a job's restart count), never from
memory alone, so a controller killed at any point and restarted neither
repeats nor forgets an action:
- a drain is taken only if the node is not already drained by slurmguard (one
  that is, with its lifecycle still in service, is recorded as draining);
- a checkpoint signal only if the audit log has none for that incident (and,
  to a job that asked for one, before its requeue: a controller stopped between
  the drain and the signal leaves it to the next, with a cycle before the requeue);
- a requeue only if the job's restart count has not grown since detection.
Every Slurm action is written ahead (respond.actions: an intent before the
call, its audit row and store changes, the drained node's lifecycle or the
incident's outcome, in one transaction after it), and each cycle first settles
the intents a stopped controller left open against the Slurm view
(ActionExecutor.reconcile): an action Slurm shows taken is recorded once, under
the lease epoch it was taken with, one it does not is left to the decisions
below. A requeue takes seconds (Slurm's post-requeue hold is lifted once the
old run has ended): one recorded late has its hold lifted by the next cycles
(_lift_requeue_holds) instead of waiting minutes.

What a job can write is not trusted: ranks reported by nodes outside the job's
Slurm allocation are dropped and counted, every requeue and checkpoint signal
passes the breaker (safety.breaker.max_job_actions) and the rate limit on its
own, a checkpoint signal goes only to a job that asked for one in its comment
(plans.job_options), and an error while assessing or acting on one job is
recorded in that job's incident and the cycle goes on with the next job.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from slurmguard.clock import Clock
from slurmguard.config import Policy
from slurmguard.controller.assess import LOCALISE_S, assess_job, reason_text
from slurmguard.controller.fleet import FleetView
from slurmguard.controller.plans import PLAN_MIN_ITERS, PlanBook, job_options, timings_since
from slurmguard.detect.peers import PeerFlag, PeerScorer
from slurmguard.respond.actions import (
    LATE,
    ActionExecutor,
    incident_effect,
    lifecycle_effect,
    unsettled_after,
)
from slurmguard.respond.escalation import Action, Decision, InJob, gate
from slurmguard.respond.safety import SafetyGate
from slurmguard.respond.tiers import Culprit, JobAssessment, Tier, calls_for_a_tier, classify
from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.errors import NotOurs, SlurmError
from slurmguard.slurm.models import JobInfo, NodeInfo
from slurmguard.store import (
    AuditOutcome,
    IncidentRecord,
    IncidentStatus,
    NodeState,
    Store,
)
from slurmguard.wire import AgentReport, JobReport

if TYPE_CHECKING:  # metrics imports this module (for its annotations)
    from slurmguard.controller.metrics import ControllerMetrics

log = logging.getLogger(__name__)
#: at most one "slow, no node named" log line per job this often (s)
UNNAMED_LOG_S = 10.0
#: longest gap (s) between two cycles naming a node that still continues its
#: run of namings (Culprit.named_for_s): the localisation of a throttled rank's
#: noisy compute may miss a cycle or two (assess.LOCALISE_S)
NAMED_GAP_S = LOCALISE_S
#: longest gap (s) between two cycles that see a job slow with no node named
#: that still continues that slowdown's run towards an incident (Controller._unnamed)
UNNAMED_GAP_S = 10.0
#: ... and the least time (s) such a run must last to be an incident, whatever
#: response.tiers.sustained_s: healthy jobs on a busy host (the dev cluster's
#: shared cores) stay 20-30% slower, every rank alike, for 10-20 s at a time,
#: which at the dev policy's 10 s made an incident of a healthy job; a fault
#: no node can be named for lasts
UNNAMED_HELD_S = 60.0
#: nodes a running job needs for its nodes to be scored as one peer group
MIN_JOB_PEER_NODES = 3

#: seconds after a requeue during which a later cycle still lifts its post-requeue hold
#: (Slurm's own hold is about two minutes)
REQUEUE_SETTLE_S = 120.0

_TIER_NAME = {Tier.NONE: "none", Tier.VERIFY: "verify", Tier.DRAIN: "drain", Tier.REQUEUE: "requeue"}


def _extend_run(runs: dict[Any, tuple[float, float]], key: Any, now: float, gap_s: float) -> float:
    """Add this cycle (now, Unix s) to key's run of cycles in `runs` (key ->
    (first, last) Unix s) and return the run's first: a gap over gap_s since
    its last cycle starts a new run."""
    first, last = runs.get(key, (now, now))
    if now - last > gap_s:
        first = now
    runs[key] = (first, now)
    return first


class Ticker(Protocol):
    def tick(self, view: tuple[list[NodeInfo], list[JobInfo]] | None = None) -> Any:
        """view: the cycle's Slurm view (nodes, jobs), None = read a fresh one."""
        ...


@dataclass
class CycleResult:
    """What one cycle saw and did (for logs, metrics and tests)."""

    at: float
    assessments: dict[int, JobAssessment] = field(default_factory=dict)
    actions: list[tuple[str, str]] = field(default_factory=list)
    suppressed: list[str] = field(default_factory=list)
    flags: list[PeerFlag] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    foreign_ranks: int = 0
    """Ranks reported for a job by nodes outside its allocation, dropped this cycle."""


class Controller:
    def __init__(
        self,
        policy: Policy,
        store: Store,
        slurm: SlurmClient,
        clock: Clock,
        *,
        fleet: FleetView | None = None,
        executor: ActionExecutor | None = None,
        sweeper: Ticker | None = None,
        actor: str = "slurmguard",
        metrics: ControllerMetrics | None = None,
    ) -> None:
        self.policy = policy
        self.store = store
        self.slurm = slurm
        self.clock = clock
        self.actor = actor
        self.fleet = fleet or FleetView(
            policy.controller.report_stale_s,
            keep_steps=policy.controller.keep_steps_per_rank,
            keep_samples=policy.controller.keep_samples_per_node,
        )
        self.executor = executor or ActionExecutor(
            slurm,
            store,
            actor=actor,
            dry_run=policy.safety.dry_run,
            unsettled_s=unsettled_after(policy.slurm),
        )
        self.safety = SafetyGate(store, policy.safety, actor)
        self.scorer = PeerScorer(policy.detection.peers)
        self.sweeper = sweeper
        self.metrics = metrics
        self._known_nodes: set[str] = set()
        self._scored_until = clock.now()
        self._flags: dict[str, list[PeerFlag]] = {}
        #: job -> when its "slow but no node named" was last logged (Unix s)
        self._unnamed_said: dict[int, float] = {}
        #: (job, node) -> (first, last) Unix s of the node's current run of namings
        #: whose culprit must be named for a while first (Culprit.named_for_s)
        self._named: dict[tuple[int, str], tuple[float, float]] = {}
        #: job -> (first, last) Unix s of its current run of cycles slow enough for a
        #: drain tier with no node named and no incident yet
        self._unnamed: dict[int, tuple[float, float]] = {}
        self.breaker_open = False
        self.plans = PlanBook()
        #: jobs whose assessment last cycle had an open slowdown, a stall or a
        #: culprit: their reports wake the next cycle (wants_cycle). Replaced
        #: whole at the end of each cycle (the HTTP thread reads it)
        self.watched: frozenset[int] = frozenset()

    # ------------------------------------------------------------------ the cycle
    def cycle(self) -> CycleResult:
        """One pass over the fleet: one Slurm read (SlurmClient.fleet), one read of
        the node table and one of the live incidents, new nodes registered in one
        transaction, each job's ranks from one index of the reports; the database
        is written only where something happened (an incident, an action's audit,
        which must be durable before the next action, so each commits on its own).

        Python's cyclic garbage collector is paused while the cycle runs: the
        cycle's temporaries (a peer window's hundreds of thousands of samples at
        10,000 nodes) are freed by reference counting when it ends, but while they
        live they make the collector walk every object of the fleet's reports, two
        or three times a cycle (0.5 s of a 1.8 s cycle at 5,000 nodes). Collections
        resume after it, with only what survived it counted."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._cycle()
        finally:
            if was:
                gc.enable()

    def _cycle(self) -> CycleResult:
        now = self.clock.now()
        res = CycleResult(at=now)
        try:
            node_list, job_list = self.slurm.fleet()
        except SlurmError as exc:
            res.errors.append(str(exc))
            log.error("cycle skipped: %s", exc)
            self._observe(res)
            return res
        nodes = {n.name: n for n in node_list}
        jobs = {j.job_id: j for j in job_list}
        try:
            # before any decision: they read what a stopped controller's actions changed
            self.executor.reconcile(nodes, jobs)
        except SlurmError as exc:  # NotLeader included
            res.errors.append(f"unfinished actions: {exc}")
            log.error("cycle skipped: unfinished actions not settled: %s", exc)
            self._observe(res)
            return res
        self._sync_nodes(nodes)
        gone = self.fleet.set_known_nodes(nodes)
        if gone and self.metrics is not None:
            self.metrics.forget_nodes(gone)
        self._score_telemetry(now, jobs, res)
        self.breaker_open = False
        partitions = self._partitions(nodes)
        slow_nodes: set[str] = set()
        index = self.fleet.job_index(now)
        self._unnamed_said = {j: t for j, t in self._unnamed_said.items() if j in index}
        self._named = {k: v for k, v in self._named.items() if k[0] in index and now - v[1] <= NAMED_GAP_S}
        self._unnamed = {j: v for j, v in self._unnamed.items() if j in index and now - v[1] <= UNNAMED_GAP_S}
        live = self._live_incidents()
        self._close_ended(live, jobs)
        self._lift_requeue_holds(live, jobs, res)
        for job_id in sorted(index):
            job = jobs.get(job_id)
            if job is None or job.state != "RUNNING":
                continue
            try:
                self._job(job, nodes, partitions, slow_nodes, now, res, index, live.get(job_id))
            except SlurmError as exc:
                res.errors.append(f"job {job_id}: {exc}")
            except Exception as exc:  # noqa: BLE001 - one job's bad data must not stop the others
                self._job_failed(job_id, exc, now, res)
        self._verify_flags(nodes, jobs, slow_nodes, res, now)
        tiers = self.policy.response.tiers
        self.watched = frozenset(
            j
            for j, a in res.assessments.items()
            if a.onset is not None or a.culprits or a.stalled_for_s > 0 or calls_for_a_tier(a.slowdown, tiers)
        )
        self.breaker_open = self.breaker_open or self.safety.breaker_open(now)
        if self.sweeper is not None:
            try:
                # the cycle's Slurm view, unless this cycle changed Slurm: then the
                # sweeper reads its own, so it sees the drains just taken
                view = None if res.actions else (node_list, job_list)
                self.sweeper.tick(view)
            except SlurmError as exc:
                res.errors.append(f"sweeps: {exc}")
        self._observe(res)
        return res

    def wants_cycle(self, report: AgentReport) -> bool:
        """Whether this report should be judged now rather than at the next
        cycle (controller.daemon wakes the cycle for it): it carries a job
        whose last assessment had an open slowdown, a stall or a culprit
        (Controller.watched), or a rank whose newest iterations
        (RankReport.newest_slower) were all slower than its baseline by the moderate tier's slowdown.
        A fault is then acted on one report after it shows, not up to a cycle
        interval later; a healthy fleet's reports wake nothing, so the cycle
        rate at scale stays the configured one. Called from the HTTP thread:
        reads only the report and the frozen `watched`."""
        bar = 1.0 + self.policy.response.tiers.moderate_slowdown
        watched = self.watched
        return any(j.job_id in watched or any(r.newest_slower(bar) for r in j.ranks) for j in report.jobs)

    def _job(
        self,
        job: JobInfo,
        nodes: dict[str, NodeInfo],
        partitions: dict[str, list[str]],
        slow_nodes: set[str],
        now: float,
        res: CycleResult,
        index: dict[int, list[tuple[str, JobReport]]] | None = None,
        incident: IncidentRecord | None = None,
    ) -> None:
        since = _restart_cut(incident)
        ranks, foreign = self.fleet.job_ranks(job.job_id, now, allocation=job.nodes, index=index)
        if foreign:
            res.foreign_ranks += foreign
            log.warning(
                "job %d: dropped %d rank(s) reported by nodes outside its allocation %s",
                job.job_id,
                foreign,
                ",".join(job.nodes),
            )
        a = assess_job(
            job.job_id, job.nodes, ranks, self._flags, self.policy, now, since=since, resumed=job.resumed_at
        )
        if a is None:
            return
        a = self._named_long_enough(a, now)
        res.assessments[job.job_id] = a
        self._review_plan(a, job, ranks, incident, now, res)
        tier = classify(a, self.policy.response.tiers, now)
        if a.onset is not None or a.culprits:
            # the detection's timeline, cycle by cycle (-vv): what was seen when
            log.debug(
                "job %d: step %+.0f%% since %.2f, tier %s, named %s",
                job.job_id,
                100 * a.slowdown,
                a.onset or 0.0,
                tier.label,
                ",".join(c.node for c in a.culprits) or "none",
            )
        if tier >= Tier.DRAIN:
            slow_nodes.update(c.node for c in a.culprits)
            if not a.culprits and now - self._unnamed_said.get(job.job_id, -UNNAMED_LOG_S) >= UNNAMED_LOG_S:
                # the incident keeps what was seen at first detection; the log says
                # why a slow job still has no node named, as that changes
                self._unnamed_said[job.job_id] = now
                log.info(
                    "job %d: step %+.0f%%, no node named: %s",
                    job.job_id,
                    100 * a.slowdown,
                    a.evidence.get("localisation") or "stalled, no rank to blame",
                )
        self._respond(a, tier, job, nodes, partitions, incident, now, res, ranks)

    def _named_long_enough(self, a: JobAssessment, now: float) -> JobAssessment:
        """The assessment without the culprits not yet named for their
        Culprit.named_for_s, cycle after cycle (a gap of up to NAMED_GAP_S
        between two namings keeps the run going): the localisation's
        evidence against a rank's own baseline can hang on a spell of uneven
        load; a fault stays. Without culprits left, the localisation says
        what is awaited."""
        kept, waiting = [], []
        for c in a.culprits:
            if c.named_for_s <= 0:
                kept.append(c)
                continue
            first = _extend_run(self._named, (a.job_id, c.node), now, NAMED_GAP_S)
            if now - first >= c.named_for_s:
                kept.append(c)
            else:
                waiting.append(
                    f"{c.node} named for {now - first:.0f} s of the {c.named_for_s:.0f} s it needs ({c.why})"
                )
        if not waiting:
            return a
        evidence = a.evidence
        if not kept:
            evidence = {**evidence, "localisation": "; ".join(waiting)}
        return replace(a, culprits=tuple(kept), evidence=evidence)

    def _unnamed_held(self, a: JobAssessment, now: float) -> bool:
        """Whether a slowdown no node is named for has called for a drain tier,
        cycle after cycle, for response.tiers.sustained_s: only then is it an
        incident (one that says no node is to blame), and for UNNAMED_HELD_S at
        least. A healthy job on a busy host slows job-wide by 20-35% for seconds
        at a time (every rank's compute alike); recorded at once, every such job
        would read in the triage report as an incident. A slowdown that names a
        node is recorded at once."""
        first = _extend_run(self._unnamed, a.job_id, now, UNNAMED_GAP_S)
        return now - first >= max(self.policy.response.tiers.sustained_s, UNNAMED_HELD_S)

    def _job_failed(self, job_id: int, exc: Exception, now: float, res: CycleResult) -> None:
        """Record an error of one job's assessment/plan in its incident (once per text)."""
        why = f"{type(exc).__name__}: {exc}"[:400]
        res.errors.append(f"job {job_id}: {why}")
        log.error("job %d skipped this cycle: %s", job_id, why, exc_info=log.isEnabledFor(logging.DEBUG))
        try:
            incident = self._live_incident(job_id)
            if incident is None:
                open_errors = [
                    r
                    for r in self.store.incidents(job_id=str(job_id))
                    if r.kind == "error" and r.status == IncidentStatus.OPEN
                ]
                incident = open_errors[-1] if open_errors else None
            if incident is None:
                self.store.add_incident(
                    str(job_id),
                    nodes=[],
                    tier=_TIER_NAME[Tier.NONE],
                    onset_at=now,
                    detected_at=now,
                    kind="error",
                    evidence={"error": why, "error_at": now},
                )
            elif incident.evidence.get("error") != why:
                self.store.update_incident(incident.id, evidence={"error": why, "error_at": now})
        except Exception as exc2:  # noqa: BLE001 - the database itself may be what failed
            res.errors.append(f"job {job_id}: error not recorded: {exc2}")

    def stand_by(self) -> None:
        """Called while another controller holds the lease (instead of a cycle): the
        telemetry that arrived meanwhile is the active controller's to score, so it
        is dropped here, and this controller's first peer window after it takes
        over starts then. Reports' step windows are kept: they carry each rank's
        recent iterations, so the first cycle after a takeover assesses every job."""
        self.fleet.take_telemetry()
        self._scored_until = self.clock.now()

    # ------------------------------------------------------------------ pieces
    def _sync_nodes(self, nodes: dict[str, NodeInfo]) -> None:
        new = {name: list(n.partitions) for name, n in nodes.items() if name not in self._known_nodes}
        if new:
            self.store.register_nodes(new)  # one transaction, however many
            self._known_nodes.update(new)
        self._known_nodes.intersection_update(nodes)

    @staticmethod
    def _partitions(nodes: dict[str, NodeInfo]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in nodes.values():
            for p in n.partitions:
                out.setdefault(p, []).append(n.name)
        return out

    def _score_telemetry(self, now: float, jobs: dict[int, JobInfo], res: CycleResult) -> None:
        """Score one peer window once per peers.window_s (Guard 4.2), over every sample
        the agents sent since the last window (each sample scored once)."""
        if now - self._scored_until < self.policy.detection.peers.window_s:
            return
        window = self.fleet.take_telemetry()
        self._scored_until = now
        if not window:
            return
        # a job's nodes do the same work: they are each other's peers. Under 3 nodes
        # no majority says which one deviates (a whole node's GPUs are half of a
        # 2-node job's): those nodes are compared with the rest of the fleet
        group = {
            n: f"job:{j.job_id}"
            for j in jobs.values()
            if j.state == "RUNNING" and len(j.nodes) >= MIN_JOB_PEER_NODES
            for n in j.nodes
        }
        flags = self.scorer.window(window.samples, group, means=window.means)
        self._flags = {}
        for f in flags:
            self._flags.setdefault(f.node, []).append(f)
        res.flags = flags

    def _live_incidents(self) -> dict[int, Any]:
        """job id -> its latest incident that is not closed (open, mitigated or
        suppressed), for every job, from one read."""
        out: dict[int, Any] = {}
        for r in self.store.live_incidents():
            if r.kind == "error":
                continue
            try:
                out[int(r.job_id)] = r  # oldest first: the latest wins
            except ValueError:
                continue
        return out

    def _close_ended(self, live: dict[int, Any], jobs: dict[int, JobInfo]) -> None:
        """Resolve the open tier-none incidents (a slowdown seen, no node to
        blame, nothing done) of jobs that have ended: Slurm no longer lists
        them, or lists them in a final state. An incident open for a job long
        gone reads in the triage report as a slowdown still going on; one at
        a higher tier keeps its status (mitigated, suppressed) for the record."""
        for job_id, inc in list(live.items()):
            job = jobs.get(job_id)
            if job is not None and not job.ended:
                continue
            if inc.status != IncidentStatus.OPEN or _tier_of(inc.tier) != Tier.NONE:
                continue
            self.store.update_incident(
                inc.id, status=IncidentStatus.RESOLVED, outcome="the job ended; no node was to blame"
            )
            del live[job_id]

    def _live_incident(self, job_id: int) -> IncidentRecord | None:
        """The job's latest incident that is not closed (open, mitigated or suppressed)."""
        rows = [
            r
            for r in self.store.incidents(job_id=str(job_id))
            if r.kind != "error"
            and r.status in (IncidentStatus.OPEN, IncidentStatus.MITIGATED, IncidentStatus.SUPPRESSED)
        ]
        return rows[-1] if rows else None

    def _respond(
        self,
        a: JobAssessment,
        tier: Tier,
        job: JobInfo,
        nodes: dict[str, NodeInfo],
        partitions: dict[str, list[str]],
        incident: IncidentRecord | None,
        now: float,
        res: CycleResult,
        ranks: list | None = None,
    ) -> None:
        if tier < Tier.DRAIN:
            return
        if incident is not None and incident.evidence.get("requeued_at") is not None:
            if a.onset is None or a.onset <= float(incident.evidence["requeued_at"]):
                return  # the slowdown of the run we already requeued
            incident = None  # a new slowdown in the restarted run: a new incident
        elif (
            incident is not None
            and _tier_of(incident.tier) < Tier.DRAIN
            and job.restarts > _restarts_at_detection(incident, job)
        ):
            # nothing was done about it and the job has restarted since (an admin,
            # a preemption): that slowdown was the old run's. Its "restarts at
            # detection" would make this run's requeue look done already
            self.store.update_incident(
                incident.id, status=IncidentStatus.RESOLVED, outcome="the job restarted before any action"
            )
            incident = None
        elif (
            incident is not None
            and a.culprits
            and _tier_of(incident.tier) == Tier.NONE
            and not incident.evidence.get("culprits")
        ):
            # a job-wide slowdown no node was to blame for, then a node named: a
            # fault of its own, recorded as one (the unlocalised incident's note
            # and nodes would otherwise stand beside a drain)
            named = ", ".join(sorted({c.node for c in a.culprits}))
            self.store.update_incident(
                incident.id,
                status=IncidentStatus.RESOLVED,
                outcome=f"no node was to blame; followed by a slowdown that named {named}",
            )
            incident = None
        if incident is None and not a.culprits and not self._unnamed_held(a, now):
            return
        if incident is None:
            # recorded at first detection, before any action is due: the
            # detection delay is onset -> now, and the onset survives the
            # agents' rolling windows for the cost gate below
            incident = self.store.add_incident(
                str(a.job_id),
                nodes=[c.node for c in a.culprits] or list(a.nodes),
                tier=_TIER_NAME[Tier.NONE],
                onset_at=min(a.onset or now, now),
                detected_at=now,
                slowdown=a.slowdown,
                evidence={
                    **a.evidence,
                    "restarts_at_detection": job.restarts,
                    "culprits": [
                        {"node": c.node, "ranks": list(c.ranks), "why": c.why, "telemetry": list(c.telemetry)}
                        for c in a.culprits
                    ],
                    **({} if a.culprits else {"note": "slowdown not localised to a node; no action"}),
                },
            )
            if self.metrics is not None:
                self.metrics.detection_delay.observe(incident.detection_delay_s or 0.0)
        problems = list(job_options(job.comment).problems)
        if problems and incident.evidence.get("opt_in_problems") != problems:
            # the job's own comment: ignored where bad, and said so in its incident
            incident = self.store.update_incident(incident.id, evidence={"opt_in_problems": problems})
        if not a.culprits:
            a = self._still_named(a, incident, nodes)
            if not a.culprits:
                return
        onset = incident.onset_at.timestamp()
        if a.onset is None or onset < a.onset:
            a = replace(a, onset=onset)
        want = job_options(job.comment).mitigate
        decision = gate(
            a,
            tier,
            self.policy.response.escalation,
            now,
            in_job=InJob(want.pp) if want is not None else None,
            taken=incident.evidence.get("mitigations", []),
        )
        gated = decision.tier
        if gated < Tier.DRAIN:
            # cheaper than a drain, for jobs that opted in: rebalance micro-batches
            self._mitigate(a, job, incident, decision, res, ranks or [], now)
            return  # the slowdown has not yet cost the price of the next action
        was = _tier_of(incident.tier)
        if gated > was:
            incident = self.store.update_incident(
                incident.id, tier=_TIER_NAME[gated], nodes=[c.node for c in a.culprits]
            )
        evidence = {
            "incident": incident.id,
            "job": a.job_id,
            "slowdown": round(a.slowdown, 4),
            "tier": _TIER_NAME[gated],
        }
        drained_any = False
        for c in a.culprits:
            node = nodes.get(c.node)
            if node is None:
                continue
            if node.drained_by_us:
                drained_any = True
                continue
            if node.drained_by_others:
                res.suppressed.append(f"{c.node}: drained by someone else; left alone")
                continue
            verdict = self.safety.may_drain(c.node, partitions, now)
            if not verdict.allowed:
                self._alert(verdict.why, c.node, incident.id, res)
                self.store.update_incident(incident.id, status=IncidentStatus.SUPPRESSED, outcome=verdict.why)
                return
            try:
                self.executor.drain(
                    c.node,
                    reason_text(a, c),
                    evidence={**evidence, "why": c.why, "telemetry": list(c.telemetry)},
                    effects=[
                        lifecycle_effect(
                            c.node, NodeState.DRAINING, f"drained: {reason_text(a, c)}", evidence
                        )
                    ],
                )
            except NotOurs as exc:
                res.suppressed.append(str(exc))
                continue
            except SlurmError as exc:
                res.errors.append(str(exc))
                continue
            drained_any = True
            res.actions.append(("drain", c.node))
        if not drained_any:
            return
        if gated == Tier.DRAIN:
            self._checkpoint(a, job, incident, evidence, res)
        elif gated == Tier.REQUEUE:
            asked = job_options(job.comment, self.policy.response.tiers.checkpoint_signal).signal is not None
            if was == Tier.DRAIN and asked and self._checkpoint(a, job, incident, evidence, res):
                # the drain tier's checkpoint signal, never sent (its controller stopped
                # between the drain and the signal): sent now, and the requeue waits a
                # cycle for the job to checkpoint, as it would have after the drain
                return
            self._requeue(a, job, incident, evidence, res, now)

    def _still_named(
        self, a: JobAssessment, incident: IncidentRecord, nodes: dict[str, NodeInfo]
    ) -> JobAssessment:
        """The incident's nodes that this controller drained and the job still runs
        on, as the assessment's culprits when this cycle named none: a severe
        slowdown drained first (its cost had not yet paid a requeue) keeps its
        node once named, while the localisation of a throttled rank's noisy
        compute may miss a cycle; the job is requeued off that node when the
        cost is paid, as it would have been had every cycle named it."""
        if _tier_of(incident.tier) < Tier.DRAIN:
            return a
        kept = [
            Culprit(node=n, why=f"named by incident {incident.id} and drained")
            for n in incident.nodes
            if n in a.nodes and (info := nodes.get(n)) is not None and info.drained_by_us
        ]
        return replace(a, culprits=tuple(kept)) if kept else a

    def _mitigate(
        self,
        a: JobAssessment,
        job: JobInfo,
        incident: IncidentRecord,
        decision: Decision,
        res: CycleResult,
        ranks: list,
        now: float,
    ) -> None:
        """Carry out the in-job action the rule made due (each taken once per incident)."""
        want = job_options(job.comment).mitigate
        if want is None or decision.in_job is None:
            return
        action = decision.in_job
        taken = set(incident.evidence.get("mitigations", [])) | {x.value for x in decision.skipped}
        if action is Action.REBALANCE:
            # planned from the slowed iterations only (those since the onset), never
            # from a window that reaches back into the healthy ones before it
            t = timings_since(ranks, a.onset)
            if t is None or t.iterations < PLAN_MIN_ITERS:
                return  # too few slowed iterations yet: due again next cycle
            compute = t.compute_s
            plan = self.plans.rebalance(
                a.job_id, compute, want.microbatches, want.pp, before_s=t.step_s, now=now
            )
        else:
            compute = {int(k.split("/")[1]): v for k, v in a.evidence.get("rank_compute_s", {}).items()}
            slow = sorted({r for c in a.culprits for r in c.ranks})
            plan = self.plans.retopology(a.job_id, slow, a.gpus, want.pp)
        taken.add(action.value)
        if plan is None:
            self.store.update_incident(incident.id, evidence={"mitigations": sorted(taken)})
            return
        what = (
            f"micro-batches {list(plan.microbatches or ())}"
            if action is Action.REBALANCE
            else f"swaps {[list(s) for s in plan.swaps]}"
        )
        self._record_plan(
            action.value,
            a.job_id,
            plan,
            f"{what} (plan v{plan.version})",
            compute,
            incident,
            res,
            paid_gpu_s=round(decision.paid_gpu_s, 3),
        )
        self.store.update_incident(
            incident.id, evidence={"mitigations": sorted(taken)}, outcome=f"{action.value}: {what}"
        )

    def _review_plan(
        self,
        a: JobAssessment,
        job: JobInfo,
        ranks: list,
        incident: IncidentRecord | None,
        now: float,
        res: CycleResult,
    ) -> None:
        """Judge the job's micro-batch split in force on its iterations under it
        (PlanBook.review): withdrawn when the job is not faster under it,
        re-planned from the compute under it otherwise, whatever the job's tier
        now (a split that helped can outlive the slowdown it was for)."""
        from slurmguard.mitigate.plan import JobPlan

        if self.plans.get(a.job_id) is None:
            if incident is None or not incident.evidence.get("plan"):
                return  # no plan served (most jobs): nothing to judge
            # a restarted controller serves the plan its predecessor served
            self.plans.put(JobPlan.model_validate(incident.evidence["plan"]))
        want = job_options(job.comment).mitigate
        since = self.plans.judged_from(a.job_id)
        if want is None or since is None:
            if want is not None:
                self.plans.review(a.job_id, None, want.microbatches, want.pp, now)  # a restored plan
            return
        t = timings_since(ranks, since)
        plan, why = self.plans.review(a.job_id, t, want.microbatches, want.pp, now)
        if plan is None:
            return
        self._record_plan(
            "rebalance",
            a.job_id,
            plan,
            f"{why} (plan v{plan.version})",
            t.compute_s if t else {},
            incident,
            res,
        )

    def _record_plan(
        self,
        action: str,
        job_id: int,
        plan: Any,
        reason: str,
        compute: dict[int, float],
        incident: IncidentRecord | None,
        res: CycleResult,
        **evidence: Any,
    ) -> None:
        """Audit a served plan and keep it in the incident, so a restarted controller serves the same."""
        self.store.audit(
            action,
            actor=self.actor,
            job_id=str(job_id),
            reason=reason,
            evidence={
                **({"incident": incident.id} if incident is not None else {}),
                "plan": plan.model_dump(mode="json"),
                "rank_compute_s": {r: round(c, 6) for r, c in compute.items()},
                **evidence,
            },
        )
        if incident is not None:
            self.store.update_incident(incident.id, evidence={"plan": plan.model_dump(mode="json")})
        res.actions.append((action, str(job_id)))

    def _checkpoint(
        self, a: JobAssessment, job: JobInfo, incident: IncidentRecord, evidence: dict, res: CycleResult
    ) -> bool:
        """The drain tier's checkpoint signal, once per incident, to a job that asked
        for one; True when it was sent now."""
        done = [
            e
            for e in self.store.audit_entries(action="signal", outcome=AuditOutcome.OK)
            if e.job_id == str(a.job_id) and e.evidence.get("incident") == incident.id
        ]
        if done or self.policy.safety.dry_run and incident.status != IncidentStatus.OPEN:
            return False
        sig = job_options(job.comment, self.policy.response.tiers.checkpoint_signal).signal
        if sig is None:
            if incident.status == IncidentStatus.OPEN:
                self.store.update_incident(
                    incident.id,
                    status=IncidentStatus.MITIGATED,
                    action_at=self.clock.now(),
                    outcome="drained; job left running (it did not ask for a checkpoint signal: "
                    "--comment=slurmguard:signal)",
                )
            return False
        verdict = self.safety.may_act_on_job(self.clock.now())
        if not verdict.allowed:
            self._alert(verdict.why, None, incident.id, res)
            return False
        try:
            self.executor.signal(
                a.job_id,
                sig,
                "checkpoint: node drained under the job",
                evidence=evidence,
                effects=[
                    incident_effect(
                        incident.id,
                        status=IncidentStatus.MITIGATED,
                        outcome=f"drained; job asked to checkpoint (SIG{sig.removeprefix('SIG')})",
                    )
                ],
            )
        except SlurmError as exc:
            res.errors.append(str(exc))
            return False
        res.actions.append(("signal", str(a.job_id)))
        return True

    def _requeue(
        self,
        a: JobAssessment,
        job: JobInfo,
        incident: IncidentRecord,
        evidence: dict,
        res: CycleResult,
        now: float,
    ) -> None:
        if job.restarts > _restarts_at_detection(incident, job):
            # already requeued, by someone else (one of ours would have been recorded
            # by reconcile, late or not): this run's slowdown is over, said so once
            if incident.evidence.get("requeued_at") is None:
                self.store.update_incident(
                    incident.id,
                    status=IncidentStatus.MITIGATED,
                    outcome="the job had been requeued (not recorded by this controller)",
                    evidence={"requeued_at": self.clock.now()},
                )
            return
        verdict = self.safety.may_act_on_job(now)
        if not verdict.allowed:
            self._alert(verdict.why, None, incident.id, res)
            return
        try:
            self.executor.requeue(
                a.job_id,
                "restart on healthy nodes",
                evidence=evidence,
                effects=[
                    incident_effect(
                        incident.id,
                        status=IncidentStatus.MITIGATED,
                        outcome="drained and requeued on healthy nodes",
                        stamp=["requeued_at"],
                    )
                ],
                restarts=job.restarts,
            )
        except SlurmError as exc:
            res.errors.append(str(exc))
            return
        res.actions.append(("requeue", str(a.job_id)))

    def _lift_requeue_holds(
        self, live: dict[int, IncidentRecord], jobs: dict[int, JobInfo], res: CycleResult
    ) -> None:
        """A requeue whose controller stopped inside it (the command waits for Slurm's
        post-requeue hold, a begin time minutes ahead set once the old run has ended,
        and lifts it) was recorded late by reconcile; its hold is lifted here on the
        cycles of the next REQUEUE_SETTLE_S while the job waits, so it restarts at
        once as meant. For every job, running or not (a requeued job waits in the queue)."""
        now = self.clock.now()
        for job_id, incident in live.items():
            ev = incident.evidence
            job = jobs.get(job_id)
            at = ev.get("requeued_at")
            if not ev.get(LATE) or at is None or job is None or job.state != "PENDING":
                continue
            if now - float(at) > REQUEUE_SETTLE_S:
                continue
            try:
                if self.executor.fence is not None:
                    self.executor.fence()  # only the active controller lifts
                self.slurm.release_requeue_hold(job_id)
            except SlurmError as exc:  # NotLeader included: the next cycle's controller will
                res.errors.append(f"job {job_id}: requeue hold: {exc}")

    def _verify_flags(
        self,
        nodes: dict[str, NodeInfo],
        jobs: dict[int, JobInfo],
        slow_nodes: set[str],
        res: CycleResult,
        now: float,
    ) -> None:
        """Telemetry deviates but no job is measurably slower: pending verification."""
        for node, flags in self._flags.items():
            n = nodes.get(node)
            if n is None or node in slow_nodes or n.drained or n.down:
                continue
            text = "pending verification: " + "; ".join(f.text() for f in flags[:2])
            if n.comment and n.comment.startswith("slurmguard: pending verification"):
                continue
            if n.comment:
                res.suppressed.append(f"{node}: has an admin comment; not marking it")
                continue
            if not self.safety.may_act(now).allowed:
                continue
            ev = {"flags": [f.text() for f in flags]}
            try:
                self.executor.comment(
                    node, text, evidence=ev, effects=[lifecycle_effect(node, NodeState.SUSPECT, text, ev)]
                )
            except SlurmError as exc:
                res.errors.append(str(exc))
                continue
            res.actions.append(("comment", node))

    def _alert(self, why: str, node: str | None, incident_id: int, res: CycleResult) -> None:
        self.breaker_open = self.breaker_open or why.startswith("circuit breaker")
        res.suppressed.append(why)
        log.error("ALERT: %s (node %s, incident %s): not acting", why, node, incident_id)
        recent = self.store.audit_entries(action="alert", since=self.clock.now() - 600)
        if not any(e.reason == why and e.node == node for e in recent):
            self.store.audit(
                "alert",
                actor=self.actor,
                node=node,
                reason=why,
                outcome=AuditOutcome.OK,
                evidence={"incident": incident_id},
            )

    def _observe(self, res: CycleResult) -> None:
        if self.metrics is not None:
            self.metrics.observe_cycle(self, res)


def _tier_of(name: str) -> Tier:
    return {v: k for k, v in _TIER_NAME.items()}.get(str(name), Tier.NONE)


def _restarts_at_detection(incident: IncidentRecord, job: JobInfo) -> int:
    """The job's restart count when the incident was detected (its current one
    for an incident recorded without it)."""
    return int(incident.evidence.get("restarts_at_detection", job.restarts))


def _restart_cut(incident: IncidentRecord | None) -> float | None:
    """After a requeue, only iterations of the new run count."""
    if incident is None:
        return None
    at = incident.evidence.get("requeued_at")
    return float(at) if at else None
