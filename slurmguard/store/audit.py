"""The audit log: one append-only row per Slurm action taken, failed, or only
logged (dry_run); the controller lease's epochs are audit rows too."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from slurmguard.store.checks import (
    DEFAULT_ACTOR,
    arg_list,
    check_actor,
    json_object,
    member,
    opt_job,
    value_of,
)
from slurmguard.store.core import StoreCore
from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import AuditEntry, AuditOutcome
from slurmguard.store.query import Query
from slurmguard.store.records import AuditRecord, from_row
from slurmguard.store.types import Timestamp

ACTION_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
"""An audit action: lower_snake_case, at most 32 characters."""


class AuditLog(StoreCore):
    """The audit_log table."""

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
            raise InvalidValue(f"audit action '{action}': use lower_snake_case, at most 32 characters")
        out = member(AuditOutcome, outcome, "audit outcome")
        if out is AuditOutcome.ERROR and not error:
            raise InvalidValue(f"audit {action}: outcome 'error' needs the error text")
        args = None if argv is None else arg_list(argv)
        row = AuditEntry(
            at=self._at(at),
            actor=check_actor(actor),
            action=action,
            node=node,
            job_id=opt_job(job_id),
            reason=reason,
            argv=args,
            outcome=out.value,
            error=error,
            evidence=json_object(evidence, "evidence"),
        )
        with self._tx() as s:
            s.add(row)
            s.flush()
            return from_row(AuditRecord, row)

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
        q = (
            Query(AuditEntry, order=(AuditEntry.at, AuditEntry.id))
            .eq(AuditEntry.node, node)
            .among(AuditEntry.action, action)
            .eq(AuditEntry.outcome, outcome, value_of(AuditOutcome, "audit outcome"))
            .since(AuditEntry.at, since)
            .until(AuditEntry.at, until)
        )
        return self._records(q, AuditRecord, limit, read=True)
