"""Everything the report needs, read in bulk: one query per table, never one per node.

A fleet of thousands of nodes must render in seconds, so the snapshot reads each
table once through the Store's fleet-wide methods and groups rows by node in memory.
The Slurm view is read the same way (one `nodes()` and one `reservations()` call) and
its absence is a fact to show, not an error.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

from slurmguard.errors import SlurmguardError
from slurmguard.store import (
    AuditRecord,
    IncidentRecord,
    NodeRecord,
    StepTimeRecord,
    Store,
    SweepRecord,
    TelemetrySummaryRecord,
    TransitionRecord,
    TriageActionRecord,
)
from slurmguard.store.types import to_utc
from slurmguard.triage.report_model import SlurmView

if TYPE_CHECKING:
    from slurmguard.slurm.client import SlurmClient

R = TypeVar("R")
K = TypeVar("K")


@dataclass
class FleetSnapshot:
    """The database's view of the fleet at one moment, grouped by node."""

    nodes: dict[str, NodeRecord]
    transitions: dict[str, list[TransitionRecord]]
    audit: dict[str, list[AuditRecord]]
    """Per node; rows without a node (requeue, signal) are in `audit_by_job`."""
    audit_by_job: dict[str, list[AuditRecord]]
    incidents: list[IncidentRecord]
    incidents_by_node: dict[str, list[IncidentRecord]]
    sweeps: list[SweepRecord]
    sweeps_by_node: dict[str, list[SweepRecord]]
    triage: dict[str, list[TriageActionRecord]]

    @classmethod
    def load(cls, store: Store) -> FleetSnapshot:
        # One transaction: the tables agree with each other.
        with store.atomic() as tx:
            nodes = tx.list_nodes()
            transitions = tx.transitions()
            audit = tx.audit_entries()
            incidents = tx.incidents()
            sweeps = tx.sweeps()
            triage = tx.triage_actions()
        by_node_audit: dict[str, list[AuditRecord]] = defaultdict(list)
        by_job_audit: dict[str, list[AuditRecord]] = defaultdict(list)
        for a in audit:
            if a.node:
                by_node_audit[a.node].append(a)
            if a.job_id:
                by_job_audit[a.job_id].append(a)
        inc_by_node: dict[str, list[IncidentRecord]] = defaultdict(list)
        for i in incidents:
            for n in i.nodes:
                inc_by_node[n].append(i)
        return cls(
            nodes={n.name: n for n in nodes},
            transitions=_group(transitions, lambda t: t.node),
            audit=dict(by_node_audit),
            audit_by_job=dict(by_job_audit),
            incidents=incidents,
            incidents_by_node=dict(inc_by_node),
            sweeps=sweeps,
            sweeps_by_node=_group(sweeps, lambda s: s.node),
            triage=_group(triage, lambda a: a.node),
        )


