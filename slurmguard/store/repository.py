"""The Store: the small typed API the controller, sweeps and triage code use.

Every public method is one transaction (a lifecycle change and its transition
row commit together or not at all); `with store.atomic() as tx:` groups several
calls into one. Methods take and return records (slurmguard.store.records),
never ORM objects. Times default to the injected Clock, never to the database
server's clock, so FakeClock tests and replays are exact.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, Self, TypeVar

from sqlalchemy import Engine, Select, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

from slurmguard.clock import Clock, SystemClock
from slurmguard.names import NODE_NAME_RULE, is_node_name
from slurmguard.store import db
from slurmguard.store.errors import InvalidValue, NotFound, StaleState, NodeNotRegistered
from slurmguard.store.lifecycle import (
    INITIAL_STATE,
    NodeState,
    check_transition,
    parse_state,
)
from slurmguard.store.models import (
    ActionStatus,
    AuditEntry,
    AuditOutcome,
    Incident,
    IncidentStatus,
    IncidentTier,
    Node,
    NodeTransition,
    StepTimeSummary,
    Sweep,
    SweepKind,
    TelemetrySummary,
    TriageAction,
    TriageRung,
    Verdict,
)
from slurmguard.store.records import (
    AuditRecord,
    IncidentRecord,
    NodeRecord,
    StepTimeRecord,
    SweepRecord,
    TelemetrySummaryRecord,
    TransitionRecord,
    TriageActionRecord,
)
from slurmguard.store.types import Timestamp, jsonable, to_utc

ACTION_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
CAUSE_MAX = 256
DEFAULT_ACTOR = "slurmguard"

E = TypeVar("E")
_FINAL_VERDICTS = frozenset({Verdict.PASS, Verdict.FAIL, Verdict.ERROR})
_FINISHED_ACTIONS = frozenset(
    {ActionStatus.DONE, ActionStatus.FAILED, ActionStatus.SKIPPED}
)


def utc(ts: Timestamp) -> datetime:
    """Aware UTC datetime from epoch seconds (Clock.now()) or an aware datetime."""
    return to_utc(ts)


class Store:
    """Typed access to slurmguard's database.

    Build it with `Store.open(url, clock)` (checks the schema is migrated) or
    `Store(engine, clock)`.
    """

    def __init__(self, engine: Engine, clock: Clock | None = None) -> None:
        self.engine = engine
        self.clock: Clock = clock or SystemClock()
        self._sessions: sessionmaker[Session] = db.session_factory(engine)
        self._reads: sessionmaker[Session] = db.session_factory(db.reading(engine))
        self._bound: Session | None = None

    @classmethod
    def open(
        cls, url: str, clock: Clock | None = None, *, check_schema: bool = True
    ) -> Store:
        """Connect to `url`; SchemaNotCurrent unless it is at the newest migration."""
        engine = db.make_engine(url)
        if check_schema:
            try:
                db.require_current(engine)
            except BaseException:
                engine.dispose()
                raise
        return cls(engine, clock)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def atomic(self) -> Iterator[Store]:
        """A Store view whose calls share one transaction, committed at the end of the block."""
        if self._bound is not None:
            yield self
            return
        view = Store.__new__(Store)
        view.engine, view.clock, view._sessions, view._reads = (
            self.engine,
            self.clock,
            self._sessions,
            self._reads,
        )
        with db.translate_errors(self.engine.url), self._sessions.begin() as session:
            view._bound = session
            try:
                yield view
            finally:
                view._bound = None

    @contextlib.contextmanager
    def _tx(self, read: bool = False) -> Iterator[Session]:
        """A transaction; read=True: one that only reads (on SQLite it does not take
        the write lock, so reads never queue behind a writer or block one)."""
        if self._bound is not None:
            yield self._bound
            return
        factory = self._reads if read else self._sessions
        with db.translate_errors(self.engine.url), factory.begin() as session:
            yield session

    def now(self) -> datetime:
        return to_utc(self.clock.now())

    def _at(self, at: Timestamp | None, what: str = "at") -> datetime:
        return self.now() if at is None else to_utc(at, what)

    # ------------------------------------------------------------ nodes
    def get_or_create_node(
        self,
        name: str,
        *,
        hw_class: str | None = None,
        partitions: Sequence[str] | None = None,
        at: Timestamp | None = None,
    ) -> NodeRecord:
        """The node called `name`, registered as healthy if new.

        hw_class/partitions, when given, overwrite the stored values (Slurm's
        view wins). Registering writes a first transition row (from_state None).
        """
        _check_name(name)
        parts = _partitions(partitions) if partitions is not None else None
        with self._tx() as s:
            row = s.scalar(select(Node).where(Node.name == name))
            if row is None:
                when = self._at(at)
                row = Node(
                    name=name,
                    hw_class=hw_class,
                    state=INITIAL_STATE.value,
                    state_since=when,
                    partitions=list(parts or ()),
                    last_seen=None,
                    created_at=when,
                )
                try:
                    with s.begin_nested():
                        s.add(row)
                        s.flush()
                except IntegrityError:
                    # Another process registered it between our read and insert.
                    row = s.scalar(select(Node).where(Node.name == name))
                    if row is None:
                        raise
                else:
                    s.add(
                        NodeTransition(
                            node_id=row.id,
                            at=when,
                            from_state=None,
                            to_state=INITIAL_STATE.value,
                            cause="registered",
                            evidence={},
                            actor=DEFAULT_ACTOR,
                            forced=False,
                        )
                    )
            if hw_class is not None and row.hw_class != hw_class:
                row.hw_class = hw_class
            if parts is not None and tuple(row.partitions) != parts:
                row.partitions = list(parts)
            s.flush()
            return _node_rec(row)

    def register_nodes(self, nodes: dict[str, Sequence[str]], at: Timestamp | None = None) -> int:
        """Register every node of `nodes` (name -> partitions) the database does not
        know yet, and set the partitions of those it knows (Slurm's view wins), in
        one transaction, however many nodes; returns how many were new."""
        for name in nodes:
            _check_name(name)
        when = self._at(at)
        with self._tx() as s:
            have = {r.name: r for r in s.scalars(select(Node).where(Node.name.in_(list(nodes))))} \
                if len(nodes) <= 500 else {r.name: r for r in s.scalars(select(Node))}
            fresh = []
            for name, parts in nodes.items():
                p = list(_partitions(parts))
                row = have.get(name)
                if row is None:
                    row = Node(name=name, hw_class=None, state=INITIAL_STATE.value, state_since=when,
                               partitions=p, last_seen=None, created_at=when)
                    s.add(row)
                    fresh.append(row)
                elif list(row.partitions) != p:
                    row.partitions = p
            s.flush()
            s.add_all(NodeTransition(node_id=row.id, at=when, from_state=None,
                                     to_state=INITIAL_STATE.value, cause="registered", evidence={},
                                     actor=DEFAULT_ACTOR, forced=False) for row in fresh)
        return len(fresh)

    def node_counts(self) -> dict[str, int]:
        """Nodes per lifecycle state (one aggregate query)."""
        from sqlalchemy import func

        with self._tx(read=True) as s:
            return {str(st): int(n) for st, n in
                    s.execute(select(Node.state, func.count()).group_by(Node.state))}

    def get_node(self, name: str) -> NodeRecord | None:
        with self._tx(read=True) as s:
            row = s.scalar(select(Node).where(Node.name == name))
            return None if row is None else _node_rec(row)

    def list_nodes(
        self,
        state: NodeState | str | Iterable[NodeState | str] | None = None,
        *,
        hw_class: str | None = None,
        partition: str | None = None,
    ) -> list[NodeRecord]:
        """Nodes by name, optionally only those in `state` (one or several), class or partition."""
        q = select(Node).order_by(Node.name)
        if state is not None:
            states = [state] if isinstance(state, str) else list(state)
            q = q.where(Node.state.in_([parse_state(x).value for x in states]))
        if hw_class is not None:
            q = q.where(Node.hw_class == hw_class)
        with self._tx(read=True) as s:
            rows = [_node_rec(r) for r in s.scalars(q)]
        # JSON containment differs per backend; the fleet is small enough to filter here.
        return (
            rows
            if partition is None
            else [r for r in rows if partition in r.partitions]
        )

    def mark_seen(self, names: Iterable[str], at: Timestamp | None = None) -> int:
        """Set last_seen of existing nodes; returns how many rows changed."""
        names = list(names)
        if not names:
            return 0
        with self._tx() as s:
            res = s.execute(
                update(Node).where(Node.name.in_(names)).values(last_seen=self._at(at))
            )
            return int(res.rowcount or 0)

    def transition(
        self,
        node: str,
        to_state: NodeState | str,
        cause: str,
        evidence: dict[str, Any] | None = None,
        *,
        actor: str = DEFAULT_ACTOR,
        force: bool = False,
        expect_from: NodeState | str | None = None,
        at: Timestamp | None = None,
    ) -> TransitionRecord:
        """Move `node` to `to_state` and record why, in one transaction.

        Raises IllegalTransition for a change the lifecycle does not allow
        (unless `force`, an admin override, recorded as forced=True), StaleState
        when `expect_from` is given and the node is in another state (or another
        writer moved it concurrently), NodeNotRegistered for an unregistered node.
        """
        to = parse_state(to_state)
        cause = _check_cause(cause)
        ev = _evidence(evidence, "evidence")
        with self._tx() as s:
            row = self._node_row(s, node)
            frm = NodeState(row.state)
            if expect_from is not None and frm != parse_state(expect_from):
                raise StaleState(
                    f"node {node}: expected state {parse_state(expect_from).value}, "
                    f"found {frm.value}"
                )
            check_transition(node, frm, to, force=force)
            when = self._at(at)
            # Compare-and-set: a concurrent writer that moved the node first wins,
            # and this call fails instead of overwriting its transition.
            res = s.execute(
                update(Node)
                .where(Node.id == row.id, Node.state == frm.value)
                .values(state=to.value, state_since=when)
                .execution_options(synchronize_session=False)
            )
            if res.rowcount != 1:
                raise StaleState(
                    f"node {node}: state changed concurrently (was {frm.value})"
                )
            tr = NodeTransition(
                node_id=row.id,
                at=when,
                from_state=frm.value,
                to_state=to.value,
                cause=cause,
                evidence=ev,
                actor=_check_actor(actor),
                forced=bool(force),
            )
            s.add(tr)
            s.flush()
            s.expire(row)
            return _transition_rec(tr, node)

    def node_history(
        self, name: str, *, since: Timestamp | None = None
    ) -> list[TransitionRecord]:
        """Transitions of a node, oldest first (the first is its registration)."""
        with self._tx() as s:
            row = self._node_row(s, name)
            q = select(NodeTransition).where(NodeTransition.node_id == row.id)
            if since is not None:
                q = q.where(NodeTransition.at >= to_utc(since, "since"))
            q = q.order_by(NodeTransition.at, NodeTransition.id)
            return [_transition_rec(t, name) for t in s.scalars(q)]

    def transitions(
        self,
        *,
        since: Timestamp | None = None,
        to_state: NodeState | str | None = None,
        limit: int | None = None,
    ) -> list[TransitionRecord]:
        """Fleet-wide transitions, oldest first (the newest `limit` when given)."""
        q = select(NodeTransition, Node.name).join(
            Node, Node.id == NodeTransition.node_id
        )
        if since is not None:
            q = q.where(NodeTransition.at >= to_utc(since, "since"))
        if to_state is not None:
            q = q.where(NodeTransition.to_state == parse_state(to_state).value)
        with self._tx() as s:
            rows = _newest(
                s, q, (NodeTransition.at, NodeTransition.id), limit, scalars=False
            )
            return [_transition_rec(t, name) for t, name in rows]

    # ------------------------------------------------------------ audit log
    def audit(
        self,
        action: str,
        *,
        actor: str = DEFAULT_ACTOR,
        node: str | None = None,
        job_id: str | None = None,
        reason: str | None = None,
        argv: Sequence[str] | None = None,
        outcome: AuditOutcome | str = AuditOutcome.OK,
        error: str | None = None,
        evidence: dict[str, Any] | None = None,
        at: Timestamp | None = None,
    ) -> AuditRecord:
        """Append one row to the audit log: a Slurm action taken, failed, or only logged (dry_run)."""
        if not ACTION_RE.match(action or ""):
            raise InvalidValue(
                f"audit action '{action}': use lower_snake_case, at most 32 characters"
            )
        out = _enum(AuditOutcome, outcome, "audit outcome")
        if out is AuditOutcome.ERROR and not error:
            raise InvalidValue(f"audit {action}: outcome 'error' needs the error text")
        args = None if argv is None else _argv(argv)
        row = AuditEntry(
            at=self._at(at),
            actor=_check_actor(actor),
            action=action,
            node=node,
            job_id=_opt_str(job_id),
            reason=reason,
            argv=args,
            outcome=out.value,
            error=error,
            evidence=_evidence(evidence, "evidence"),
        )
        with self._tx() as s:
            s.add(row)
            s.flush()
            return _audit_rec(row)

    def audit_entries(
        self,
        *,
        node: str | None = None,
        action: str | Iterable[str] | None = None,
        outcome: AuditOutcome | str | None = None,
        since: Timestamp | None = None,
        until: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[AuditRecord]:
        """Audit rows, oldest first (the newest `limit` when given); `until` is exclusive."""
        q = select(AuditEntry)
        if node is not None:
            q = q.where(AuditEntry.node == node)
        if action is not None:
            q = q.where(
                AuditEntry.action.in_(
                    [action] if isinstance(action, str) else list(action)
                )
            )
        if outcome is not None:
            q = q.where(
                AuditEntry.outcome
                == _enum(AuditOutcome, outcome, "audit outcome").value
            )
        if since is not None:
            q = q.where(AuditEntry.at >= to_utc(since, "since"))
        if until is not None:
            q = q.where(AuditEntry.at < to_utc(until, "until"))
        with self._tx(read=True) as s:
            return [
                _audit_rec(r)
                for r in _newest(s, q, (AuditEntry.at, AuditEntry.id), limit)
            ]

    # ------------------------------------------------------------ incidents
    def add_incident(
        self,
        job_id: str,
        *,
        nodes: Sequence[str],
        tier: IncidentTier | str,
        onset_at: Timestamp,
        detected_at: Timestamp | None = None,
        kind: str = "slowdown",
        slowdown: float | None = None,
        status: IncidentStatus | str = IncidentStatus.OPEN,
        action_at: Timestamp | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> IncidentRecord:
        """Record a detected incident; detection_delay_s = detected_at - onset_at (>= 0)."""
        onset = to_utc(onset_at, "onset_at")
        detected = self._at(detected_at, "detected_at")
        delay = (detected - onset).total_seconds()
        if delay < 0:
            raise InvalidValue(
                f"incident of job {job_id}: detected_at {detected.isoformat()} is before "
                f"onset_at {onset.isoformat()}"
            )
        now = self.now()
        row = Incident(
            job_id=_job(job_id),
            kind=_short(kind, 32, "incident kind"),
            nodes=[_check_name(n) for n in nodes],
            tier=_enum(IncidentTier, tier, "incident tier").value,
            slowdown=_float(slowdown),
            onset_at=onset,
            detected_at=detected,
            action_at=None if action_at is None else to_utc(action_at, "action_at"),
            detection_delay_s=delay,
            status=_enum(IncidentStatus, status, "incident status").value,
            outcome=None,
            evidence=_evidence(evidence, "evidence"),
            created_at=now,
            updated_at=now,
        )
        with self._tx() as s:
            s.add(row)
            s.flush()
            return _incident_rec(row)

    def update_incident(
        self,
        incident_id: int,
        *,
        status: IncidentStatus | str | None = None,
        tier: IncidentTier | str | None = None,
        action_at: Timestamp | None = None,
        outcome: str | None = None,
        nodes: Sequence[str] | None = None,
        evidence: dict[str, Any] | None = None,
    ) -> IncidentRecord:
        """Change the given fields (None = keep); `evidence` keys are merged into the stored dict."""
        with self._tx() as s:
            row = _get(s, Incident, incident_id, "incident")
            if status is not None:
                row.status = _enum(IncidentStatus, status, "incident status").value
            if tier is not None:
                row.tier = _enum(IncidentTier, tier, "incident tier").value
            if action_at is not None:
                row.action_at = to_utc(action_at, "action_at")
            if outcome is not None:
                row.outcome = outcome
            if nodes is not None:
                row.nodes = [_check_name(n) for n in nodes]
            if evidence is not None:
                row.evidence = {**row.evidence, **_evidence(evidence, "evidence")}
            row.updated_at = self.now()
            s.flush()
            return _incident_rec(row)

    def get_incident(self, incident_id: int) -> IncidentRecord:
        with self._tx() as s:
            return _incident_rec(_get(s, Incident, incident_id, "incident"))

    def incidents(
        self,
        *,
        since: Timestamp | None = None,
        status: IncidentStatus | str | None = None,
        job_id: str | None = None,
        node: str | None = None,
        limit: int | None = None,
    ) -> list[IncidentRecord]:
        """Incidents by detection time, oldest first (the newest `limit` when given)."""
        q = select(Incident)
        if since is not None:
            q = q.where(Incident.detected_at >= to_utc(since, "since"))
        if status is not None:
            q = q.where(
                Incident.status
                == _enum(IncidentStatus, status, "incident status").value
            )
        if job_id is not None:
            q = q.where(Incident.job_id == str(job_id))
        with self._tx(read=True) as s:
            rows = [
                _incident_rec(r)
                for r in _newest(
                    s, q, (Incident.detected_at, Incident.id), None if node else limit
                )
            ]
        if node is not None:
            rows = [r for r in rows if node in r.nodes]
            rows = rows[-limit:] if limit else rows
        return rows

    def live_incidents(self) -> list[IncidentRecord]:
        """Every incident not closed yet (open, mitigated or suppressed), oldest
        first: what a control cycle reads once for all its jobs."""
        live = [IncidentStatus.OPEN.value, IncidentStatus.MITIGATED.value,
                IncidentStatus.SUPPRESSED.value]
        q = select(Incident).where(Incident.status.in_(live)).order_by(Incident.detected_at, Incident.id)
        with self._tx(read=True) as s:
            return [_incident_rec(r) for r in s.scalars(q)]

    # ------------------------------------------------------------ summaries
    def add_telemetry_summaries(self, rows: Iterable[TelemetrySummaryRecord]) -> int:
        """Store peer-compared telemetry windows; nodes must be registered. Returns the count."""
        with self._tx() as s:
            ids = _NodeIds(s)
            objs = []
            for r in rows:
                start, end = _window(
                    r.window_start, r.window_end, f"telemetry {r.node}/{r.signal}"
                )
                objs.append(
                    TelemetrySummary(
                        node_id=ids[r.node],
                        job_id=_opt_str(r.job_id),
                        window_start=start,
                        window_end=end,
                        signal=_short(r.signal, 64, "telemetry signal"),
                        value=_float(r.value),
                        unit=r.unit,
                        peer_median=_float(r.peer_median),
                        robust_z=_float(r.robust_z),
                        deviating=bool(r.deviating),
                    )
                )
            s.add_all(objs)
            s.flush()
            return len(objs)

    def telemetry_summaries(
        self,
        node: str | None = None,
        *,
        signal: str | None = None,
        job_id: str | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[TelemetrySummaryRecord]:
        """Windows by end time, oldest first; `since` compares window_end."""
        q = select(TelemetrySummary, Node.name).join(
            Node, Node.id == TelemetrySummary.node_id
        )
        if node is not None:
            q = q.where(Node.name == node)
        if signal is not None:
            q = q.where(TelemetrySummary.signal == signal)
        if job_id is not None:
            q = q.where(TelemetrySummary.job_id == str(job_id))
        if since is not None:
            q = q.where(TelemetrySummary.window_end >= to_utc(since, "since"))
        with self._tx() as s:
            rows = _newest(
                s,
                q,
                (TelemetrySummary.window_end, TelemetrySummary.id),
                limit,
                scalars=False,
            )
            return [
                TelemetrySummaryRecord(
                    node=name,
                    signal=t.signal,
                    window_start=t.window_start,
                    window_end=t.window_end,
                    value=t.value,
                    unit=t.unit,
                    peer_median=t.peer_median,
                    robust_z=t.robust_z,
                    deviating=t.deviating,
                    job_id=t.job_id,
                    id=t.id,
                )
                for t, name in rows
            ]

    def add_step_time_summaries(self, rows: Iterable[StepTimeRecord]) -> int:
        """Store per-rank step-time windows; slowdown is derived from the baseline when absent."""
        with self._tx() as s:
            ids = _NodeIds(s)
            objs = []
            for r in rows:
                what = f"step time of job {r.job_id} rank {r.rank}"
                start, end = _window(r.window_start, r.window_end, what)
                mean = _float(r.mean_step_s)
                if mean is None or mean <= 0:
                    raise InvalidValue(
                        f"{what}: mean_step_s must be a positive number, got {r.mean_step_s!r}"
                    )
                if r.iterations < 0:
                    raise InvalidValue(
                        f"{what}: iterations must be >= 0, got {r.iterations}"
                    )
                base = _float(r.baseline_step_s)
                slow = _float(r.slowdown)
                if slow is None and base is not None and base > 0:
                    slow = mean / base - 1.0
                objs.append(
                    StepTimeSummary(
                        job_id=_job(r.job_id),
                        step=_short(str(r.step), 32, "job step"),
                        node_id=ids[r.node],
                        rank=r.rank,
                        window_start=start,
                        window_end=end,
                        iterations=int(r.iterations),
                        mean_step_s=mean,
                        baseline_step_s=base,
                        slowdown=slow,
                    )
                )
            s.add_all(objs)
            s.flush()
            return len(objs)

    def step_time_summaries(
        self,
        *,
        job_id: str | None = None,
        node: str | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[StepTimeRecord]:
        """Windows by end time, oldest first; `since` compares window_end."""
        q = select(StepTimeSummary, Node.name).join(
            Node, Node.id == StepTimeSummary.node_id
        )
        if job_id is not None:
            q = q.where(StepTimeSummary.job_id == str(job_id))
        if node is not None:
            q = q.where(Node.name == node)
        if since is not None:
            q = q.where(StepTimeSummary.window_end >= to_utc(since, "since"))
        with self._tx() as s:
            rows = _newest(
                s,
                q,
                (StepTimeSummary.window_end, StepTimeSummary.id),
                limit,
                scalars=False,
            )
            return [
                StepTimeRecord(
                    job_id=t.job_id,
                    step=t.step,
                    node=name,
                    rank=t.rank,
                    window_start=t.window_start,
                    window_end=t.window_end,
                    iterations=t.iterations,
                    mean_step_s=t.mean_step_s,
                    baseline_step_s=t.baseline_step_s,
                    slowdown=t.slowdown,
                    id=t.id,
                )
                for t, name in rows
            ]

    def prune_summaries(self, before: Timestamp) -> int:
        """Delete telemetry and step-time windows that ended before `before`; returns rows deleted."""
        cutoff = to_utc(before, "before")
        with self._tx() as s:
            n = s.execute(
                delete(TelemetrySummary).where(TelemetrySummary.window_end < cutoff)
            ).rowcount
            n += s.execute(
                delete(StepTimeSummary).where(StepTimeSummary.window_end < cutoff)
            ).rowcount
            return int(n or 0)

    # ------------------------------------------------------------ sweeps
    def add_sweep(
        self,
        node: str,
        kind: SweepKind | str,
        *,
        reference_node: str | None = None,
        hw_class: str | None = None,
        slurm_job_id: str | None = None,
        submitted_at: Timestamp | None = None,
    ) -> SweepRecord:
        """A pending sweep of `node`; 2-node sweeps need a known-good `reference_node`.

        hw_class defaults to the node's class (baselines are per class).
        """
        k = _enum(SweepKind, kind, "sweep kind")
        if k is SweepKind.TWO_NODE and not reference_node:
            raise InvalidValue(f"2node sweep of {node}: a reference node is required")
        if k is SweepKind.ONE_NODE and reference_node:
            raise InvalidValue(
                f"1node sweep of {node}: takes no reference node (got {reference_node})"
            )
        if reference_node == node:
            raise InvalidValue(
                f"2node sweep of {node}: the reference node must be another node"
            )
        with self._tx() as s:
            ids = _NodeIds(s)
            node_id = ids[node]
            ref_id = ids[reference_node] if reference_node else None
            row = Sweep(
                slurm_job_id=_opt_str(slurm_job_id),
                kind=k.value,
                node_id=node_id,
                reference_node_id=ref_id,
                hw_class=hw_class or ids.hw_class(node),
                created_at=self.now(),
                submitted_at=None
                if submitted_at is None
                else to_utc(submitted_at, "submitted_at"),
                started_at=None,
                finished_at=None,
                metrics={},
                verdict=Verdict.PENDING.value,
                failure_reason=None,
            )
            s.add(row)
            s.flush()
            return _sweep_rec(row, node, reference_node)

    def update_sweep(
        self,
        sweep_id: int,
        *,
        slurm_job_id: str | None = None,
        submitted_at: Timestamp | None = None,
        started_at: Timestamp | None = None,
        finished_at: Timestamp | None = None,
        metrics: dict[str, Any] | None = None,
        verdict: Verdict | str | None = None,
        failure_reason: str | None = None,
    ) -> SweepRecord:
        """Fill in a sweep as it progresses (None = keep).

        A final verdict (pass/fail/error) is a fact: it may be written again
        unchanged (restart safety) but never changed; a re-sweep is a new row.
        fail and error need a failure_reason. finished_at defaults to now when
        a final verdict is set. `metrics` replaces the stored metrics.
        """
        with self._tx() as s:
            row = _get(s, Sweep, sweep_id, "sweep")
            old = Verdict(row.verdict)
            if verdict is not None:
                new = _enum(Verdict, verdict, "sweep verdict")
                if old in _FINAL_VERDICTS and new != old:
                    raise InvalidValue(
                        f"sweep {sweep_id}: verdict is already {old.value}; "
                        f"cannot change it to {new.value} (start a new sweep)"
                    )
                reason = (
                    failure_reason if failure_reason is not None else row.failure_reason
                )
                if new in (Verdict.FAIL, Verdict.ERROR) and not reason:
                    raise InvalidValue(
                        f"sweep {sweep_id}: verdict {new.value} needs a failure_reason"
                    )
                row.verdict = new.value
                if (
                    new in _FINAL_VERDICTS
                    and row.finished_at is None
                    and finished_at is None
                ):
                    row.finished_at = self.now()
            if slurm_job_id is not None:
                row.slurm_job_id = _opt_str(slurm_job_id)
            if submitted_at is not None:
                row.submitted_at = to_utc(submitted_at, "submitted_at")
            if started_at is not None:
                row.started_at = to_utc(started_at, "started_at")
            if finished_at is not None:
                row.finished_at = to_utc(finished_at, "finished_at")
            if metrics is not None:
                row.metrics = _evidence(metrics, "metrics")
            if failure_reason is not None:
                row.failure_reason = failure_reason
            s.flush()
            return self._sweep_rec(s, row)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        with self._tx() as s:
            return self._sweep_rec(s, _get(s, Sweep, sweep_id, "sweep"))

    def sweep_by_job(self, slurm_job_id: str) -> SweepRecord | None:
        """The sweep submitted as Slurm job `slurm_job_id` (the newest, if ids were reused)."""
        with self._tx() as s:
            row = s.scalar(
                select(Sweep)
                .where(Sweep.slurm_job_id == str(slurm_job_id))
                .order_by(Sweep.id.desc())
                .limit(1)
            )
            return None if row is None else self._sweep_rec(s, row)

    def sweeps(
        self,
        *,
        node: str | None = None,
        hw_class: str | None = None,
        kind: SweepKind | str | None = None,
        verdict: Verdict | str | Iterable[Verdict | str] | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[SweepRecord]:
        """Sweeps by creation time, oldest first (the newest `limit` when given).

        e.g. class baselines: sweeps(hw_class="h100", kind="1node", verdict="pass", limit=50).
        """
        ref = aliased(Node)
        q = (
            select(Sweep, Node.name, ref.name)
            .join(Node, Node.id == Sweep.node_id)
            .outerjoin(ref, ref.id == Sweep.reference_node_id)
        )
        if node is not None:
            q = q.where(Node.name == node)
        if hw_class is not None:
            q = q.where(Sweep.hw_class == hw_class)
        if kind is not None:
            q = q.where(Sweep.kind == _enum(SweepKind, kind, "sweep kind").value)
        if verdict is not None:
            vs = [verdict] if isinstance(verdict, str) else list(verdict)
            q = q.where(
                Sweep.verdict.in_(
                    [_enum(Verdict, v, "sweep verdict").value for v in vs]
                )
            )
        if since is not None:
            q = q.where(Sweep.created_at >= to_utc(since, "since"))
        with self._tx() as s:
            rows = _newest(s, q, (Sweep.created_at, Sweep.id), limit, scalars=False)
            return [_sweep_rec(r, n, rn) for r, n, rn in rows]

    def _sweep_rec(self, s: Session, row: Sweep) -> SweepRecord:
        name = s.get_one(Node, row.node_id).name
        ref = (
            s.get_one(Node, row.reference_node_id).name
            if row.reference_node_id
            else None
        )
        return _sweep_rec(row, name, ref)

    # ------------------------------------------------------------ triage
    def add_triage_action(
        self,
        node: str,
        rung: TriageRung | str,
        *,
        is_entry: bool = False,
        status: ActionStatus | str = ActionStatus.PLANNED,
        detail: str | None = None,
        evidence: dict[str, Any] | None = None,
        at: Timestamp | None = None,
    ) -> TriageActionRecord:
        """Record a rung of the triage ladder for `node`.

        is_entry=True marks the action that opens a triage episode; Guard 6's
        "three entries within seven days -> replace" counts those
        (recent_triage_entries).
        """
        r = _enum(TriageRung, rung, "triage rung")
        st = _enum(ActionStatus, status, "triage status")
        when = self._at(at)
        with self._tx() as s:
            node_id = self._node_row(s, node).id
            row = TriageAction(
                node_id=node_id,
                rung=r.value,
                at=when,
                is_entry=bool(is_entry),
                status=st.value,
                finished_at=when if st in _FINISHED_ACTIONS else None,
                detail=detail,
                evidence=_evidence(evidence, "evidence"),
            )
            s.add(row)
            s.flush()
            return _triage_rec(row, node)

    def update_triage_action(
        self,
        action_id: int,
        *,
        status: ActionStatus | str,
        detail: str | None = None,
        evidence: dict[str, Any] | None = None,
        at: Timestamp | None = None,
    ) -> TriageActionRecord:
        """Set the status; a finished status (done/failed/skipped) stamps finished_at. Evidence is merged."""
        st = _enum(ActionStatus, status, "triage status")
        with self._tx() as s:
            row = _get(s, TriageAction, action_id, "triage action")
            row.status = st.value
            if st in _FINISHED_ACTIONS:
                row.finished_at = self._at(at)
            if detail is not None:
                row.detail = detail
            if evidence is not None:
                row.evidence = {**row.evidence, **_evidence(evidence, "evidence")}
            s.flush()
            return _triage_rec(row, s.get_one(Node, row.node_id).name)

    def triage_actions(
        self,
        node: str | None = None,
        *,
        since: Timestamp | None = None,
        status: ActionStatus | str | None = None,
    ) -> list[TriageActionRecord]:
        """Triage actions, oldest first."""
        q = select(TriageAction, Node.name).join(Node, Node.id == TriageAction.node_id)
        if node is not None:
            q = q.where(Node.name == node)
        if since is not None:
            q = q.where(TriageAction.at >= to_utc(since, "since"))
        if status is not None:
            q = q.where(
                TriageAction.status
                == _enum(ActionStatus, status, "triage status").value
            )
        with self._tx() as s:
            rows = s.execute(q.order_by(TriageAction.at, TriageAction.id)).all()
            return [_triage_rec(t, name) for t, name in rows]

    def recent_triage_entries(
        self, node: str, since: Timestamp
    ) -> list[TriageActionRecord]:
        """Actions that opened a triage episode for `node` at or after `since`, oldest first."""
        return [a for a in self.triage_actions(node, since=since) if a.is_entry]

    # ------------------------------------------------------------ helpers
    def _node_row(self, s: Session, name: str) -> Node:
        row = s.scalar(select(Node).where(Node.name == name))
        if row is None:
            raise NodeNotRegistered(f"node {name}: not registered in the database")
        return row


class _NodeIds:
    """Resolve node names to ids once per transaction."""

    def __init__(self, s: Session) -> None:
        self._s = s
        self._cache: dict[str, tuple[int, str | None]] = {}

    def _get(self, name: str) -> tuple[int, str | None]:
        if name not in self._cache:
            row = self._s.execute(
                select(Node.id, Node.hw_class).where(Node.name == name)
            ).first()
            if row is None:
                raise NodeNotRegistered(f"node {name}: not registered in the database")
            self._cache[name] = (row[0], row[1])
        return self._cache[name]

    def __getitem__(self, name: str) -> int:
        return self._get(name)[0]

    def hw_class(self, name: str) -> str | None:
        return self._get(name)[1]


# ---------------------------------------------------------------- validation
def _check_name(name: str) -> str:
    if not is_node_name(name):
        raise InvalidValue(f"invalid node name {name!r} ({NODE_NAME_RULE})")
    return name


def _check_cause(cause: str) -> str:
    cause = (cause or "").strip()
    if not cause:
        raise InvalidValue("a transition needs a cause (short text)")
    if len(cause) > CAUSE_MAX:
        raise InvalidValue(
            f"transition cause longer than {CAUSE_MAX} characters; put details in evidence"
        )
    return cause


def _check_actor(actor: str) -> str:
    return _short(actor, 64, "actor")


def _short(value: str, n: int, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue(f"{what} must be a non-empty string")
    if len(value) > n:
        raise InvalidValue(f"{what} '{value[:40]}...' is longer than {n} characters")
    return value


def _job(job_id: str | int) -> str:
    return _short(str(job_id), 64, "job id")


def _opt_str(v: str | int | None) -> str | None:
    return None if v is None else _job(v)


def _float(v: float | None) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise InvalidValue(f"expected a number, got {v!r}") from None
    # NaN is "not measured": store NULL, which every backend compares sanely.
    return f if math.isfinite(f) else None


def _partitions(parts: Sequence[str]) -> tuple[str, ...]:
    if isinstance(parts, str):
        parts = [p for p in parts.split(",") if p]
    out = tuple(str(p) for p in parts)
    for p in out:
        _short(p, 64, "partition name")
    return out


def _argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, str):
        raise InvalidValue("argv must be a list of arguments, not one string")
    out = list(argv)
    for a in out:
        if not isinstance(a, str):
            raise InvalidValue(f"argv element {a!r} is not a string")
    return out


def _evidence(ev: dict[str, Any] | None, what: str) -> dict[str, Any]:
    if ev is None:
        return {}
    if not isinstance(ev, dict):
        raise InvalidValue(
            f"{what} must be a JSON object (dict), got {type(ev).__name__}"
        )
    return jsonable(ev, what)


def _enum(cls: type[E], value: Any, what: str) -> E:
    try:
        return cls(value)  # type: ignore[call-arg]
    except ValueError:
        allowed = ", ".join(e.value for e in cls)  # type: ignore[attr-defined]
        raise InvalidValue(f"{what} '{value}' is not one of: {allowed}") from None


def _window(start: Timestamp, end: Timestamp, what: str) -> tuple[datetime, datetime]:
    a, b = to_utc(start, f"{what} window_start"), to_utc(end, f"{what} window_end")
    if b < a:
        raise InvalidValue(
            f"{what}: window ends ({b.isoformat()}) before it starts ({a.isoformat()})"
        )
    return a, b


def _get(s: Session, model: type[E], ident: int, what: str) -> E:
    row = s.get(model, ident)
    if row is None:
        raise NotFound(f"{what} {ident}: no such row")
    return row


def _newest(
    s: Session, q: Select, order: tuple, limit: int | None, *, scalars: bool = True
) -> list:
    """Rows of q oldest first; with limit, the newest `limit` of them (still oldest first)."""
    if limit is None:
        q = q.order_by(*order)
        return list(s.scalars(q)) if scalars else list(s.execute(q).all())
    if limit < 0:
        raise InvalidValue(f"limit must be >= 0, got {limit}")
    q = q.order_by(*(c.desc() for c in order)).limit(limit)
    rows = list(s.scalars(q)) if scalars else list(s.execute(q).all())
    rows.reverse()
    return rows


# ---------------------------------------------------------------- records
def _node_rec(r: Node) -> NodeRecord:
    return NodeRecord(
        id=r.id,
        name=r.name,
        hw_class=r.hw_class,
        state=NodeState(r.state),
        state_since=r.state_since,
        partitions=tuple(r.partitions or ()),
        last_seen=r.last_seen,
        created_at=r.created_at,
    )


def _transition_rec(t: NodeTransition, name: str) -> TransitionRecord:
    return TransitionRecord(
        id=t.id,
        node=name,
        at=t.at,
        from_state=None if t.from_state is None else NodeState(t.from_state),
        to_state=NodeState(t.to_state),
        cause=t.cause,
        evidence=dict(t.evidence),
        actor=t.actor,
        forced=bool(t.forced),
    )


def _audit_rec(r: AuditEntry) -> AuditRecord:
    return AuditRecord(
        id=r.id,
        at=r.at,
        actor=r.actor,
        action=r.action,
        node=r.node,
        job_id=r.job_id,
        reason=r.reason,
        argv=None if r.argv is None else tuple(r.argv),
        outcome=AuditOutcome(r.outcome),
        error=r.error,
        evidence=dict(r.evidence),
    )


def _incident_rec(r: Incident) -> IncidentRecord:
    return IncidentRecord(
        id=r.id,
        job_id=r.job_id,
        kind=r.kind,
        nodes=tuple(r.nodes),
        tier=IncidentTier(r.tier),
        slowdown=r.slowdown,
        onset_at=r.onset_at,
        detected_at=r.detected_at,
        action_at=r.action_at,
        detection_delay_s=r.detection_delay_s,
        status=IncidentStatus(r.status),
        outcome=r.outcome,
        evidence=dict(r.evidence),
        created_at=r.created_at,
        updated_at=r.updated_at,
    )


def _sweep_rec(r: Sweep, node: str, ref: str | None) -> SweepRecord:
    return SweepRecord(
        id=r.id,
        slurm_job_id=r.slurm_job_id,
        kind=SweepKind(r.kind),
        node=node,
        reference_node=ref,
        hw_class=r.hw_class,
        created_at=r.created_at,
        submitted_at=r.submitted_at,
        started_at=r.started_at,
        finished_at=r.finished_at,
        metrics=dict(r.metrics),
        verdict=Verdict(r.verdict),
        failure_reason=r.failure_reason,
    )


def _triage_rec(r: TriageAction, node: str) -> TriageActionRecord:
    return TriageActionRecord(
        id=r.id,
        node=node,
        rung=TriageRung(r.rung),
        at=r.at,
        is_entry=bool(r.is_entry),
        status=ActionStatus(r.status),
        finished_at=r.finished_at,
        detail=r.detail,
        evidence=dict(r.evidence),
    )
