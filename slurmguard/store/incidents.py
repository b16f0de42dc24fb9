"""Incidents: a detected slowdown, stall or error of one job, its tier, status and
the nodes its cause was localised to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slurmguard.store.checks import (
    check_name,
    get_row,
    job,
    json_object,
    member,
    number,
    short,
    value_of,
)
from slurmguard.store.core import StoreCore
from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import Incident, IncidentStatus, IncidentTier
from slurmguard.store.query import Query
from slurmguard.store.records import IncidentRecord, from_row
from slurmguard.store.types import Timestamp, to_utc

_LIVE = (IncidentStatus.OPEN, IncidentStatus.MITIGATED, IncidentStatus.SUPPRESSED)
"""The statuses of an incident not closed yet."""


class IncidentStore(StoreCore):
    """The incidents table."""

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
        """Record a detected incident; detection_delay_s = detected_at - onset_at (>= 0).

        detected_at defaults to now (the injected clock); slowdown is a fraction."""
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
            job_id=job(job_id),
            kind=short(kind, 32, "incident kind"),
            nodes=[check_name(n) for n in nodes],
            tier=member(IncidentTier, tier, "incident tier").value,
            slowdown=number(slowdown),
            onset_at=onset,
            detected_at=detected,
            action_at=None if action_at is None else to_utc(action_at, "action_at"),
            detection_delay_s=delay,
            status=member(IncidentStatus, status, "incident status").value,
            outcome=None,
            evidence=json_object(evidence, "evidence"),
            created_at=now,
            updated_at=now,
        )
        with self._tx() as s:
            s.add(row)
            s.flush()
            return from_row(IncidentRecord, row)

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
            row = get_row(s, Incident, incident_id, "incident")
            if status is not None:
                row.status = member(IncidentStatus, status, "incident status").value
            if tier is not None:
                row.tier = member(IncidentTier, tier, "incident tier").value
            if action_at is not None:
                row.action_at = to_utc(action_at, "action_at")
            if outcome is not None:
                row.outcome = outcome
            if nodes is not None:
                row.nodes = [check_name(n) for n in nodes]
            if evidence is not None:
                row.evidence = {**row.evidence, **json_object(evidence, "evidence")}
            row.updated_at = self.now()
            s.flush()
            return from_row(IncidentRecord, row)

    def get_incident(self, incident_id: int) -> IncidentRecord:
        with self._tx() as s:
            return from_row(IncidentRecord, get_row(s, Incident, incident_id, "incident"))

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
        q = (
            Query(Incident, order=(Incident.detected_at, Incident.id))
            .since(Incident.detected_at, since)
            .eq(Incident.status, status, value_of(IncidentStatus, "incident status"))
            .eq(Incident.job_id, job_id, str)
        )
        rows = self._records(q, IncidentRecord, None if node else limit, read=True)
        if node is not None:
            # the nodes are a JSON list, matched here the same way on every backend
            rows = [r for r in rows if node in r.nodes]
            rows = rows[-limit:] if limit else rows
        return rows

    def live_incidents(self) -> list[IncidentRecord]:
        """Every incident not closed yet (open, mitigated or suppressed), oldest
        first: what a control cycle reads once for all its jobs."""
        q = Query(Incident, order=(Incident.detected_at, Incident.id)).among(
            Incident.status, [st.value for st in _LIVE]
        )
        return self._records(q, IncidentRecord, read=True)
