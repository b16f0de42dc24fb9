"""What every part of the Store shares: the engine, the clock, the transactions, and
the lookup of a node row by name.

Every public Store method is one transaction (a lifecycle change and its transition
row commit together or not at all); `with store.atomic() as tx:` groups several
calls into one. Times default to the injected Clock, never to the database server's
clock, so FakeClock tests and replays are exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime
from typing import Self, TypeVar

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from slurmguard.clock import Clock, SystemClock
from slurmguard.store import db
from slurmguard.store.errors import NodeNotRegistered
from slurmguard.store.models import Node
from slurmguard.store.query import Query
from slurmguard.store.types import Timestamp, to_utc

R = TypeVar("R")


class StoreCore:
    """The connection, clock and transactions under every aggregate's methods.

    Build a Store with `Store.open(url, clock)` (checks the schema is migrated) or
    `Store(engine, clock)`; the clock defaults to the system clock.
    """

    def __init__(self, engine: Engine, clock: Clock | None = None) -> None:
        self.engine = engine
        self.clock: Clock = clock or SystemClock()
        self._sessions: sessionmaker[Session] = db.session_factory(engine)
        self._reads: sessionmaker[Session] = db.session_factory(db.reading(engine))
        self._bound: Session | None = None

    @classmethod
    def open(cls, url: str, clock: Clock | None = None, *, check_schema: bool = True) -> Self:
        """Connect to `url`; SchemaNotCurrent unless it is at the newest migration."""
        engine = db.make_engine(url)
        if check_schema:
            try:
                db.require_current(engine)
            except BaseException:
                engine.dispose()
                raise
        return cls(engine, clock)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ transactions
    @contextlib.contextmanager
    def atomic(self) -> Iterator[Self]:
        """A Store view whose calls share one transaction, committed at the end of the block."""
        if self._bound is not None:
            yield self
            return
        view = type(self).__new__(type(self))
        view.engine, view.clock, view._sessions, view._reads = (
            self.engine,
            self.clock,
            self._sessions,
            self._reads,
        )
        with db.translate_errors(self.engine.url), self._sessions.begin() as session:
            view._bound = session
            try:
                yield view
            finally:
                view._bound = None

    @contextlib.contextmanager
    def _tx(self, read: bool = False) -> Iterator[Session]:
        """A transaction; read=True: one that only reads (on SQLite it does not take
        the write lock, so reads never queue behind a writer or block one)."""
        if self._bound is not None:
            yield self._bound
            return
        factory = self._reads if read else self._sessions
        with db.translate_errors(self.engine.url), factory.begin() as session:
            yield session

    def now(self) -> datetime:
        """The injected clock's time as an aware UTC datetime."""
        return to_utc(self.clock.now())

    def _at(self, at: Timestamp | None, what: str = "at") -> datetime:
        return self.now() if at is None else to_utc(at, what)

    def _records(self, q: Query, cls: type[R], limit: int | None = None, *, read: bool = False) -> list[R]:
        """The records `cls` of q's rows (Query.records), read in one transaction
        (read=True: a read-only one)."""
        with self._tx(read=read) as s:
            return q.records(s, cls, limit)

    def _node_row(self, s: Session, name: str) -> Node:
        row = s.scalar(select(Node).where(Node.name == name))
        if row is None:
            raise _not_registered(name)
        return row


class NodeIds:
    """Resolve node names to ids once per transaction (NodeNotRegistered if unknown)."""

    def __init__(self, s: Session) -> None:
        self._s = s
        self._cache: dict[str, tuple[int, str | None]] = {}

    def _get(self, name: str) -> tuple[int, str | None]:
        if name not in self._cache:
            row = self._s.execute(select(Node.id, Node.hw_class).where(Node.name == name)).first()
            if row is None:
                raise _not_registered(name)
            self._cache[name] = (row[0], row[1])
        return self._cache[name]

    def __getitem__(self, name: str) -> int:
        return self._get(name)[0]

    def hw_class(self, name: str) -> str | None:
        return self._get(name)[1]


def _not_registered(name: str) -> NodeNotRegistered:
    return NodeNotRegistered(f"node {name}: not registered in the database")
