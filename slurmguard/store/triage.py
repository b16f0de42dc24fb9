"""Triage actions: the rungs of the ladder (re-sweep, reboot, reimage, terminal)
taken for a node that failed its sweep, and the episode entries Guard 6 counts."""

from __future__ import annotations

from typing import Any

from slurmguard.store.checks import get_row, json_object, member, value_of
from slurmguard.store.core import StoreCore
from slurmguard.store.models import ActionStatus, Node, TriageAction, TriageRung
from slurmguard.store.query import Query
from slurmguard.store.records import TriageActionRecord, from_row
from slurmguard.store.types import Timestamp

_FINISHED_ACTIONS = frozenset({ActionStatus.DONE, ActionStatus.FAILED, ActionStatus.SKIPPED})


class TriageStore(StoreCore):
    """The triage_actions table."""

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
        r = member(TriageRung, rung, "triage rung")
        st = member(ActionStatus, status, "triage status")
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
                evidence=json_object(evidence, "evidence"),
            )
            s.add(row)
            s.flush()
            return from_row(TriageActionRecord, row, node=node)

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
        st = member(ActionStatus, status, "triage status")
        with self._tx() as s:
            row = get_row(s, TriageAction, action_id, "triage action")
            row.status = st.value
            if st in _FINISHED_ACTIONS:
                row.finished_at = self._at(at)
            if detail is not None:
                row.detail = detail
            if evidence is not None:
                row.evidence = {**row.evidence, **json_object(evidence, "evidence")}
            s.flush()
            return from_row(TriageActionRecord, row, node=s.get_one(Node, row.node_id).name)

    def triage_actions(
        self,
        node: str | None = None,
        *,
        since: Timestamp | None = None,
        status: ActionStatus | str | None = None,
    ) -> list[TriageActionRecord]:
        """Triage actions, oldest first."""
        q = (
            Query.named(TriageAction, order=(TriageAction.at, TriageAction.id))
            .eq(Node.name, node)
            .since(TriageAction.at, since)
            .eq(TriageAction.status, status, value_of(ActionStatus, "triage status"))
        )
        return self._records(q, TriageActionRecord)

    def recent_triage_entries(self, node: str, since: Timestamp) -> list[TriageActionRecord]:
        """Actions that opened a triage episode for `node` at or after `since`, oldest first."""
        return [a for a in self.triage_actions(node, since=since) if a.is_entry]
