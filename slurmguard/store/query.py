"""The one query builder of the Store's listing methods.

Every listing reads the same way: rows of one table (with the node's name joined in
where the table refers to a node), narrowed by optional filters where None means
"any", read oldest first, or the newest `limit` of them, still oldest first:

    q = (Query.named(Sweep, order=(Sweep.created_at, Sweep.id))
         .eq(Node.name, node)
         .eq(Sweep.kind, kind, parse)
         .since(Sweep.created_at, since))
    with self._tx(read=True) as s:
        rows = q.rows(s, limit)

The filters only add WHERE clauses; they never touch the session, so a bad value is
refused before a transaction starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import Node
from slurmguard.store.types import Timestamp, to_utc


class Query:
    """A SELECT of `columns` read in `order` (the columns that sort oldest first,
    a unique one last so equal times keep one order on every backend)."""

    def __init__(self, *columns: Any, order: Sequence[Any]) -> None:
        self.stmt: Select = select(*columns)
        self.order = tuple(order)
        # one entity: rows are its objects; several: rows are tuples of them
        self._scalars = len(columns) == 1

    @classmethod
    def named(cls, model: Any, *, order: Sequence[Any]) -> Query:
        """Rows of `model` with the name of their node (model.node_id joined to the
        nodes table): each row is (object, name); filter by node with eq(Node.name, ...)."""
        return cls(model, Node.name, order=order).join(Node, Node.id == model.node_id)

    def join(self, target: Any, on: Any, *, outer: bool = False,
             columns: Sequence[Any] = ()) -> Query:
        """Join `target` on `on` (outer: keep rows without a match, its columns NULL);
        `columns` of it are appended to each row."""
        if columns:
            self.stmt = self.stmt.add_columns(*columns)
            self._scalars = False
        self.stmt = self.stmt.join(target, on, isouter=outer)
        return self

    def eq(self, column: Any, value: Any, parse: Callable[[Any], Any] | None = None) -> Query:
        """column == parse(value); nothing when value is None."""
        if value is not None:
            self.stmt = self.stmt.where(column == (value if parse is None else parse(value)))
        return self

    def among(self, column: Any, values: Any | Iterable[Any] | None,
              parse: Callable[[Any], Any] | None = None) -> Query:
        """column IN the values (one string counts as one value), each through parse;
        nothing when values is None."""
        if values is not None:
            vs = [values] if isinstance(values, str) else list(values)
            self.stmt = self.stmt.where(column.in_(vs if parse is None else [parse(v) for v in vs]))
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
        """The rows oldest first; with `limit`, the newest `limit` of them (still oldest
        first). InvalidValue for a negative limit."""
        if limit is None:
            return self._read(s, self.stmt.order_by(*self.order))
        if limit < 0:
            raise InvalidValue(f"limit must be >= 0, got {limit}")
        rows = self._read(s, self.stmt.order_by(*(c.desc() for c in self.order)).limit(limit))
        rows.reverse()
        return rows

    def _read(self, s: Session, stmt: Select) -> list[Any]:
        return list(s.scalars(stmt)) if self._scalars else list(s.execute(stmt).all())
