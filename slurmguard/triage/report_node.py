"""`slurmguard node show NODE` and `slurmguard incidents`: one node's whole history, and the
incident list with detection delay, tier, affected jobs and outcome."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from slurmguard.config import Policy
from slurmguard.errors import InputError
from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.models import NodeInfo
from slurmguard.store import (
    AuditRecord,
    IncidentRecord,
    IncidentStatus,
    NodeRecord,
    Store,
    SweepRecord,
    TransitionRecord,
    TriageActionRecord,
)
from slurmguard.sweeps.records import sweep_reference_text
from slurmguard.triage.report import episode_start, human_duration
from slurmguard.triage.report_data import FleetSnapshot, load_slurm_view
from slurmguard.triage.report_model import NextAction, SlurmView
from slurmguard.triage.report_next import recommend

_JOB_ACTIONS = ("requeue", "signal")


@dataclass(frozen=True)
class NodeHistory:
    name: str
    node: NodeRecord | None
    live: NodeInfo | None
    slurm: SlurmView
    transitions: list[TransitionRecord]
    audit: list[AuditRecord]
    incidents: list[IncidentRecord]
    sweeps: list[SweepRecord]
    triage: list[TriageActionRecord]
    next_action: NextAction


def node_history(
    store: Store,
    name: str,
    slurm: SlurmClient | Callable[[], SlurmClient] | None,
    policy: Policy,
    *,
    offline: bool = False,
    now: datetime | None = None,
) -> NodeHistory:
    """Everything recorded about `name`; InputError if neither the database nor Slurm knows it."""
    now = now or store.now()
    view = load_slurm_view(slurm, offline=offline or slurm is None)
    live = view.nodes.get(name)
    with store.atomic() as tx:
        rec = tx.get_node(name)
        if rec is None and live is None:
            where = " or Slurm" if view.reachable else ""
            raise InputError(f"node {name}: not in the slurmguard database{where}")
        trs = tx.node_history(name) if rec else []
        audit = tx.audit_entries(node=name)
        incs = tx.incidents(node=name)
        jobs = {i.job_id for i in incs}
        if jobs:
            audit += [a for a in tx.audit_entries(action=_JOB_ACTIONS) if a.job_id in jobs and a.node is None]
        sweeps = tx.sweeps(node=name) if rec else []
        triage = tx.triage_actions(name) if rec else []
    audit.sort(key=lambda a: (a.at, a.id))
    snap = FleetSnapshot(
        nodes={name: rec} if rec else {},
        transitions={name: trs},
        audit={},
        audit_by_job={},
        incidents=incs,
        incidents_by_node={},
        sweeps=sweeps,
        sweeps_by_node={},
        triage={},
    )
    start = episode_start(snap, name) if rec else None
    ep_sweeps = [s for s in sweeps if start is None or s.created_at >= start]
    ep_triage = [a for a in triage if start is None or a.at >= start]
    nxt = recommend(
        name,
        rec.state if rec else None,
        live=live,
        slurm_reachable=view.reachable,
        episode_sweeps=ep_sweeps,
        episode_triage=ep_triage,
        all_triage=triage,
        now=now,
        policy=policy.triage,
    )
    return NodeHistory(name, rec, live, view, trs, audit, incs, sweeps, triage, nxt)


def _t(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def history_dict(h: NodeHistory) -> dict[str, Any]:
    n, ln = h.node, h.live
    return {
        "schema_version": "1",
        "name": h.name,
        "state": n.state.value if n else None,
        "since": _t(n.state_since) if n else None,
        "hw_class": n.hw_class if n else None,
        "partitions": list(n.partitions) if n else (list(ln.partitions) if ln else []),
        "slurm": {
            "reachable": h.slurm.reachable,
            "error": h.slurm.error,
            "state": ln.state_text if ln else None,
            "reason": ln.reason if ln else None,
            "comment": ln.comment if ln else None,
            "jobs": list(ln.jobs) if ln else [],
            "drained_by_others": bool(ln and ln.drained_by_others),
        },
        "next_action": {"code": h.next_action.code, "text": h.next_action.text},
        "transitions": [
            {
                "id": t.id,
                "at": _t(t.at),
                "from": t.from_state.value if t.from_state else None,
                "to": t.to_state.value,
                "cause": t.cause,
                "actor": t.actor,
                "forced": t.forced,
                "evidence": t.evidence,
            }
            for t in h.transitions
        ],
        "actions": [
            {
                "id": a.id,
                "at": _t(a.at),
                "actor": a.actor,
                "action": a.action,
                "job_id": a.job_id,
                "reason": a.reason,
                "outcome": a.outcome.value,
                "error": a.error,
                "argv": list(a.argv) if a.argv else None,
            }
            for a in h.audit
        ],
        "incidents": [incident_dict(i) for i in h.incidents],
        "sweeps": [
            {
                "id": s.id,
                "kind": s.kind.value,
                "slurm_job_id": s.slurm_job_id,
                "reference_node": s.reference_node,
                "hw_class": s.hw_class,
                "created_at": _t(s.created_at),
                "started_at": _t(s.started_at),
                "finished_at": _t(s.finished_at),
                "verdict": s.verdict.value,
                "failure_reason": s.failure_reason,
                "metrics": s.metrics,
            }
            for s in h.sweeps
        ],
        "triage": [
            {
                "id": a.id,
                "rung": a.rung.value,
                "at": _t(a.at),
                "is_entry": a.is_entry,
                "status": a.status.value,
                "finished_at": _t(a.finished_at),
                "detail": a.detail,
            }
            for a in h.triage
        ],
    }


def _fmt(t: datetime | None) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%S")


def _metrics_text(m: dict[str, Any], limit: int = 8) -> str:
    from slurmguard.triage.report_data import flat_metrics

    flat = flat_metrics(m)
    items = [f"{k}={v:g}" for k, v in list(flat.items())[:limit]]
    more = f" (+{len(flat) - limit} more)" if len(flat) > limit else ""
    return ", ".join(items) + more if items else "-"


def render_history(h: NodeHistory, console: Console | None = None) -> None:
    c = console or Console(width=max(140, Console().width))
    n, ln = h.node, h.live
    state = n.state.value if n else "not in the slurmguard database"
    c.print(
        f"[bold]{h.name}[/bold]  state: [bold]{state}[/bold]"
        + (
            f" since {_fmt(n.state_since)}  class: {n.hw_class or '-'}  partitions: "
            f"{','.join(n.partitions) or '-'}"
            if n
            else ""
        )
    )
    if ln is not None:
        owner = " (drained by others)" if ln.drained_by_others else ""
        c.print(
            f"Slurm: {ln.state_text}{owner}  reason: {ln.reason or '-'}  comment: "
            f"{ln.comment or '-'}  jobs: {','.join(map(str, ln.jobs)) or '-'}"
        )
    elif h.slurm.reachable:
        c.print("Slurm: does not know this node")
    else:
        c.print(f"[yellow]Slurm not reachable ({h.slurm.error}); the database view only[/yellow]")
    c.print(f"Next: [bold]{h.next_action.text}[/bold]")

    def table(title: str, cols: tuple[str, ...], rows: list[tuple]) -> None:
        t = Table(title=f"{title} ({len(rows)})", title_justify="left")
        for col in cols:
            t.add_column(col, overflow="fold")
        for r in rows:
            t.add_row(*[str(x) for x in r])
        c.print(t)

    table(
        "Lifecycle",
        ("AT", "FROM", "TO", "CAUSE", "ACTOR"),
        [
            (
                _fmt(t.at),
                t.from_state.value if t.from_state else "(registered)",
                t.to_state.value,
                t.cause,
                t.actor + (" (forced)" if t.forced else ""),
            )
            for t in h.transitions
        ],
    )
    table(
        "Actions (audit log)",
        ("AT", "ACTION", "JOB", "REASON", "OUTCOME", "ACTOR"),
        [
            (
                _fmt(a.at),
                a.action,
                a.job_id or "-",
                a.reason or "-",
                a.outcome.value + (f": {a.error}" if a.error else ""),
                a.actor,
            )
            for a in h.audit
        ],
    )
    table(
        "Incidents",
        ("ID", "JOB", "TIER", "SLOWDOWN", "ONSET", "DELAY", "STATUS", "OUTCOME"),
        [
            (
                i.id,
                i.job_id,
                i.tier.value,
                "-" if i.slowdown is None else f"{i.slowdown:+.0%}",
                _fmt(i.onset_at),
                human_duration(i.detection_delay_s),
                i.status.value,
                i.outcome or "-",
            )
            for i in h.incidents
        ],
    )
    table(
        "Sweeps",
        ("ID", "KIND", "JOB", "REFERENCE", "CREATED", "FINISHED", "VERDICT", "METRICS"),
        [
            (
                s.id,
                s.kind.value,
                s.slurm_job_id or "-",
                s.reference_node or "-",
                _fmt(s.created_at),
                _fmt(s.finished_at),
                s.verdict.value
                + (f": {s.failure_reason}" if s.failure_reason else "")
                + sweep_reference_text(s.metrics),
                _metrics_text(s.metrics),
            )
            for s in h.sweeps
        ],
    )
    table(
        "Triage",
        ("ID", "AT", "RUNG", "STATUS", "ENTRY", "DETAIL"),
        [
            (a.id, _fmt(a.at), a.rung.value, a.status.value, "yes" if a.is_entry else "", a.detail or "-")
            for a in h.triage
        ],
    )


# ---------------------------------------------------------------- incidents
def affected_jobs(i: IncidentRecord) -> list[str]:
    """The incident's job plus any other jobs its evidence names (`affected_jobs`)."""
    extra = i.evidence.get("affected_jobs") or []
    out = [i.job_id] + [str(j) for j in extra if str(j) != i.job_id]
    return list(dict.fromkeys(out))