@dataclass
class SeriesSnapshot:
    """Time series for the HTML charts, from `since` on.

    `newest_slowdown` covers every node (the fleet heatmap); the full series only the
    `nodes` asked for and the other nodes of their jobs (the peer bands), so a fleet of
    thousands costs one narrow query for the heatmap plus the detailed nodes' jobs.
    """

    step_times: dict[str, list[StepTimeRecord]] = field(default_factory=dict)
    """Per node."""
    step_times_by_job: dict[str, list[StepTimeRecord]] = field(default_factory=dict)
    telemetry: dict[str, list[TelemetrySummaryRecord]] = field(default_factory=dict)
    """Per node."""
    telemetry_by_job: dict[str, list[TelemetrySummaryRecord]] = field(default_factory=dict)
    newest_slowdown: dict[str, float] = field(default_factory=dict)
    """Node -> slowdown (fraction) of its newest step-time window (max over jobs then)."""

    @classmethod
    def load(
        cls,
        store: Store,
        since: datetime,
        nodes: Iterable[str] | None = None,
        *,
        prefer_jobs: dict[str, set[str]] | None = None,
        jobs_per_node: int = 2,
        max_peer_nodes: int = 64,
    ) -> SeriesSnapshot:
        """Series from `since`: full rows of `nodes` (None: every node and job).

        For each node only its `jobs_per_node` chart jobs (those in `prefer_jobs[node]`
        first, then the newest) bring their other nodes' rows, and only jobs of at most
        `max_peer_nodes` nodes: a peer band over thousands of ranks is one query too many
        for a report, and the agent's stored peer median stands in for it.
        """
        # Read-only column selects on the tables: the Store's row-at-a-time records are
        # too slow for fleet-wide windows, and it has no "these nodes' jobs" filter.
        from sqlalchemy import func, select

        from slurmguard.store.models import Node, StepTimeSummary, TelemetrySummary

        ST, TS = StepTimeSummary, TelemetrySummary
        step_cols = (
            Node.name,
            ST.job_id,
            ST.step,
            ST.rank,
            ST.window_start,
            ST.window_end,
            ST.iterations,
            ST.mean_step_s,
            ST.baseline_step_s,
            ST.slowdown,
            ST.id,
        )
        tele_cols = (
            Node.name,
            TS.signal,
            TS.window_start,
            TS.window_end,
            TS.value,
            TS.unit,
            TS.peer_median,
            TS.robust_z,
            TS.deviating,
            TS.job_id,
            TS.id,
        )
        since = to_utc(since, "since")
        wanted = None if nodes is None else sorted(set(nodes))
        prefer = prefer_jobs or {}
        out = cls()
        with store.engine.connect() as conn:
            newest: dict[str, tuple[datetime, float]] = {}
            q = (
                select(Node.name, ST.window_end, ST.slowdown, ST.mean_step_s, ST.baseline_step_s)
                .join(Node, Node.id == ST.node_id)
                .where(ST.window_end >= since)
            )
            for name, end, slow, mean, base in conn.execute(q):
                if slow is None:
                    slow = mean / base - 1.0 if base else None
                if slow is None:
                    continue
                cur = newest.get(name)
                if cur is None or end > cur[0] or (end == cur[0] and slow > cur[1]):
                    newest[name] = (end, slow)
            out.newest_slowdown = {n: v for n, (_, v) in newest.items()}
            if wanted == []:
                return out
            step_rows: list[Any] = []  # Rows of step_cols
            tele_rows: list[Any] = []  # Rows of tele_cols
            for model, cols, sink, per_node in (
                (ST, step_cols, step_rows, jobs_per_node),
                (TS, tele_cols, tele_rows, 1),
            ):
                base_q = select(*cols).join(Node, Node.id == model.node_id).where(model.window_end >= since)
                if wanted is None:
                    sink.extend(conn.execute(base_q))
                    continue
                # 1. which jobs each wanted node has in the window, and when each ended
                last: dict[str, dict[str | None, datetime]] = defaultdict(dict)
                for chunk in _chunks(wanted):
                    jobs_q = (
                        select(Node.name, model.job_id, func.max(model.window_end))
                        .join(Node, Node.id == model.node_id)
                        .where(model.window_end >= since, Node.name.in_(chunk))
                        .group_by(Node.name, model.job_id)
                    )
                    for name, job, end in conn.execute(jobs_q):
                        last[name][job] = end
                jobs: set[str] = set()
                own_null: list[str] = []
                for name, by_job in last.items():
                    if None in by_job:
                        own_null.append(name)
                    pref = prefer.get(name, set())
                    order = sorted(
                        (j for j in by_job if j is not None),
                        key=lambda j: (j not in pref, -_aware(by_job[j]).timestamp()),
                    )
                    jobs.update(order[:per_node])
                # 2. job sizes: small jobs bring every node's rows (the peer band)
                small: set[str] = set()
                for chunk in _chunks(sorted(jobs)):
                    sizes = (
                        select(model.job_id, func.count(func.distinct(model.node_id)))
                        .where(model.job_id.in_(chunk), model.window_end >= since)
                        .group_by(model.job_id)
                    )
                    # job_id IN (chunk): never NULL here
                    small.update(j for j, n in conn.execute(sizes) if j is not None and n <= max_peer_nodes)
                for chunk in _chunks(sorted(small)):
                    sink.extend(conn.execute(base_q.where(model.job_id.in_(chunk))))
                # 3. large jobs: only the wanted nodes' own rows; rows with no job too
                big = sorted(jobs - small)
                for jchunk in _chunks(big):
                    for nchunk in _chunks(wanted):
                        sink.extend(
                            conn.execute(base_q.where(model.job_id.in_(jchunk), Node.name.in_(nchunk)))
                        )
                for chunk in _chunks(own_null):
                    sink.extend(conn.execute(base_q.where(model.job_id.is_(None), Node.name.in_(chunk))))
        steps = [
            StepTimeRecord(
                job_id=r.job_id,
                step=r.step,
                node=r.name,
                rank=r.rank,
                window_start=_aware(r.window_start),
                window_end=_aware(r.window_end),
                iterations=r.iterations,
                mean_step_s=r.mean_step_s,
                baseline_step_s=r.baseline_step_s,
                slowdown=r.slowdown,
                id=r.id,
            )
            for r in sorted(step_rows, key=lambda r: (r.window_end, r.id))
        ]
        tele = [
            TelemetrySummaryRecord(
                node=r.name,
                signal=r.signal,
                window_start=_aware(r.window_start),
                window_end=_aware(r.window_end),
                value=r.value,
                unit=r.unit,
                peer_median=r.peer_median,
                robust_z=r.robust_z,
                deviating=bool(r.deviating),
                job_id=r.job_id,
                id=r.id,
            )
            for r in sorted(tele_rows, key=lambda r: (r.window_end, r.id))
        ]
        out.step_times = _group(steps, lambda r: r.node)
        out.step_times_by_job = _group(steps, lambda r: r.job_id)
        out.telemetry = _group(tele, lambda r: r.node)
        out.telemetry_by_job = _group([t for t in tele if t.job_id], lambda r: r.job_id or "")
        return out


