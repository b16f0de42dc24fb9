"""The one query builder of the Store's listing methods.

Every listing reads the same way: rows of one table (with the node's name joined in
where the table refers to a node), narrowed by optional filters where None means
"any", read oldest first, or the newest `limit` of them, still oldest first, and
turned into records:

    q = (
        Query.named(Sweep, order=(Sweep.created_at, Sweep.id))
        .eq(Node.name, node)
        .eq(Sweep.kind, kind, value_of(SweepKind, "sweep kind"))
        .since(Sweep.created_at, since)
    )
    return self._records(q, SweepRecord, limit)   # StoreCore: one transaction

The filters only add WHERE clauses; they never touch the session, so a bad value is
refused before a transaction starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import Node
from slurmguard.store.records import from_row
from slurmguard.store.types import Timestamp, to_utc

R = TypeVar("R")


class Query:
    """A SELECT of `model`'s rows read in `order` (the columns that sort oldest first,
    a unique one last so equal times keep one order on every backend)."""

    def __init__(self, model: Any, *, order: Sequence[Any]) -> None:
        self.stmt: Select[Any] = select(model)
        self.order = tuple(order)
        self._fields: list[str] = []
        """Record fields of the columns joined in, in select order after the model."""

    @classmethod
    def named(cls, model: Any, *, order: Sequence[Any]) -> Query:
        """Rows of `model` with the name of their node (model.node_id joined to the
        nodes table) as the record's `node`; filter by node with eq(Node.name, ...)."""
        return cls(model, order=order).join(Node, Node.id == model.node_id, columns={"node": Node.name})

    def join(
        self,
        target: Any,
        on: Any,
        *,
        outer: bool = False,
        columns: dict[str, Any] | None = None,
    ) -> Query:
        """Join `target` on `on` (outer: keep rows without a match, its columns NULL);
        `columns` (record field -> column of target) are read with each row."""
        for field, column in (columns or {}).items():
            self.stmt = self.stmt.add_columns(column)
            self._fields.append(field)
        self.stmt = self.stmt.join(target, on, isouter=outer)
        return self

    def eq(self, column: Any, value: Any, parse: Callable[[Any], Any] | None = None) -> Query:
        """column == parse(value); nothing when value is None."""
        if value is not None:
            self.stmt = self.stmt.where(column == (value if parse is None else parse(value)))
        return self

    def among(
        self,
        column: Any,
        values: Any | Iterable[Any] | None,
        parse: Callable[[Any], Any] | None = None,
    ) -> Query:
        """column IN the values (one string counts as one value), each through parse;
        nothing when values is None."""
        if values is not None:
            vs = [values] if isinstance(values, str) else list(values)
            self.stmt = self.stmt.where(column.in_(vs if parse is None else [parse(v) for v in vs]))
        return self

    def unset(self, column: Any) -> Query:
        """column IS NULL."""
        self.stmt = self.stmt.where(column.is_(None))
        return self

    def since(self, column: Any, ts: Timestamp | None) -> Query:
        """column >= ts (epoch seconds or an aware datetime; inclusive); nothing when None."""
        if ts is not None:
            self.stmt = self.stmt.where(column >= to_utc(ts, "since"))
        return self

    def until(self, column: Any, ts: Timestamp | None) -> Query:
        """column < ts (exclusive); nothing when None."""
        if ts is not None:
            self.stmt = self.stmt.where(column < to_utc(ts, "until"))
        return self

    def rows(self, s: Session, limit: int | None = None) -> list[Any]:
        """The model's rows oldest first (tuples (row, *joined columns) when columns
        were joined in); with `limit`, the newest `limit` of them (still oldest
        first). InvalidValue for a negative limit."""
        if limit is None:
            return self._read(s, self.stmt.order_by(*self.order))
        if limit < 0:
            raise InvalidValue(f"limit must be >= 0, got {limit}")
        rows = self._read(s, self.stmt.order_by(*(c.desc() for c in self.order)).limit(limit))
        rows.reverse()
        return rows

    def records(self, s: Session, cls: type[R], limit: int | None = None, **given: Any) -> list[R]:
        """rows() as records `cls` (records.from_row), the joined columns and
        `given` filling the fields the table lacks."""
        if not self._fields:
            return [from_row(cls, r, **given) for r in self.rows(s, limit)]
        return [
            from_row(cls, r[0], **dict(zip(self._fields, r[1:], strict=True)), **given)
            for r in self.rows(s, limit)
        ]

    def _read(self, s: Session, stmt: Select[Any]) -> list[Any]:
        if self._fields:
            return list(s.execute(stmt).all())
        return list(s.scalars(stmt))
