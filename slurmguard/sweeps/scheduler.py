"""The sweep scheduler: quarantine, sweep and gate the nodes slurmguard drained (Guard 5-6).

A state machine over the database (node lifecycle, sweeps, triage actions) and the Slurm
view, advanced by `tick()`: one pass that moves every node in draining / quarantined /
remediation by at most one step and never waits for a job. The controller calls it
every cycle; `slurmguard sweep scheduler` runs it standalone.

Per node (lifecycle state -> what a tick does):

* draining: wait until the node (drained by slurmguard, never by anyone else) is idle;
  create the MAINT reservation ``slurmguard_quarantine_<node>``; -> quarantined.
* quarantined: resume the node *inside* its reservation and submit the 1-node sweep;
  when it passed, reserve a free healthy reference of the same hardware class together
  with the node (``slurmguard_sweep2_<node>``, only while the reference is idle) and
  submit the 2-node sweep. A sweep job that ended (or vanished) is judged with
  `verdict.judge_job` against the class baseline rebuilt from the database; crash,
  timeout, cancel, no result or malformed JSON fail. Both pass -> reservations deleted,
  no slurmguard drain left, comment cleared, -> healthy. Fail -> drained again with the
  failing evidence as reason, -> remediation (triage ladder, `slurmguard.sweeps.ladder`).
  An inconclusive pair result (untrusted reference) is repeated with another reference;
  a suspected node without a class baseline is held (drained with that reason) until
  the baseline exists.
* remediation: the ladder's current rung (re-sweep, reboot, reimage, terminal).
* rolling sweeps (optional, `sweeps.rolling_enabled`): at most `rolling_nodes_per_hour`
  idle healthy nodes are taken into quarantine and swept as unsuspected nodes; they seed
  and refresh the class baselines and keep references trusted.

Restart safety: every "already done?" is read back from Slurm (reservation present, job
id recorded and its state, node drained by us, reboot flags, boot time) or from the
database (sweep rows are written before their job is submitted; a row without a job id
is matched to the queue by its job name), so a scheduler killed between any two steps
continues without a second reservation, sweep job, reboot or drain.

Dry run (`safety.dry_run`): the tick decides and reports every step, changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from slurmguard.clock import Clock
from slurmguard.config import Policy, SweepPolicy, TriagePolicy
from slurmguard.errors import SlurmguardError
from slurmguard.respond.actions import ActionExecutor, sweep_effect
from slurmguard.runner import CommandRunner
from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.errors import NotOurs, SlurmError, UnknownJob
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo, is_ours
from slurmguard.store import (
    NodeRecord,
    NodeState,
    Store,
    StoreError,
    SweepKind,
    SweepRecord,
)
from slurmguard.store import Verdict as StoreVerdict
from slurmguard.sweeps import records as rec
from slurmguard.sweeps.baseline import ClassBaseline, baseline_for, peers_for
from slurmguard.sweeps.episode import LAST_SWEEP, PEER, ROLLING, NodeEpisode, load_episode
from slurmguard.sweeps.ladder import FAILED_SWEEP, OPEN, LadderStep, TriageLadder
from slurmguard.sweeps.local import free_port
from slurmguard.sweeps.quarantine import (
    PAIR_PREFIX,
    QUARANTINE_PREFIX,
    is_free,
    is_idle_in_service,
    node_of,
    pair_name,
    quarantine_name,
    reserved_nodes,
)
from slurmguard.sweeps.reference import choose_reference, hw_class
from slurmguard.sweeps.result import ResultError, SweepResult, parse_result_text
from slurmguard.sweeps.resultfiles import LocalResultFiles, ResultFiles
from slurmguard.sweeps.templates import SweepJobSpec, render_sweep_script
from slurmguard.sweeps.verdict import (
    JobOutcome,
    Outcome,
    floor_for,
    judge_job,
    judge_result,
    make_reason,
    reference_status,
)

log = logging.getLogger(__name__)

ACTIVE = (NodeState.DRAINING, NodeState.QUARANTINED, NodeState.REMEDIATION)
KILLED_STATES = frozenset({"CANCELLED", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"})
"""Ended from outside (admin, preemption, Slurm): retried, not held against the node."""
NOT_STARTED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
VANISHED = "VANISHED"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Step:
    """One decision for one node: what the tick does (or would do, in dry-run) and why."""

    node: str
    action: str
    why: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TickResult:
    at: float
    steps: list[Step] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    """What was changed, one line each ('node2: submitted sweep1 12 as job 345')."""
    errors: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.done)


@dataclass
class _View:
    """One consistent read of Slurm per tick."""

    nodes: dict[str, NodeInfo]
    reservations: dict[str, ReservationInfo]
    jobs: dict[int, JobInfo]
    now: float

    @property
    def reserved(self) -> set[str]:
        return reserved_nodes(self.reservations.values(), self.now)


def workload_args(policy: SweepPolicy) -> tuple[str, ...]:
    """Workload options that pin every setting to this policy (the node-side policy file,
    if any, cannot change what the controller judges)."""
    return (
        "--device",
        policy.device,
        "--duration",
        f"{policy.gemm_duration_s:g}",
        "--gemm-size",
        str(policy.gemm_size),
        "--dtypes",
        ",".join(policy.gemm_dtypes),
        "--membw-bytes",
        str(policy.membw_bytes),
        "--message-sizes-mb",
        ",".join(str(m) for m in policy.message_sizes_mb),
        "--repeats",
        str(policy.repeats),
        "--comm-timeout",
        f"{policy.comm_timeout_s:g}",
        "--comm-iters",
        str(policy.comm_iters),
        "--comm-warmup",
        str(policy.comm_warmup),
        *policy.workload_args,
    )


def job_name(sweep_id: int, node: str) -> str:
    return f"slurmguard_sweep{sweep_id}_{node}"


class SweepScheduler:
    """See the module docstring. Construct with `build_scheduler` from a Policy."""

    def __init__(
        self,
        sweeps: SweepPolicy,
        triage: TriagePolicy,
        store: Store,
        slurm: SlurmClient,
        clock: Clock,
        executor: ActionExecutor,
        *,
        files: ResultFiles | None = None,
        runner: CommandRunner | None = None,
        actor: str = "slurmguard",
    ) -> None:
        self.policy = sweeps
        self.triage = triage
        self.store = store
        self.slurm = slurm
        self.clock = clock
        self.executor = executor
        self.files = files or LocalResultFiles(sweeps.result_dir)
        self.actor = actor
        self.ladder = TriageLadder(
            triage,
            store,
            executor,
            clock,
            runner=runner,
            actor=actor,
            delete_quarantine=self._delete_quarantine,
        )
        self._view_cache: _View | None = None
        self._results = rec.ResultCache()

    @property
    def dry_run(self) -> bool:
        return bool(self.executor.dry_run)

    # ================================================================== the tick
    def tick(self, view: tuple[list[NodeInfo], list[JobInfo]] | None = None) -> TickResult:
        """view: (nodes, jobs) the controller's cycle just read from Slurm (one read per
        cycle at scale); None = read them here."""
        now = self.clock.now()
        res = TickResult(at=now)
        slurm_view = self._read_view(now, view)
        self._view_cache = slurm_view
        try:  # run on its own (`slurmguard sweeps`): a stopped run's unfinished actions first
            self.executor.reconcile(slurm_view.nodes, slurm_view.jobs)
        except SlurmError as exc:
            res.errors.append(f"unfinished actions: {exc}")
            return res
        records = self._sync_nodes(slurm_view)
        self._returned_outside(slurm_view, records, res)
        self._cleanup(slurm_view, records, res)
        taken: set[str] = set()
        rolling_active = 0
        for name, r in records.items():
            if r.state not in ACTIVE:
                continue
            try:
                ep = load_episode(self.store, name)
                rolling_active += int(ep.rolling)
                step = self._decide(r, ep, slurm_view, records, taken)
                res.steps.append(step)
                if step.action in ("wait", "blocked") or self.dry_run:
                    if self.dry_run and step.action not in ("wait", "blocked"):
                        log.warning("dry-run: would %s %s: %s", step.action, name, step.why)
                    continue
                done = self._apply(step, r, ep, slurm_view, records)
                if done:
                    res.done.append(f"{name}: {done}")
                    log.info("%s: %s", name, done)
            except (SlurmguardError, ValueError, OSError) as exc:
                # one node's trouble (a refused command, a bad result dir) must not stop the others
                res.errors.append(f"{name}: {exc}")
                log.error("sweep scheduler: %s: %s", name, exc)
        try:
            self._peer_sweeps(slurm_view, records, taken, res)
        except (SlurmError, StoreError) as exc:
            res.errors.append(f"peer sweeps: {exc}")
        if rolling_active == 0:
            try:
                self._rolling(slurm_view, records, taken, res)
            except (SlurmError, StoreError) as exc:
                res.errors.append(f"rolling: {exc}")
        return res

    def _read_view(self, now: float, given: tuple[list[NodeInfo], list[JobInfo]] | None = None) -> _View:
        node_list, job_list = given if given is not None else self.slurm.fleet()
        nodes = {n.name: n for n in node_list}
        resv = {r.name: r for r in self.slurm.reservations()}
        jobs = {j.job_id: j for j in job_list}
        return _View(nodes, resv, jobs, now)

    def _sync_nodes(self, view: _View) -> dict[str, NodeRecord]:
        """Register nodes Slurm knows and the DB does not; keep feature-given classes current."""
        records = {r.name: r for r in self.store.list_nodes()}
        for name, n in view.nodes.items():
            r = records.get(name)
            klass = hw_class(n, None, self.policy)
            feature_class = klass if klass != "default" else None
            if r is None or (feature_class and r.hw_class != feature_class):
                records[name] = self.store.get_or_create_node(
                    name, hw_class=feature_class, partitions=list(n.partitions)
                )
        return records

    def _returned_outside(self, view: _View, records: dict[str, NodeRecord], res: TickResult) -> None:
        """A terminal node that Slurm shows in service again (neither drained nor
        down) was brought back by an admin with Slurm's own tools (`scontrol update
        state=resume`) rather than `slurmguard node resume`: its lifecycle follows,
        recorded as an admin override. Left terminal, the next drain of it could not
        be recorded, so nothing would sweep or return it: drained for good."""
        for name, r in list(records.items()):
            live = view.nodes.get(name)
            if r.state is not NodeState.TERMINAL or live is None or live.drained or live.down:
                continue
            why = f"returned to service outside slurmguard (Slurm: {live.state_text}, not drained)"
            if self.dry_run:
                res.steps.append(Step(name, "returned", why))
                continue
            self.store.transition(
                name, NodeState.HEALTHY, why, {"slurm_state": live.state_text}, actor=self.actor, force=True
            )
            records[name] = self.store.get_or_create_node(name)
            res.done.append(f"{name}: {why}")
            log.info("%s: %s", name, why)

    # ================================================================== decisions
    def _decide(
        self, r: NodeRecord, ep: NodeEpisode, view: _View, records: dict[str, NodeRecord], taken: set[str]
    ) -> Step:
        name = r.name
        live = view.nodes.get(name)
        if live is None:
            return Step(name, "blocked", "unknown to Slurm")
        if r.state is NodeState.DRAINING:
            return self._decide_draining(live)
        if r.state is NodeState.REMEDIATION:
            # the ladder itself decides what a rung can do on a node taken out by others
            # (a reboot in flight may see Slurm's own reasons)
            return self._decide_remediation(ep, live, view)
        return self._decide_quarantined(r, ep, live, view, records, taken)

    def _decide_draining(self, live: NodeInfo) -> Step:
        name = live.name
        if live.drained_by_others:
            return Step(name, "blocked", f"drained by someone else ({live.reason!r}): not ours")
        if not live.drained_by_us:
            return Step(name, "wait", "not (yet) drained by slurmguard in Slurm")
        if live.jobs or live.state not in ("IDLE", "DOWN"):
            jobs = ",".join(map(str, live.jobs)) or live.state_text
            return Step(name, "wait", f"waiting for running work to end ({jobs})")
        return Step(name, "quarantine", "idle: reserve and quarantine")

    def _decide_quarantined(
        self,
        r: NodeRecord,
        ep: NodeEpisode,
        live: NodeInfo,
        view: _View,
        records: dict[str, NodeRecord],
        taken: set[str],
    ) -> Step:
        name = r.name
        pending = ep.pending()
        if pending is not None:
            # judging only reads Slurm and writes the database: also for a node Slurm took
            # out meanwhile (NODE_FAIL, "Not responding")
            return self._decide_pending(pending, view)
        if live.drained_by_others:
            return Step(name, "blocked", f"taken out by someone else ({live.reason!r}): not ours")
        la = ep.last_action
        if la is not None and la.status in OPEN and la.evidence.get(FAILED_SWEEP) is not None:
            # the rung was planned for a failed sweep, the move to remediation not recorded
            return Step(
                name,
                "fail",
                str(la.evidence.get("reason") or "sweep failed"),
                {"sweep": la.evidence[FAILED_SWEEP]},
            )
        rs = ep.round_sweeps
        last = rs[-1] if rs else None
        out = rec.outcome_of(last) if last is not None else None
        if last is not None and rec.passed(last) and last.kind is SweepKind.TWO_NODE:
            return Step(name, "return", "1-node and 2-node sweeps passed", {"sweep": last.id})
        if last is not None and out == Outcome.FAIL.value:
            return Step(
                name, "fail", str(last.metrics.get("reason") or last.failure_reason), {"sweep": last.id}
            )
        in_resv = quarantine_name(name) in view.reservations
        if not in_resv:
            if ep.rolling and not ep.sweeps and not is_free(live):
                return Step(name, "abandon_rolling", f"node no longer free ({live.state_text})")
            return Step(name, "requarantine", "quarantine reservation missing")
        if live.jobs:
            return Step(name, "wait", f"job(s) {','.join(map(str, live.jobs))} still on the node")
        klass = hw_class(live, r, self.policy)
        if last is None or (last.kind is SweepKind.ONE_NODE and out in rec.NO_EVIDENCE):
            if last is not None and self._too_soon(last):
                return Step(name, "wait", "retrying the 1-node sweep shortly")
            return Step(name, "submit_node", "1-node sweep", {"hw_class": klass})
        if last.kind is SweepKind.ONE_NODE and out == Outcome.INCONCLUSIVE.value:
            # a tool stage could not run properly: sweep again, then hold with its reason
            tries = sum(
                1
                for x in ep.round_kind(SweepKind.ONE_NODE)
                if rec.outcome_of(x) == Outcome.INCONCLUSIVE.value
            )
            if tries > self.policy.killed_retries:
                return Step(
                    name,
                    "hold",
                    f"{tries} inconclusive 1-node sweeps",
                    {"reason": last.metrics.get("reason") or last.failure_reason},
                )
            if self._too_soon(last):
                return Step(name, "wait", "repeating the inconclusive 1-node sweep shortly")
            return Step(name, "submit_node", "1-node sweep again (inconclusive)", {"hw_class": klass})
        if out == Outcome.INSUFFICIENT_BASELINE.value:
            res = rec.result_of(last, self._results)
            if res is not None:
                cls_b, peers = self._references(res, last.kind, records, exclude=(name,))
                if (
                    cls_b.node_count >= self.policy.bootstrap_min_nodes
                    or peers.node_count >= self.policy.peer_min_nodes
                ):
                    return Step(
                        name, "rejudge", f"sweep {last.id}: a reference exists now", {"sweep": last.id}
                    )
                if floor_for(res.device_name, self.policy) is not None and not self._peers_possible(
                    klass, view, records
                ):
                    return Step(
                        name,
                        "rejudge",
                        f"sweep {last.id}: no peer can be swept, the policy floor judges",
                        {"sweep": last.id},
                    )
                if view.now - res.finished > self.policy.peer_window_min * 60:
                    # its result is too old for any peer swept from now on: measure again
                    if last.kind is SweepKind.ONE_NODE:
                        return Step(
                            name,
                            "submit_node",
                            "1-node sweep again (peers' window passed)",
                            {"hw_class": klass},
                        )
                    return self._pair_step(name, klass, ep, view, records, taken)
            return Step(
                name,
                "hold",
                f"no reference for class {klass} yet"
                + (" (sweeping idle peers)" if self.policy.peer_sweeps else ""),
                {"reason": last.metrics.get("reason") or last.failure_reason},
            )
        if last.kind is SweepKind.TWO_NODE and out in rec.NO_EVIDENCE and self._too_soon(last):
            return Step(name, "wait", "retrying the 2-node sweep shortly")
        # next: the 2-node sweep (after a 1-node pass, an inconclusive or unrun pair sweep)
        return self._pair_step(name, klass, ep, view, records, taken)

    def _pair_step(
        self,
        name: str,
        klass: str,
        ep: NodeEpisode,
        view: _View,
        records: dict[str, NodeRecord],
        taken: set[str],
    ) -> Step:
        exclude = {
            s.reference_node
            for s in ep.round_kind(SweepKind.TWO_NODE)
            if s.reference_node and rec.outcome_of(s) in (Outcome.INCONCLUSIVE.value, rec.NOT_RUN)
        }
        hist = rec.past_sweeps(self.store.sweeps(limit=2000), self._results)
        choice = choose_reference(
            name,
            klass,
            live=view.nodes,
            records=records,
            reserved=view.reserved,
            taken=taken,
            exclude=exclude,
            history=hist,
            policy=self.policy,
        )
        if choice is None:
            return Step(
                name,
                "wait",
                f"no free healthy reference of class {klass}"
                + (f" (excluded: {', '.join(sorted(exclude))})" if exclude else ""),
            )
        taken.add(choice.node)
        return Step(
            name,
            "submit_pair",
            f"2-node sweep with {choice.node} ({choice.status.why})",
            {"hw_class": klass, "reference": choice.node},
        )

    def _decide_pending(self, s: SweepRecord, view: _View) -> Step:
        name = s.node
        if s.slurm_job_id is None:
            want = job_name(s.id, name)
            found = [j for j in view.jobs.values() if j.name == want]
            if found:
                return Step(
                    name,
                    "adopt",
                    f"sweep {s.id} found in the queue as job {found[0].job_id}",
                    {"sweep": s.id, "job": found[0].job_id},
                )
            return Step(
                name,
                "not_run",
                f"sweep {s.id} was recorded but never submitted",
                {"sweep": s.id, "reason": f"{self._label(s)} not submitted"},
            )
        jid = int(s.slurm_job_id)
        job = view.jobs.get(jid)
        if job is None:
            try:
                job = self.slurm.job(jid)
            except UnknownJob:
                job = None
        if job is None:
            return Step(name, "judge", f"job {jid} left the queue", {"sweep": s.id, "state": VANISHED})
        state = job.base_state or "UNKNOWN"
        if job.ended:
            return Step(
                name,
                "judge",
                f"job {jid} ended {state}",
                {"sweep": s.id, "state": state, "start": job.start_time},
            )
        if state in NOT_STARTED:
            since = (s.submitted_at or s.created_at).timestamp()
            if view.now - since > self.policy.start_timeout_min * 60:
                return Step(
                    name,
                    "cancel_unstarted",
                    f"job {jid} still {state} after {self.policy.start_timeout_min} min",
                    {"sweep": s.id, "job": jid},
                )
            return Step(name, "wait", f"sweep {s.id} job {jid} {state}")
        if state == "RUNNING" and s.started_at is None:
            return Step(
                name,
                "mark_started",
                f"job {jid} running",
                {"sweep": s.id, "start": job.start_time or view.now},
            )
        return Step(name, "wait", f"sweep {s.id} job {jid} {state}")

    def _decide_remediation(self, ep: NodeEpisode, live: NodeInfo, view: _View) -> Step:
        name = live.name
        ls = self.ladder.decide(name, live, ep)
        if ls.action == "blocked":
            return Step(name, "blocked", ls.why)
        terminal = ls.rung is not None and ls.rung.value == "terminal"
        if not terminal and ls.action in ("start", "poll"):
            if quarantine_name(name) not in view.reservations:
                return Step(name, "requarantine", "quarantine reservation missing")
            if live.jobs:
                return Step(name, "wait", f"job(s) {','.join(map(str, live.jobs))} still on the node")
        return Step(name, "ladder", ls.why, {"ladder": ls})

    def _too_soon(self, last: SweepRecord) -> bool:
        """Back off 30 s after a sweep that could not be submitted (Slurm refusing sbatch)."""
        t = last.finished_at or last.created_at
        return self.clock.now() - t.timestamp() < 30.0

    # ================================================================== actions
    def _apply(
        self, step: Step, r: NodeRecord, ep: NodeEpisode, view: _View, records: dict[str, NodeRecord]
    ) -> str | None:
        live = view.nodes[step.node]
        a = step.action
        if a == "quarantine":
            self._ensure_quarantine(live, view)
            self.store.transition(
                step.node,
                NodeState.QUARANTINED,
                f"quarantined: idle, reservation {quarantine_name(step.node)}",
                {"reservation": quarantine_name(step.node)},
                actor=self.actor,
            )
            return "quarantined"
        if a == "requarantine":
            return self._ensure_quarantine(live, view, redrain=not ep.rolling or bool(ep.sweeps))
        if a == "abandon_rolling":
            self._delete_reservation(quarantine_name(step.node), step.node, view)
            self.store.transition(
                step.node,
                NodeState.HEALTHY,
                f"rolling sweep skipped: {step.why}",
                {LAST_SWEEP: ep.last_sweep_id},
                actor=self.actor,
            )
            return "rolling sweep skipped (node busy)"
        if a == "submit_node":
            return self._submit(live, ep, "node", str(step.data["hw_class"]), None, view)
        if a == "submit_pair":
            return self._submit(
                live, ep, "pair", str(step.data["hw_class"]), str(step.data["reference"]), view
            )
        if a == "adopt":
            self.store.update_sweep(
                int(step.data["sweep"]), slurm_job_id=str(step.data["job"]), submitted_at=self.clock.now()
            )
            return f"sweep {step.data['sweep']} is job {step.data['job']}"
        if a == "not_run":
            return self._mark_not_run(int(step.data["sweep"]), step.why, view)
        if a == "mark_started":
            self.store.update_sweep(int(step.data["sweep"]), started_at=float(step.data["start"]))
            return None
        if a == "cancel_unstarted":
            sid, jid = int(step.data["sweep"]), int(step.data["job"])
            try:
                self._cancel(jid, step.node, f"sweep {sid} did not start in time")
            except UnknownJob:
                pass
            return self._mark_not_run(sid, step.why, view)
        if a == "judge":
            return self._judge(ep, step, view, records)
        if a == "rejudge":
            return self._rejudge(ep, step, records)
        if a == "hold":
            reason = str(step.data.get("reason") or make_reason("waiting for a class baseline"))
            if not (live.drained_by_us and (live.reason or "").startswith(reason)):
                self.executor.drain(step.node, reason, evidence={"why": step.why})
                return f"held: {reason}"
            return None
        if a == "fail":
            return self._fail(live, ep, step)
        if a == "return":
            return self._return(live, ep, view)
        if a == "ladder":
            ls: LadderStep = step.data["ladder"]
            return self.ladder.apply(ls, live, ep)
        raise ValueError(f"unknown step {a!r}")

    # ------------------------------------------------------------------ reservations
    def _ensure_quarantine(self, live: NodeInfo, view: _View, *, redrain: bool = False) -> str | None:
        """The node's quarantine reservation exists; a node resumed for sweeping that lost it
        is drained again first, so no ordinary job can land in the gap."""
        name = quarantine_name(live.name)
        if name in view.reservations:
            return None
        done = []
        if redrain and not live.drained:
            self.executor.drain(live.name, make_reason("quarantine reservation lost; re-quarantining"))
            done.append("drained")
        self.executor.create_reservation(
            name, [live.name], self.policy.quarantine_reservation_min, evidence={"why": "quarantine"}
        )
        view.reservations[name] = ReservationInfo(name, (live.name,), frozenset({"MAINT"}))
        done.append(f"reservation {name} created")
        return ", ".join(done)

    def _delete_reservation(self, name: str, node: str, view: _View | None = None) -> bool:
        view = view or self._view_cache
        if view is not None and name not in view.reservations:
            return False
        try:
            self.executor.delete_reservation(name, node=node)
        except SlurmError as exc:
            if "not found" in str(exc).lower() or "invalid reservation" in str(exc).lower():
                return False
            raise
        if view is not None:
            view.reservations.pop(name, None)
        return True

    def _delete_quarantine(self, node: str) -> None:
        self._delete_reservation(pair_name(node), node)
        self._delete_reservation(quarantine_name(node), node)

    def _cleanup(self, view: _View, records: dict[str, NodeRecord], res: TickResult) -> None:
        """Delete slurmguard reservations nothing needs any more (after a crash or a return)."""
        for name in list(view.reservations):
            node = node_of(name)
            if node is None:
                continue
            r = records.get(node)
            stale = False
            if name.startswith(QUARANTINE_PREFIX):
                stale = r is None or r.state in (NodeState.HEALTHY, NodeState.SUSPECT, NodeState.TERMINAL)
            elif name.startswith(PAIR_PREFIX):
                pend = self.store.sweeps(node=node, kind=SweepKind.TWO_NODE, verdict=StoreVerdict.PENDING)
                stale = not pend
            if not stale:
                continue
            if self.dry_run:
                res.steps.append(Step(node, "delete_reservation", f"{name} no longer needed"))
                continue
            try:
                if self._delete_reservation(name, node, view):
                    res.done.append(f"{node}: deleted stale reservation {name}")
            except SlurmError as exc:
                res.errors.append(f"{node}: {exc}")

    # ------------------------------------------------------------------ submitting
    def _submit(
        self,
        live: NodeInfo,
        ep: NodeEpisode,
        kind: Literal["node", "pair"],
        klass: str,
        ref: str | None,
        view: _View,
    ) -> str:
        node = live.name
        nodes = (node,) if ref is None else (node, ref)
        resv = quarantine_name(node)
        done = []
        if ref is not None:
            resv = pair_name(node)
            minutes = self.policy.time_limit_min + self.policy.start_timeout_min + 5
            if resv not in view.reservations:
                self.executor.create_reservation(
                    resv, list(nodes), minutes, evidence={"why": "2-node sweep", "reference": ref}
                )
                view.reservations[resv] = ReservationInfo(resv, nodes, frozenset({"MAINT"}))
            # IGNORE_JOBS lets the reservation be made over a job that started after we
            # looked: check again and never sweep against a busy reference
            now_ref = self.slurm.node(ref)
            if not is_idle_in_service(now_ref):
                self._delete_reservation(resv, node, view)
                return f"reference {ref} became busy ({now_ref.state_text}); not used"
        if live.drained_by_us:
            self.executor.resume(node, evidence={"why": f"sweep inside {quarantine_name(node)}"})
            done.append("resumed inside its reservation")
        sk = SweepKind.ONE_NODE if kind == "node" else SweepKind.TWO_NODE
        s = self.store.add_sweep(node, sk, reference_node=ref, hw_class=klass)
        try:
            out, logp = self.files.paths(node, s.id, kind)
            parts = self._partition(nodes, view)
            port = None
            if kind == "pair" and self.policy.master_addr in LOOPBACK:
                # every "node" shares this host (development cluster): a port free here now,
                # not the job-id formula, which collides between clusters on one host
                port = free_port()
            spec = SweepJobSpec(
                kind=kind,
                nodes=nodes,
                out_path=out,
                log_path=logp,
                time_limit_min=self.policy.time_limit_min,
                reservation=resv,
                partition=parts,
                job_name=job_name(s.id, node),
                master_addr=self.policy.master_addr,
                master_port=port,
                hw_class=klass,
                extra_args=workload_args(self.policy),
            )
            script = render_sweep_script(spec, self.policy)
            jid = self.executor.submit(
                script,
                node=node,
                reason=f"{self._label(s)} of {node}",
                evidence={"sweep": s.id, "kind": kind, "reference": ref},
                effects=[sweep_effect(s.id)],  # the job id, with the submit's audit row
                job_name=spec.job_name,
                nodelist=list(nodes),
                reservation=resv,
                time_limit_min=spec.time_limit_min,
                partition=parts,
            )
        except Exception as exc:
            self._mark_not_run(
                s.id, f"submission failed: {exc}", view, reason=f"{self._label(s)} not submitted"
            )
            if ref is not None:
                self._delete_reservation(resv, node, view)
            raise
        done.append(f"submitted {self._label(s)} sweep {s.id} as job {jid}" + (f" with {ref}" if ref else ""))
        return "; ".join(done)

    def _partition(self, nodes: tuple[str, ...], view: _View) -> str | None:
        if self.policy.partition:
            return self.policy.partition
        common: list[str] | None = None
        for n in nodes:
            parts = list(view.nodes[n].partitions) if n in view.nodes else []
            common = parts if common is None else [p for p in common if p in parts]
        return common[0] if common else None

    def _mark_not_run(self, sweep_id: int, detail: str, view: _View, reason: str | None = None) -> str:
        s = self.store.get_sweep(sweep_id)
        why = make_reason(reason or f"{self._label(s)} not run")
        self.store.update_sweep(
            sweep_id,
            verdict=StoreVerdict.ERROR,
            failure_reason=why,
            metrics=rec.not_run_metrics(why, detail, node_count=self._count(s)),
        )
        if s.kind is SweepKind.TWO_NODE:
            self._delete_reservation(pair_name(s.node), s.node, view)
        return f"sweep {sweep_id} not run: {detail}"

    def _cancel(self, job_id: int, node: str, reason: str) -> None:
        self.executor.cancel(job_id, reason, node=node)

    @staticmethod
    def _label(s: SweepRecord) -> str:
        return "sweep1" if s.kind is SweepKind.ONE_NODE else "sweep2"

    @staticmethod
    def _count(s: SweepRecord) -> int:
        return 1 if s.kind is SweepKind.ONE_NODE else 2

    # ------------------------------------------------------------------ judging
    def _judge(self, ep: NodeEpisode, step: Step, view: _View, records: dict[str, NodeRecord]) -> str:
        s = self.store.get_sweep(int(step.data["sweep"]))
        kind = rec.KIND_OF[s.kind]
        state = str(step.data["state"])
        out_path, _ = self.files.paths(s.node, s.id, kind)
        text = self.files.read(out_path)
        parsed = None
        if text is not None:
            try:
                parsed = parse_result_text(text, out_path)
            except ResultError:
                parsed = None
        # the job left the queue before we saw how it ended; only a complete, valid result
        # written by this very job may stand in for COMPLETED
        if state == VANISHED and parsed is not None and parsed.job_id == s.slurm_job_id and not parsed.errors:
            state = "COMPLETED"
        baseline = peers = None
        ref_status = None
        start = step.data.get("start") or (s.started_at.timestamp() if s.started_at else None)
        now = self.clock.now()
        if state in KILLED_STATES and (parsed is None or parsed.job_id != s.slurm_job_id):
            killed = sum(1 for x in ep.round_kind(s.kind) if rec.outcome_of(x) == rec.KILLED)
            if killed < self.policy.killed_retries:
                # cancelled or preempted from outside: no evidence about the node either way
                why = make_reason(f"{self._label(s)} killed by Slurm ({state}), retrying")
                self.store.update_sweep(
                    s.id,
                    verdict=StoreVerdict.ERROR,
                    failure_reason=why,
                    finished_at=now,
                    metrics=rec.not_run_metrics(
                        why,
                        f"job {s.slurm_job_id} ended {state} without a result;"
                        f" retry {killed + 1} of {self.policy.killed_retries}",
                        node_count=self._count(s),
                        outcome=rec.KILLED,
                        job_state=state,
                        runtime_s=max(0.0, now - float(start)) if start else 0.0,
                    ),
                )
                if s.kind is SweepKind.TWO_NODE:
                    self._delete_reservation(pair_name(s.node), s.node, view)
                return f"{self._label(s)} sweep {s.id} ({state}): killed by Slurm, will retry"
        if parsed is not None:
            baseline, peers = self._references(parsed, s.kind, records, exclude=(s.node,))
            if s.reference_node:
                ref_status = reference_status(
                    s.reference_node,
                    rec.past_sweeps(self.store.sweeps(limit=2000), self._results),
                    self.policy,
                )
        v = judge_job(
            JobOutcome(state, None, text, out_path),
            kind=kind,
            node=s.node,
            baseline=baseline,
            policy=self.policy,
            suspected=ep.suspected,
            reference=s.reference_node,
            ref_status=ref_status,
            peers=peers,
            use_floor=not ep.suspected or not self._peers_possible(s.hw_class, view, records),
        )
        if start is None:
            runtime = parsed.finished - parsed.started if parsed is not None else 0.0
        else:
            # Slurm's job record here has no end time: the end is the workload's own finish
            # stamp when it is plausible, else this tick (at most one cycle late)
            end = now
            if parsed is not None and float(start) <= parsed.finished <= now:
                end = parsed.finished
            runtime = max(0.0, end - float(start))
        metrics = rec.outcome_metrics(
            v, job_state=state, runtime_s=runtime, node_count=self._count(s), result_path=out_path
        )
        sv = rec.store_verdict(v)
        self.store.update_sweep(
            s.id,
            verdict=sv,
            metrics=metrics,
            failure_reason=None if sv is StoreVerdict.PASS else v.reason,
            started_at=float(start) if start is not None and s.started_at is None else None,
            finished_at=now,
        )
        if s.kind is SweepKind.TWO_NODE:
            self._delete_reservation(pair_name(s.node), s.node, view)
        return f"{self._label(s)} sweep {s.id} ({state}): {v.outcome.value}: {v.reason} [{v.basis_text}]"

    def _references(
        self,
        result: SweepResult,
        kind: SweepKind,
        records: Mapping[str, NodeRecord],
        exclude: tuple[str, ...],
    ) -> tuple[ClassBaseline, ClassBaseline]:
        """(class baseline, same-window peers) for a result, from the healthy nodes' sweeps
        in the database. Results older than baseline_max_age_h have left the class baseline."""
        healthy_nodes = self._vouching_nodes(records)
        pool = self.store.sweeps(hw_class=result.hw_class, kind=kind, limit=2000)
        healthy = rec.healthy_results(
            (x for x in pool if x.node in healthy_nodes), exclude_nodes=exclude, cache=self._results
        )
        cls_b = baseline_for(
            result, healthy, max_age_s=self.policy.baseline_max_age_h * 3600.0, now=self.clock.now()
        )
        return cls_b, peers_for(result, healthy, self.policy.peer_window_min * 60.0)

    def _rejudge(self, ep: NodeEpisode, step: Step, records: dict[str, NodeRecord]) -> str:
        """Judge a held sweep's stored result again now that a reference exists.

        A judged sweep row is a fact and never changes: the new verdict is a new row of the
        same kind, job and result (`rejudge_of` names the held one), costing no node time."""
        s = self.store.get_sweep(int(step.data["sweep"]))
        res = rec.result_of(s, self._results)
        if res is None:
            raise ValueError(f"sweep {s.id}: no stored result to judge again")
        baseline, peers = self._references(res, s.kind, records, exclude=(s.node,))
        ref_status = None
        if s.reference_node:
            ref_status = reference_status(
                s.reference_node, rec.past_sweeps(self.store.sweeps(limit=2000), self._results), self.policy
            )
        v = judge_result(
            res,
            baseline,
            self.policy,
            suspected=ep.suspected,
            ref_status=ref_status,
            peers=peers,
            use_floor=True,
        )
        old = s.metrics if isinstance(s.metrics, dict) else {}
        metrics = rec.outcome_metrics(
            v,
            job_state=str(old.get("job_state") or "COMPLETED"),
            runtime_s=old.get("runtime_s"),
            node_count=self._count(s),
            result_path=str(old.get("result_path") or ""),
        )
        metrics["rejudge_of"] = s.id
        metrics["runtime_s"] = 0.0  # the held row already counts the job's node time
        sv = rec.store_verdict(v)
        new = self.store.add_sweep(
            s.node, s.kind, reference_node=s.reference_node, hw_class=s.hw_class, slurm_job_id=s.slurm_job_id
        )
        self.store.update_sweep(
            new.id,
            verdict=sv,
            metrics=metrics,
            failure_reason=None if sv is StoreVerdict.PASS else v.reason,
            started_at=s.started_at,
            finished_at=self.clock.now(),
        )
        return (
            f"{self._label(s)} sweep {s.id} judged again as sweep {new.id}: {v.outcome.value}:"
            f" {v.reason} [{v.basis_text}]"
        )

    # ------------------------------------------------------------------ gate
    def _fail(self, live: NodeInfo, ep: NodeEpisode, step: Step) -> str:
        reason = step.why if step.why.startswith("slurmguard:") else make_reason(step.why)
        done = []
        if not (live.drained_by_us and (live.reason or "").startswith(reason)):
            self.executor.drain(live.name, reason, evidence={"sweep": step.data["sweep"]})
            done.append(f"drained: {reason}")
        act = self.ladder.enter(
            live.name,
            ep,
            failed_sweep=int(step.data["sweep"]),
            reason=reason,
            evidence={"sweep": step.data["sweep"]},
        )
        done.append(f"triage: {act.rung.value} planned")
        return "; ".join(done)

    def _return(self, live: NodeInfo, ep: NodeEpisode, view: _View) -> str:
        node = live.name
        done = []
        if live.drained_by_us:
            self.executor.resume(node, evidence={"why": "sweeps passed"})
            done.append("resumed")
        if live.comment and is_ours(live.comment):
            try:
                self.executor.clear_comment(node, evidence={"why": "sweeps passed"})
                done.append("comment cleared")
            except NotOurs:
                pass
        for name in (pair_name(node), quarantine_name(node)):
            if self._delete_reservation(name, node, view):
                done.append(f"deleted {name}")
        passed = [s.id for s in ep.round_sweeps if rec.passed(s)]
        self.store.transition(
            node,
            NodeState.HEALTHY,
            "sweeps passed: returned to service",
            {LAST_SWEEP: ep.last_sweep_id, "sweeps": passed, "rolling": ep.rolling},
            actor=self.actor,
        )
        done.append("healthy")
        return ", ".join(done)

    # ------------------------------------------------------------------ rolling sweeps
    def _rolling(self, view: _View, records: dict[str, NodeRecord], taken: set[str], res: TickResult) -> None:
        p = self.policy
        if not p.rolling_enabled or p.rolling_nodes_per_hour <= 0:
            return
        interval = 3600.0 / p.rolling_nodes_per_hour
        recent = self.store.transitions(since=view.now - interval, to_state=NodeState.QUARANTINED)
        if any(isinstance(t.evidence, dict) and t.evidence.get(ROLLING) for t in recent):
            return
        reserved = view.reserved
        cands = []
        for name, r in records.items():
            n = view.nodes.get(name)
            if r.state is not NodeState.HEALTHY or n is None or name in taken or name in reserved:
                continue
            if not is_free(n):
                continue
            last = self.store.sweeps(node=name, limit=1)
            when = last[-1].created_at.timestamp() if last else 0.0
            cands.append((when, name))
        if not cands:
            return
        cands.sort()
        self._start_unsuspected(
            cands[0][1], "rolling sweep", "rolling sweep of an idle healthy node", {}, taken, res
        )

    def _start_unsuspected(
        self, node: str, what: str, why: str, evidence: dict[str, Any], taken: set[str], res: TickResult
    ) -> bool:
        """Take an idle healthy node into quarantine for sweeps that seed references (rolling,
        same-window peer, `sweep baseline`): unsuspected, returned when they pass."""
        res.steps.append(Step(node, "start_" + what.split()[0], why))
        if self.dry_run:
            return False
        self.store.transition(
            node,
            NodeState.QUARANTINED,
            f"{what}: idle healthy node",
            {ROLLING: True, **evidence},
            actor=self.actor,
        )
        self.executor.create_reservation(
            quarantine_name(node), [node], self.policy.quarantine_reservation_min, evidence={"why": what}
        )
        taken.add(node)
        res.done.append(f"{node}: {what} started")
        return True

    # ------------------------------------------------------------------ cold start: peers
    def _peer_sweeps(
        self, view: _View, records: dict[str, NodeRecord], taken: set[str], res: TickResult
    ) -> None:
        """Sweep idle healthy peers of a class whose suspected node has no reference yet.

        Demand: a suspected node of the class is quarantined (being swept) and its
        class has no fresh baseline of 1-node results (`baseline_max_age_h`), or its latest
        sweep was held for want of a reference. Supply: healthy nodes of the class with a
        passed 1-node sweep within `peer_window_min`, plus peers being swept now. One peer
        at a time per class (its 2-node sweep needs another free node as reference); never
        a busy node: only nodes idle, in service and unreserved are taken.
        """
        p = self.policy
        if not p.peer_sweeps:
            return
        now = view.now
        window = p.peer_window_min * 60.0
        # this tick's steps may have returned or drained nodes: read the states again
        records = {r.name: r for r in self.store.list_nodes()}
        demand: set[str] = set()
        in_progress: dict[str, int] = {}
        for name, r in records.items():
            # only nodes being swept now: one waiting for a reboot or reimage would let the
            # peers' window pass (and have them swept again every window)
            if r.state is not NodeState.QUARANTINED:
                continue
            ep = load_episode(self.store, name)
            klass = hw_class(view.nodes.get(name), r, p)
            if ep.rolling and not ep.suspected:
                if (
                    ep.started_at is not None
                    and ep.actions == ()
                    and any(
                        isinstance(t.evidence, dict) and t.evidence.get(PEER)
                        for t in self.store.node_history(name, since=ep.started_at)[:1]
                    )
                ):
                    in_progress[klass] = in_progress.get(klass, 0) + 1
                continue
            held = any(rec.outcome_of(x) == Outcome.INSUFFICIENT_BASELINE.value for x in ep.round_sweeps[-1:])
            if (
                held
                or self._fresh_nodes(klass, records, now - p.baseline_max_age_h * 3600.0)
                < p.bootstrap_min_nodes
            ):
                demand.add(klass)
        for klass in sorted(demand):
            if in_progress.get(klass):
                continue
            if self._fresh_nodes(klass, records, now - window) >= p.peer_min_nodes:
                continue
            cands = []
            for name, r in records.items():
                n = view.nodes.get(name)
                if (
                    r.state is not NodeState.HEALTHY
                    or n is None
                    or name in taken
                    or name in view.reserved
                    or not is_free(n)
                    or hw_class(n, r, p) != klass
                ):
                    continue
                last = self.store.sweeps(node=name, limit=1)
                cands.append((last[-1].created_at.timestamp() if last else 0.0, name))
            if not cands:
                res.steps.append(Step(f"class:{klass}", "wait", "no idle healthy peer to sweep"))
                continue
            cands.sort()
            self._start_unsuspected(
                cands[0][1],
                "peer sweep",
                f"same-window peer for class {klass} (no baseline yet)",
                {PEER: klass},
                taken,
                res,
            )

    def _peers_possible(self, klass: str | None, view: _View, records: Mapping[str, NodeRecord]) -> bool:
        """Can same-window peers of the class still come: peer sweeps on, and a peer sweep of
        the class running or an idle healthy node of the class to sweep? While they can, a
        suspected node waits for them rather than being judged by the loose floor."""
        if not self.policy.peer_sweeps or klass is None:
            return False
        fresh = {r.name: r for r in self.store.list_nodes()}
        for name, r in fresh.items():
            n = view.nodes.get(name)
            if hw_class(n, r, self.policy) != klass:
                continue
            if r.state is NodeState.QUARANTINED:
                ep = load_episode(self.store, name)
                if ep.rolling and not ep.suspected:
                    return True
            elif r.state is NodeState.HEALTHY and n is not None and is_free(n) and name not in view.reserved:
                return True
        return False

    def _vouching_nodes(self, records: Mapping[str, NodeRecord]) -> set[str]:
        """Nodes whose passed sweeps may judge others: healthy ones, and unsuspected nodes in
        a rolling/peer/baseline episode (their 1-node pass counts before their 2-node sweep)."""
        out = set()
        for n, r in records.items():
            if r.state is NodeState.HEALTHY:
                out.add(n)
            elif r.state is NodeState.QUARANTINED:
                ep = load_episode(self.store, n)
                if ep.rolling and not ep.suspected:
                    out.add(n)
        return out

    def _fresh_nodes(self, klass: str, records: Mapping[str, NodeRecord], since: float) -> int:
        """Vouching nodes of the class whose latest judged 1-node sweep passed after `since`."""
        healthy = self._vouching_nodes(records)
        pool = [
            x
            for x in self.store.sweeps(hw_class=klass, kind=SweepKind.ONE_NODE, limit=2000)
            if x.node in healthy
        ]
        return sum(1 for r in rec.healthy_results(pool, cache=self._results) if r.finished >= since)

    def start_baseline_sweeps(self, klass: str | None = None, count: int | None = None) -> TickResult:
        """`slurmguard sweep baseline --refresh`: seed or refresh class baselines now by
        sweeping idle healthy nodes (unsuspected). Per class at most `count` nodes (default
        bootstrap_min_nodes), always leaving one free node of the class as 2-node reference."""
        now = self.clock.now()
        view = self._read_view(now)
        records = self._sync_nodes(view)
        res = TickResult(at=now)
        taken: set[str] = set()
        by_class: dict[str, list[str]] = {}
        for name, r in sorted(records.items()):
            n = view.nodes.get(name)
            if r.state is not NodeState.HEALTHY or n is None or not is_free(n) or name in view.reserved:
                continue
            by_class.setdefault(hw_class(n, r, self.policy), []).append(name)
        for k, names in sorted(by_class.items()):
            if klass is not None and k != klass:
                continue
            want = min(count or self.policy.bootstrap_min_nodes, len(names) - 1)
            if want < 1:
                res.errors.append(
                    f"class {k}: {len(names)} free healthy node(s); a baseline sweep"
                    " needs one more free node as its 2-node reference"
                )
                continue
            for name in names[:want]:
                self._start_unsuspected(
                    name, "baseline sweep", f"baseline of class {k} on demand", {"baseline": k}, taken, res
                )
        return res


def build_scheduler(
    *,
    policy: Policy,
    store: Store,
    slurm: SlurmClient,
    clock: Clock,
    executor: ActionExecutor,
    files: ResultFiles | None = None,
    runner: CommandRunner | None = None,
) -> SweepScheduler:
    """The scheduler the controller ticks every cycle."""
    return SweepScheduler(
        policy.sweeps,
        policy.triage,
        store,
        slurm,
        clock,
        executor,
        files=files,
        runner=runner,
        actor=executor.actor,
    )