def _chunks(items: list[str], n: int = 500) -> Iterable[list[str]]:
    # Bounded IN lists: SQLite limits bound parameters per statement.
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _aware(t: datetime) -> datetime:
    """UTCDateTime already returns aware UTC; keep naive values (if any) in UTC too."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _group(rows: Iterable[R], key: Callable[[R], K]) -> dict[K, list[R]]:
    out: defaultdict[K, list[R]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return dict(out)


def load_slurm_view(
    slurm: SlurmClient | Callable[[], SlurmClient] | None, *, offline: bool = False
) -> SlurmView:
    """The live node list and reservations; a Slurm that cannot be asked is reported, not raised.

    `slurm` may be a SlurmClient or a zero-argument callable returning one (building the
    client can itself fail, e.g. a backend not available in this build).
    """
    if offline:
        return SlurmView(reachable=False, checked=False, error="not asked (--offline)")
    try:
        # callers pass None only with offline set
        client = cast("SlurmClient", slurm() if callable(slurm) and not hasattr(slurm, "nodes") else slurm)
        nodes = {n.name: n for n in client.nodes()}
        try:
            resv = client.reservations()
        except SlurmguardError:
            resv = []
    except (SlurmguardError, OSError) as exc:  # ConfigError: no client for this backend
        return SlurmView(reachable=False, checked=True, error=_one_line(exc))
    by_node: dict[str, list[str]] = defaultdict(list)
    for r in resv:
        for n in r.nodes:
            by_node[n].append(r.name)
    return SlurmView(
        reachable=True, checked=True, nodes=nodes, reservations={k: sorted(v) for k, v in by_node.items()}
    )


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a sweep's metrics, keys joined with '/'.

    Accepts the flat form (`{"gemm_bfloat16/gpu0": 700.0}`) and nested forms; a top-level
    "metrics" object, when present, is what is judged.
    """
    if not prefix and isinstance(metrics.get("metrics"), Mapping):
        metrics = metrics["metrics"]
    out: dict[str, float] = {}
    for k, v in metrics.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, Mapping):
            out.update(flat_metrics(v, key))
    return out
