"""Everything the report needs, read in bulk: one query per table, never one per node.

A fleet of thousands of nodes must render in seconds, so the snapshot reads each
table once through the Store's fleet-wide methods and groups rows by node in memory.
The Slurm view is read the same way (one `nodes()` and one `reservations()` call) and
its absence is a fact to show, not an error.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

import click

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
from slurmguard.triage.report_model import SlurmView


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
    """Time series for the HTML charts, from `since` on."""

    step_times: dict[str, list[StepTimeRecord]] = field(default_factory=dict)
    """Per node."""
    step_times_by_job: dict[str, list[StepTimeRecord]] = field(default_factory=dict)
    telemetry: dict[str, list[TelemetrySummaryRecord]] = field(default_factory=dict)
    """Per node."""
    telemetry_by_job: dict[str, list[TelemetrySummaryRecord]] = field(default_factory=dict)

    @classmethod
    def load(cls, store: Store, since: datetime) -> SeriesSnapshot:
        with store.atomic() as tx:
            steps = tx.step_time_summaries(since=since)
            tele = tx.telemetry_summaries(since=since)
        return cls(
            step_times=_group(steps, lambda r: r.node),
            step_times_by_job=_group(steps, lambda r: r.job_id),
            telemetry=_group(tele, lambda r: r.node),
            telemetry_by_job=_group([t for t in tele if t.job_id], lambda r: r.job_id or ""),
        )


def _group(rows, key) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return dict(out)


def load_slurm_view(slurm, *, offline: bool = False) -> SlurmView:
    """The live node list and reservations; a Slurm that cannot be asked is reported, not raised.

    `slurm` may be a SlurmClient or a zero-argument callable returning one (building the
    client can itself fail, e.g. a backend not available in this build).
    """
    if offline:
        return SlurmView(reachable=False, checked=False, error="not asked (--offline)")
    try:
        client = slurm() if callable(slurm) and not hasattr(slurm, "nodes") else slurm
        nodes = {n.name: n for n in client.nodes()}
        try:
            resv = client.reservations()
        except SlurmguardError:
            resv = []
    except (SlurmguardError, OSError, click.ClickException) as exc:
        # ClickException: the CLI context could not build a client (unsupported backend).
        return SlurmView(reachable=False, checked=True, error=_one_line(exc))
    by_node: dict[str, list[str]] = defaultdict(list)
    for r in resv:
        for n in r.nodes:
            by_node[n].append(r.name)
    return SlurmView(reachable=True, checked=True, nodes=nodes,
                     reservations={k: sorted(v) for k, v in by_node.items()})


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
