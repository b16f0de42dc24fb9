"""Nodes and their lifecycle: registration, state transitions (each with its
transition row, in one transaction) and the transition history."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from slurmguard.store.checks import (
    DEFAULT_ACTOR,
    check_actor,
    check_name,
    json_object,
    partition_names,
)
from slurmguard.store.core import StoreCore
from slurmguard.store.errors import InvalidValue, StaleState
from slurmguard.store.lifecycle import (
    INITIAL_STATE,
    NodeState,
    check_transition,
    parse_state,
)
from slurmguard.store.models import Node, NodeTransition
from slurmguard.store.query import Query
from slurmguard.store.records import NodeRecord, TransitionRecord, from_row
from slurmguard.store.types import Timestamp

CAUSE_MAX = 256
"""Longest transition cause, characters; details belong in the evidence."""

_REGISTERED = "registered"


class NodeStore(StoreCore):
    """The nodes table and the node_transitions log."""

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
        check_name(name)
        parts = partition_names(partitions) if partitions is not None else None
        with self._tx() as s:
            row = s.scalar(select(Node).where(Node.name == name))
            if row is None:
                when = self._at(at)
                row = _new_node(name, hw_class, parts or (), when)
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
                    s.add(_registration(row, when))
            if hw_class is not None and row.hw_class != hw_class:
                row.hw_class = hw_class
            if parts is not None and tuple(row.partitions) != parts:
                row.partitions = list(parts)
            s.flush()
            return from_row(NodeRecord, row)

    def register_nodes(self, nodes: Mapping[str, Sequence[str]], at: Timestamp | None = None) -> int:
        """Register every node of `nodes` (name -> partitions) the database does not
        know yet, and set the partitions of those it knows (Slurm's view wins), in
        one transaction, however many nodes; returns how many were new."""
        for name in nodes:
            check_name(name)
        when = self._at(at)
        with self._tx() as s:
            have = (
                {r.name: r for r in s.scalars(select(Node).where(Node.name.in_(list(nodes))))}
                if len(nodes) <= 500
                else {r.name: r for r in s.scalars(select(Node))}
            )
            fresh: dict[str, list[str]] = {}
            for name, parts in nodes.items():
                p = partition_names(parts)
                row = have.get(name)
                if row is None:
                    fresh[name] = list(p)
                elif list(row.partitions) != list(p):
                    row.partitions = list(p)
            if fresh:
                # bulk inserts, not ORM objects: a controller's first cycle registers the
                # whole fleet, and 10,000 nodes with their transition rows took 1.5 s as
                # objects (issue 17: a cycle within 1 s)
                ids = s.scalars(
                    insert(Node).returning(Node.id),
                    [_new_node_row(n, None, p, when) for n, p in fresh.items()],
                ).all()
                s.execute(insert(NodeTransition), [_registration_row(node_id, when) for node_id in ids])
        return len(fresh)

    def node_counts(self) -> dict[str, int]:
        """Nodes per lifecycle state (one aggregate query)."""
        with self._tx(read=True) as s:
            return {
                str(st): int(n) for st, n in s.execute(select(Node.state, func.count()).group_by(Node.state))
            }

    def get_node(self, name: str) -> NodeRecord | None:
        with self._tx(read=True) as s:
            row = s.scalar(select(Node).where(Node.name == name))
            return None if row is None else from_row(NodeRecord, row)

    def list_nodes(
        self,
        state: NodeState | str | Iterable[NodeState | str] | None = None,
        *,
        hw_class: str | None = None,
        partition: str | None = None,
    ) -> list[NodeRecord]:
        """Nodes by name, optionally only those in `state` (one or several), class or partition."""
        q = Query(Node, order=(Node.name,)).among(Node.state, state, _state_value).eq(Node.hw_class, hw_class)
        rows = self._records(q, NodeRecord, read=True)
        # JSON containment differs per backend; the fleet is small enough to filter here.
        return rows if partition is None else [r for r in rows if partition in r.partitions]

    def mark_seen(self, names: Iterable[str], at: Timestamp | None = None) -> int:
        """Set last_seen of existing nodes; returns how many rows changed."""
        names = list(names)
        if not names:
            return 0
        with self._tx() as s:
            # DML returns a CursorResult (with rowcount); Session.execute is typed for SELECT
            res = cast(
                CursorResult[Any],
                s.execute(update(Node).where(Node.name.in_(names)).values(last_seen=self._at(at))),
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
        ev = json_object(evidence, "evidence")
        with self._tx() as s:
            row = self._node_row(s, node)
            frm = NodeState(row.state)
            if expect_from is not None and frm != parse_state(expect_from):
                raise StaleState(
                    f"node {node}: expected state {parse_state(expect_from).value}, found {frm.value}"
                )
            check_transition(node, frm, to, force=force)
            when = self._at(at)
            # Compare-and-set: a concurrent writer that moved the node first wins,
            # and this call fails instead of overwriting its transition.
            res = cast(
                CursorResult[Any],
                s.execute(
                    update(Node)
                    .where(Node.id == row.id, Node.state == frm.value)
                    .values(state=to.value, state_since=when)
                    .execution_options(synchronize_session=False)
                ),
            )
            if res.rowcount != 1:
                raise StaleState(f"node {node}: state changed concurrently (was {frm.value})")
            tr = NodeTransition(
                node_id=row.id,
                at=when,
                from_state=frm.value,
                to_state=to.value,
                cause=cause,
                evidence=ev,
                actor=check_actor(actor),
                forced=bool(force),
            )
            s.add(tr)
            s.flush()
            s.expire(row)
            return from_row(TransitionRecord, tr, node=node)

    def node_history(self, name: str, *, since: Timestamp | None = None) -> list[TransitionRecord]:
        """Transitions of a node, oldest first (the first is its registration)."""
        with self._tx() as s:
            row = self._node_row(s, name)
            q = (
                Query(NodeTransition, order=(NodeTransition.at, NodeTransition.id))
                .eq(NodeTransition.node_id, row.id)
                .since(NodeTransition.at, since)
            )
            return q.records(s, TransitionRecord, node=name)

    def transitions(
        self,
        *,
        since: Timestamp | None = None,
        to_state: NodeState | str | None = None,
        limit: int | None = None,
    ) -> list[TransitionRecord]:
        """Fleet-wide transitions, oldest first (the newest `limit` when given)."""
        q = (
            Query.named(NodeTransition, order=(NodeTransition.at, NodeTransition.id))
            .since(NodeTransition.at, since)
            .eq(NodeTransition.to_state, to_state, _state_value)
        )
        return self._records(q, TransitionRecord, limit)


def _new_node_row(name: str, hw_class: str | None, parts: Sequence[str], when: datetime) -> dict[str, Any]:
    """The columns of a node just registered."""
    return {
        "name": name,
        "hw_class": hw_class,
        "state": INITIAL_STATE.value,
        "state_since": when,
        "partitions": list(parts),
        "last_seen": None,
        "created_at": when,
    }


def _new_node(name: str, hw_class: str | None, parts: Sequence[str], when: datetime) -> Node:
    return Node(**_new_node_row(name, hw_class, parts, when))


def _registration_row(node_id: int, when: datetime) -> dict[str, Any]:
    """The columns of the first transition row of a node just registered (from_state None)."""
    return {
        "node_id": node_id,
        "at": when,
        "from_state": None,
        "to_state": INITIAL_STATE.value,
        "cause": _REGISTERED,
        "evidence": {},
        "actor": DEFAULT_ACTOR,
        "forced": False,
    }


def _registration(row: Node, when: datetime) -> NodeTransition:
    return NodeTransition(**_registration_row(row.id, when))


def _state_value(state: NodeState | str) -> str:
    return parse_state(state).value


def _check_cause(cause: str) -> str:
    cause = (cause or "").strip()
    if not cause:
        raise InvalidValue("a transition needs a cause (short text)")
    if len(cause) > CAUSE_MAX:
        raise InvalidValue(f"transition cause longer than {CAUSE_MAX} characters; put details in evidence")
    return cause