def incident_dict(i: IncidentRecord) -> dict[str, Any]:
    return {
        "id": i.id,
        "job_id": i.job_id,
        "affected_jobs": affected_jobs(i),
        "kind": i.kind,
        "nodes": list(i.nodes),
        "tier": i.tier.value,
        "slowdown": i.slowdown,
        "onset_at": _t(i.onset_at),
        "detected_at": _t(i.detected_at),
        "action_at": _t(i.action_at),
        "detection_delay_s": i.detection_delay_s,
        "action_delay_s": i.action_delay_s,
        "status": i.status.value,
        "outcome": i.outcome,
    }


def list_incidents(
    store: Store,
    *,
    since: datetime | None = None,
    status: str | None = None,
    node: str | None = None,
    job: str | None = None,
    limit: int | None = None,
) -> list[IncidentRecord]:
    if status is not None and status not in {s.value for s in IncidentStatus}:
        names = ", ".join(s.value for s in IncidentStatus)
        raise InputError(f"--status '{status}': unknown incident status (one of: {names})")
    if node is not None and store.get_node(node) is None:
        raise InputError(f"node {node}: not in the slurmguard database")
    return store.incidents(since=since, status=status, node=node, job_id=job, limit=limit)


def render_incidents(incs: list[IncidentRecord], console: Console | None = None) -> None:
    c = console or Console(width=max(140, Console().width))
    if not incs:
        c.print("No incidents match.")
        return
    t = Table(title=f"{len(incs)} incident(s)", title_justify="left")
    for col in (
        "ID",
        "DETECTED",
        "JOBS",
        "NODES",
        "KIND",
        "TIER",
        "SLOWDOWN",
        "DETECTION DELAY",
        "ACTION DELAY",
        "STATUS",
        "OUTCOME",
    ):
        t.add_column(col, overflow="fold")
    for i in incs:
        t.add_row(
            str(i.id),
            _fmt(i.detected_at),
            ",".join(affected_jobs(i)),
            ",".join(i.nodes),
            i.kind,
            i.tier.value,
            "-" if i.slowdown is None else f"{i.slowdown:+.0%}",
            human_duration(i.detection_delay_s),
            human_duration(i.action_delay_s),
            i.status.value,
            i.outcome or "-",
        )
    c.print(t)


def incidents_json(incs: list[IncidentRecord]) -> str:
    return json.dumps(
        {"schema_version": "1", "incidents": [incident_dict(i) for i in incs]}, indent=2, allow_nan=False
    )
