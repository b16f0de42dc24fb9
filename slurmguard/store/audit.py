"""The audit log: one append-only row per Slurm action taken, failed, or only
logged (dry_run); the controller lease's epochs are audit rows too.

Action intents are its write-ahead side: `open_intent` before a Slurm call,
`close_intent` after it writes the action's audit row and closes the intent in
one transaction, and closes each intent once (a second closer, a fenced old
leader finishing late, gets None and writes nothing), so an action has exactly
one audit row whoever records it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import update

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
from slurmguard.store.models import ActionIntent, AuditEntry, AuditOutcome
from slurmguard.store.query import Query
from slurmguard.store.records import AuditRecord, IntentRecord, from_row
from slurmguard.store.types import Timestamp

ACTION_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
"""An audit action: lower_snake_case, at most 32 characters."""


class AuditLog(StoreCore):
    """The audit_log table."""

    def _action_fields(
        self,
        what: str,
        action: str,
        actor: str,
        node: str | None,
        job_id: str | None,
        reason: str | None,
        argv: Sequence[str] | None,
        evidence: dict[str, Any] | None,
        at: Timestamp | None,
    ) -> dict[str, Any]:
        """The checked columns an audit row and an action intent share."""
        if not ACTION_RE.match(action or ""):
            raise InvalidValue(f"{what} action '{action}': use lower_snake_case, at most 32 characters")
        return {
            "at": self._at(at),
            "actor": check_actor(actor),
            "action": action,
            "node": node,
            "job_id": opt_job(job_id),
            "reason": reason,
            "argv": None if argv is None else arg_list(argv),
            "evidence": json_object(evidence, "evidence"),
        }

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
        fields = self._action_fields("audit", action, actor, node, job_id, reason, argv, evidence, at)
        out = member(AuditOutcome, outcome, "audit outcome")
        if out is AuditOutcome.ERROR and not error:
            raise InvalidValue(f"audit {action}: outcome 'error' needs the error text")
        row = AuditEntry(**fields, outcome=out.value, error=error)
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

    # ------------------------------------------------------------ intents
    def open_intent(
        self,
        action: str,
        *,
        actor: str = DEFAULT_ACTOR,
        node: str | None = None,
        job_id: str | None = None,
        reason: str | None = None,
        argv: Sequence[str] | None = None,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
        at: Timestamp | None = None,
    ) -> IntentRecord:
        """Record a Slurm action about to be taken (committed before the call)."""
        fields = self._action_fields("intent", action, actor, node, job_id, reason, argv, evidence, at)
        row = ActionIntent(
            **fields, effects=[json_object(e, "effect") for e in effects], closed_at=None, audit_id=None
        )
        with self._tx() as s:
            s.add(row)
            s.flush()
            return from_row(IntentRecord, row)

    def close_intent(
        self,
        intent: IntentRecord,
        *,
        outcome: AuditOutcome | str,
        error: str | None = None,
        reason: str | None = None,
        evidence: dict[str, Any] | None = None,
        at: Timestamp | None = None,
    ) -> AuditRecord | None:
        """Close `intent` with its audit row (its fields; `reason` replaces its reason,
        `evidence` is added to its evidence; `at` defaults to now); None, writing
        nothing, when it was closed already."""
        with self.atomic() as tx:
            with tx._tx() as s:
                closed = s.execute(
                    update(ActionIntent)
                    .where(ActionIntent.id == intent.id, ActionIntent.closed_at.is_(None))
                    .values(closed_at=self.now())
                )
                if closed.rowcount != 1:  # type: ignore[attr-defined]
                    return None
            rec = tx.audit(
                intent.action,
                actor=intent.actor,
                node=intent.node,
                job_id=intent.job_id,
                reason=intent.reason if reason is None else reason,
                argv=intent.argv,
                outcome=outcome,
                error=error,
                evidence={**intent.evidence, **(evidence or {})},
                at=at,
            )
            with tx._tx() as s:
                s.execute(update(ActionIntent).where(ActionIntent.id == intent.id).values(audit_id=rec.id))
            return rec

    def open_intents(self) -> list[IntentRecord]:
        """Intents not closed yet, oldest first."""
        q = Query(ActionIntent, order=(ActionIntent.at, ActionIntent.id)).unset(ActionIntent.closed_at)
        return self._records(q, IntentRecord, read=True)
