"""Build the admin report: which nodes are out, why, since when, what was tried, what next.

`build_report` reads the database in bulk (report_data.FleetSnapshot), asks Slurm once
for the live view (optional: an unreachable slurmctld degrades the reason column to the
audit log's copy, it never fails the report), and returns typed records
(report_model.Report) that the terminal, JSON and HTML renderers format.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta

from slurmguard.config import Policy
from slurmguard.errors import InputError
from slurmguard.slurm import hostlist
from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.models import NodeInfo
from slurmguard.store import AuditOutcome, AuditRecord, NodeState, Store
from slurmguard.sweeps.records import sweep_reference_text
from slurmguard.sweeps.rungs import entries_in_window
from slurmguard.triage.report_data import FleetSnapshot, load_slurm_view
from slurmguard.triage.report_figures import fleet_figures
from slurmguard.triage.report_model import (
    STATE_ORDER,
    EvidenceStep,
    FleetSummary,
    NodeRow,
    Owner,
    ReasonSource,
    Report,
    ReportFilters,
    SlurmView,
)
from slurmguard.triage.report_next import recommend

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_STAGE_ORDER = {"detection": 0, "lifecycle": 1, "response": 2, "sweep": 3, "triage": 4}


# ---------------------------------------------------------------- filter parsing
def parse_duration(text: str, what: str = "--window") -> timedelta:
    """'90m', '24h', '7d', '2w', '30s' -> timedelta; InputError otherwise."""
    m = _DURATION.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"{what} '{text}': expected a positive duration like 30m, 24h, 7d or 2w")
    return timedelta(seconds=float(m.group(1)) * _UNIT_S[m.group(2).lower()])


def parse_since(text: str, now: datetime) -> datetime:
    """A duration back from `now` ('24h', '7d') or an ISO 8601 date/time (naive = UTC)."""
    if _DURATION.match(text or ""):
        return now - parse_duration(text, "--since")
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InputError(
            f"--since '{text}': expected a duration like 24h or 7d, or an ISO date/time "
            "such as 2024-05-01 or 2024-05-01T12:00:00Z"
        ) from None
    t = t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    if t > now:
        raise InputError(f"--since '{text}': is in the future ({t.isoformat()})")
    return t


def parse_states(values: Iterable[str]) -> tuple[NodeState, ...]:
    """Lifecycle state names (repeatable, or comma-separated) -> NodeState."""
    out: list[NodeState] = []
    for v in values:
        for part in (p.strip().lower() for p in v.split(",")):
            if not part:
                continue
            try:
                out.append(NodeState(part))
            except ValueError:
                names = ", ".join(s.value for s in NodeState)
                raise InputError(f"--state '{part}': unknown lifecycle state (one of: {names})") from None
    return tuple(dict.fromkeys(out))


def parse_nodes(values: Iterable[str]) -> tuple[str, ...]:
    """Node names or Slurm hostlists (node[1-4],gpu7), repeatable."""
    out: list[str] = []
    for v in values:
        try:
            out.extend(hostlist.expand(v))
        except ValueError as exc:
            raise InputError(f"--node '{v}': {exc}") from None
    return tuple(dict.fromkeys(out))


# ---------------------------------------------------------------- building
def build_report(
    store: Store,
    slurm: SlurmClient | Callable[[], SlurmClient] | None,
    policy: Policy,
    filters: ReportFilters,
    *,
    now: datetime | None = None,
    snapshot: FleetSnapshot | None = None,
) -> Report:
    """The report for `filters`. `slurm` is a SlurmClient, a callable returning one, or None.

    Raises InputError for a node or partition neither the database nor Slurm knows.
    """
    now = now or store.now()
    snap = snapshot or FleetSnapshot.load(store)
    view = load_slurm_view(slurm, offline=filters.offline or slurm is None)
    if slurm is None and not filters.offline:
        view = SlurmView(reachable=False, checked=False, error="no Slurm client")
    live = view.nodes

    partitions = sorted(
        {p for n in snap.nodes.values() for p in n.partitions}
        | {p for n in live.values() for p in n.partitions}
    )
    if filters.partition is not None and filters.partition not in partitions:
        known = ", ".join(partitions) or "none known"
        raise InputError(f"--partition '{filters.partition}': no such partition ({known})")
    for name in filters.nodes:
        if name not in snap.nodes and name not in live:
            where = "the slurmguard database" + (" or Slurm" if view.reachable else "")
            hint = "" if view.reachable else " (Slurm not reachable, so only the database was checked)"
            raise InputError(f"node {name}: not in {where}{hint}")

    def in_scope_parts(parts: Sequence[str]) -> bool:
        return filters.partition is None or filters.partition in parts

    scope_db = [n for n in snap.nodes.values() if in_scope_parts(n.partitions)]
    scope_live = [n for n in live.values() if in_scope_parts(n.partitions)]
    unregistered = [n for n in scope_live if n.name not in snap.nodes and n.drained_by_others]

    counts = {s.value: 0 for s in NodeState}
    for n in scope_db:
        counts[n.state.value] += 1
    summary = FleetSummary(
        total=len(scope_db),
        states=counts,
        not_healthy=len(scope_db) - counts[NodeState.HEALTHY.value],
        drained_by_slurmguard=sum(n.drained_by_us for n in scope_live) if view.reachable else None,
        drained_by_others=sum(n.drained_by_others for n in scope_live) if view.reachable else None,
        quarantined=counts[NodeState.QUARANTINED.value],
        terminal=counts[NodeState.TERMINAL.value],
        unregistered=len(unregistered),
    )
    figures = fleet_figures(snap, (n.name for n in scope_db), since=filters.since)

    wanted_nodes = set(filters.nodes)
    rows: list[NodeRow] = []
    for rec in scope_db:
        ln = live.get(rec.name)
        if wanted_nodes and rec.name not in wanted_nodes:
            continue
        if filters.states:
            if rec.state not in filters.states:
                continue
        elif (
            not wanted_nodes
            and rec.state is NodeState.HEALTHY
            and not (ln is not None and ln.drained_by_others)
        ):
            continue
        if filters.since is not None and rec.state_since < filters.since:
            continue
        rows.append(_row(rec.name, snap, view, policy, now))
    if not filters.states:
        for ln in unregistered:
            if wanted_nodes and ln.name not in wanted_nodes:
                continue
            if filters.since is not None and (
                ln.reason_time is None or ln.reason_time < filters.since.timestamp()
            ):
                continue
            rows.append(_row(ln.name, snap, view, policy, now))

    rank = {s: i for i, s in enumerate(STATE_ORDER)}
    # Ours first, worst state first, oldest first; nodes drained by others at the end.
    rows.sort(
        key=lambda r: (
            r.drained_by == "other" or r.state is None,
            rank.get(r.state, len(rank)) if r.state else len(rank),
            r.since or now,
            r.name,
        )
    )
    return Report(
        generated_at=now,
        filters=filters,
        slurm=view,
        summary=summary,
        figures=figures,
        rows=tuple(rows),
        partitions=tuple(partitions),
    )


def episode_start(snap: FleetSnapshot, name: str) -> datetime | None:
    """When the node last became healthy (or registered): its current episode starts after."""
    last = None
    for t in snap.transitions.get(name, ()):
        if t.to_state is NodeState.HEALTHY:
            last = t.at
    return last


def evidence_chain(snap: FleetSnapshot, name: str, start: datetime | None) -> list[EvidenceStep]:
    """Detection -> response -> sweeps -> triage for `name`, from `start` (None: all history)."""

    def keep(t: datetime | None) -> bool:
        return t is not None and (start is None or t >= start)

    steps: list[EvidenceStep] = []
    jobs: set[str] = set()
    for i in snap.incidents_by_node.get(name, ()):
        if not keep(i.detected_at):
            continue
        jobs.add(i.job_id)
        slow = "" if i.slowdown is None else f" {i.slowdown:+.0%}"
        steps.append(
            EvidenceStep(
                i.detected_at,
                "detection",
                f"{i.kind}{slow} in job {i.job_id}, tier {i.tier.value}, detected "
                f"{_dur(i.detection_delay_s)} after onset ({i.status.value})",
                f"incident {i.id}",
            )
        )
    for t in snap.transitions.get(name, ()):
        if not keep(t.at) or t.from_state is None:
            continue
        who = "" if t.actor == "slurmguard" else f" by {t.actor}"
        forced = " (forced)" if t.forced else ""
        steps.append(
            EvidenceStep(
                t.at,
                "lifecycle",
                f"{t.from_state.value} -> {t.to_state.value}{who}{forced}: {t.cause}",
                f"transition {t.id}",
            )
        )
    seen: set[int] = set()
    audit_rows = list(snap.audit.get(name, ()))
    for j in jobs:
        audit_rows.extend(a for a in snap.audit_by_job.get(j, ()) if a.node is None)
    for a in audit_rows:
        if a.id in seen or not keep(a.at):
            continue
        seen.add(a.id)
        target = f" job {a.job_id}" if a.job_id and not a.node else ""
        what = f": {a.reason}" if a.reason else ""
        out = (
            ""
            if a.outcome is AuditOutcome.OK
            else f" [{a.outcome.value}" + (f": {a.error}]" if a.error else "]")
        )
        steps.append(
            EvidenceStep(
                a.at,
                "response",
                f"{a.action}{target}{what}{out}",
                f"audit {a.id}",
                ok=False if a.outcome is AuditOutcome.ERROR else None,
            )
        )
    for s in snap.sweeps_by_node.get(name, ()):
        if not keep(s.created_at):
            continue
        job = f" (job {s.slurm_job_id})" if s.slurm_job_id else ""
        ref = f" with {s.reference_node}" if s.reference_node else ""
        why = f": {s.failure_reason}" if s.failure_reason else ""
        ok = {"pass": True, "fail": False, "error": False}.get(s.verdict.value)
        steps.append(
            EvidenceStep(
                s.created_at,
                "sweep",
                f"{s.kind.value} sweep{ref}{job}: {s.verdict.value}{why}" + sweep_reference_text(s.metrics),
                f"sweep {s.id}",
                ok=ok,
            )
        )
    for act in snap.triage.get(name, ()):
        if not keep(act.at):
            continue
        entry = " (triage entry)" if act.is_entry else ""
        detail = f": {act.detail}" if act.detail else ""
        steps.append(
            EvidenceStep(
                act.at,
                "triage",
                f"{act.rung.value} {act.status.value}{entry}{detail}",
                f"triage {act.id}",
                ok=False if act.status.value == "failed" else None,
            )
        )
    steps.sort(key=lambda e: (e.at, _STAGE_ORDER[e.stage], e.ref))
    return steps


def _row(name: str, snap: FleetSnapshot, view: SlurmView, policy: Policy, now: datetime) -> NodeRow:
    rec = snap.nodes.get(name)
    ln: NodeInfo | None = view.nodes.get(name)
    start = episode_start(snap, name) if rec is not None else None
    if rec is not None and rec.state is NodeState.HEALTHY:
        # In service: nothing is open; what led back here belongs to the closed episode.
        start = rec.state_since + timedelta(microseconds=1)
    steps = evidence_chain(snap, name, start) if rec is not None else []

    def in_ep(t: datetime) -> bool:
        return start is None or t >= start

    ep_sweeps = [s for s in snap.sweeps_by_node.get(name, ()) if in_ep(s.created_at)]
    all_triage = snap.triage.get(name, [])
    ep_triage = [a for a in all_triage if in_ep(a.at)]
    reason: str | None
    source: ReasonSource | None
    owner: Owner | None
    if ln is not None:
        reason, source, comment = ln.reason, "slurm", ln.comment
        owner = "slurmguard" if ln.drained_by_us else ("other" if ln.drained_by_others else None)
    else:
        reason, comment, owner = audit_reason(snap.audit.get(name, ()))
        source = "audit" if (reason or comment) else None
    incs = [
        i for i in snap.incidents_by_node.get(name, ()) if in_ep(i.detected_at) and i.slowdown is not None
    ]
    return NodeRow(
        name=name,
        state=rec.state if rec else None,
        since=rec.state_since
        if rec
        else (datetime.fromtimestamp(ln.reason_time, UTC) if ln and ln.reason_time else None),
        hw_class=rec.hw_class if rec else None,
        partitions=rec.partitions if rec else (ln.partitions if ln else ()),
        reason=reason,
        reason_source=source,
        comment=comment,
        slurm_state=ln.state_text if ln else None,
        drained_by=owner,
        reservations=tuple(view.reservations.get(name, ())),
        running_jobs=tuple(ln.jobs) if ln else (),
        evidence=tuple(steps),
        next_action=recommend(
            name,
            rec.state if rec else None,
            live=ln,
            slurm_reachable=view.reachable,
            episode_sweeps=ep_sweeps,
            episode_triage=ep_triage,
            all_triage=all_triage,
            now=now,
            policy=policy.triage,
        ),
        triage_entries=entries_in_window(all_triage, now, policy.triage),
        slowdown=incs[-1].slowdown if incs else None,
    )


def audit_reason(rows: Iterable[AuditRecord]) -> tuple[str | None, str | None, None]:
    """(reason, comment, owner) Slurm should hold, replayed from successful audited actions.

    A drain/reboot reason stands until a resume; a comment until clear_comment. The owner
    of a drain is unknown without Slurm (someone else may have drained it since).
    """
    reason = comment = None
    for a in rows:  # oldest first
        if a.outcome is not AuditOutcome.OK:
            continue
        if a.action in ("drain", "reboot"):
            reason = a.reason
        elif a.action == "resume":
            reason = None
        elif a.action == "comment":
            comment = a.reason
        elif a.action == "clear_comment":
            comment = None
    return reason, comment, None


def _dur(seconds: float | None) -> str:
    """Compact human duration: 45s, 12m, 3.5h, 2.0d."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


human_duration = _dur
