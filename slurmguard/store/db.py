"""Engines, sessions and migrations.

The schema is created and changed only by the Alembic scripts in
sql/migrations (never metadata.create_all): `upgrade(url)` is what
`slurmguard db upgrade` runs, and the daemons refuse a database whose revision
is not the head (`require_current`).

Supported URLs: sqlite:///PATH (the default; the parent directory is created)
and postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB (plain postgresql:// is
taken to mean psycopg 3, the driver slurmguard ships with).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.orm import Session, sessionmaker

from slurmguard import datafiles
from slurmguard.store.errors import (
    DatabaseUnavailable,
    MigrationsMissing,
    SchemaNotCurrent,
    StoreError,
)
from slurmguard.store.types import dumps

MIGRATIONS_ENV = "SLURMGUARD_MIGRATIONS"
"""Environment variable naming the Alembic script directory (default: the shipped sql/migrations)."""

SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long an SQLite writer waits for another writer's lock, seconds.

The controller, the CLI and a report may write at once; WAL lets readers go on,
and this keeps a short overlap of writers from failing with 'database is locked'.
"""

PG_CONNECT_TIMEOUT_S = 10
"""Seconds before an unreachable PostgreSQL server is reported."""


# ---------------------------------------------------------------- URLs
def parse_url(url: str | URL) -> URL:
    """A validated SQLAlchemy URL for SQLite or PostgreSQL (psycopg 3).

    Raises StoreError with a one-line message for anything else.
    """
    if isinstance(url, URL):
        u = url
    else:
        if not url or not str(url).strip():
            raise StoreError("empty database URL (set database.url, $SLURMGUARD_DB or --db)")
        try:
            u = make_url(str(url).strip())
        except ArgumentError:
            raise StoreError(
                f"bad database URL '{_mask_text(str(url))}' (expected sqlite:///PATH or "
                "postgresql+psycopg://USER@HOST/DB)"
            ) from None
    backend, _, driver = u.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise StoreError(f"unsupported SQLite driver '{driver}' in database URL (use sqlite:///PATH)")
        return u
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise StoreError(
                f"unsupported PostgreSQL driver '{driver}' in database URL "
                "(use postgresql+psycopg://USER@HOST/DB)"
            )
        return u.set(drivername="postgresql+psycopg")
    raise StoreError(
        f"unsupported database URL scheme '{u.drivername}' in '{mask_url(u)}' "
        "(use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB)"
    )


def mask_url(url: str | URL) -> str:
    """The URL with its password replaced by ***, safe to print or log."""
    try:
        u = url if isinstance(url, URL) else make_url(str(url))
    except ArgumentError:
        return _mask_text(str(url))
    return u.render_as_string(hide_password=True)


def _mask_text(text: str) -> str:
    # For strings SQLAlchemy cannot parse: hide anything between ':' and '@'.
    scheme, sep, rest = text.partition("://")
    if sep and "@" in rest:
        creds, _, host = rest.rpartition("@")
        if ":" in creds:
            creds = creds.split(":", 1)[0] + ":***"
        return f"{scheme}://{creds}@{host}"
    return text


def sqlite_path(url: URL) -> Path | None:
    """The file of an SQLite URL, or None for an in-memory database."""
    db = url.database
    if not db or db == ":memory:" or db.startswith("file::memory:"):
        return None
    return Path(db)


# ---------------------------------------------------------------- engines
def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An Engine for `url`; for SQLite: parent directory created, foreign keys on, WAL, busy timeout."""
    u = parse_url(url)
    if u.get_backend_name() == "sqlite":
        path = sqlite_path(u)
        if path is not None:
            try:
                path.expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create the directory of SQLite database {path}: {exc.strerror or exc}"
                ) from None
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S}
        engine = create_engine(u, json_serializer=dumps, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    try:
        return create_engine(
            u,
            json_serializer=dumps,
            pool_pre_ping=True,
            connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S},
            **kwargs,
        )
    except NoSuchModuleError:  # pragma: no cover - psycopg is a dependency
        raise StoreError(
            "PostgreSQL driver psycopg is not installed (pip install 'psycopg[binary]')"
        ) from None


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Take transaction control away from the sqlite3 module, which only opens
    # a transaction at the first INSERT/UPDATE (so reads before it are not
    # isolated) and mishandles SAVEPOINT; _sqlite_begin issues BEGIN instead.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    try:
        # SQLite ignores foreign keys unless asked, per connection.
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        # WAL: readers (reports, /metrics) never block the controller's writes.
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


READ_ONLY = "slurmguard_read_only"
"""Execution option of the engine `reading` returns."""


def reading(engine: Engine) -> Engine:
    """The engine for transactions that only read: on SQLite they BEGIN DEFERRED
    (a snapshot under WAL, no write lock); on PostgreSQL nothing changes."""
    return engine.execution_options(**{READ_ONLY: True})


def _sqlite_begin(conn: Any) -> None:
    # IMMEDIATE takes the write lock up front: concurrent writers queue on the
    # busy timeout instead of failing with SQLITE_BUSY when a read snapshot
    # has to be upgraded, and a read-check-write (a lifecycle transition)
    # sees the state it changes. Transactions that only read (`reading`) take
    # a WAL snapshot instead, so a control cycle's reads neither wait for nor
    # hold the write lock.
    if conn.get_execution_options().get(READ_ONLY):
        conn.exec_driver_sql("BEGIN")
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded values after commit (records are built from them)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def translate_errors(url: str | URL) -> Iterator[None]:
    """Turn driver-level connection failures into one-line DatabaseUnavailable errors."""
    try:
        yield
    except (OperationalError, DBAPIError) as exc:
        if isinstance(exc, OperationalError) or exc.connection_invalidated:
            raise DatabaseUnavailable(f"cannot use database {mask_url(url)}: {_first_line(exc)}") from None
        raise


def _first_line(exc: DBAPIError) -> str:
    text = str(exc.orig) if exc.orig is not None else str(exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc.orig or exc).__name__


# ---------------------------------------------------------------- migrations
def migrations_dir() -> Path:
    """The Alembic script directory: $SLURMGUARD_MIGRATIONS or the shipped sql/migrations."""
    env = os.environ.get(MIGRATIONS_ENV)
    path = Path(env) if env else datafiles.migrations_dir()
    if not (path / "env.py").is_file() or not (path / "versions").is_dir():
        raise MigrationsMissing(
            f"database migrations not found at {path} (expected env.py and versions/ there; "
            f"reinstall slurmguard with its package data or set ${MIGRATIONS_ENV})"
        )
    return path


def alembic_config(connection: Any | None = None) -> Any:
    """An Alembic Config for sql/migrations; `connection` is handed to env.py."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision in sql/migrations."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise MigrationsMissing(f"no migration scripts in {migrations_dir() / 'versions'}")
    return head


def _current(connection: Any) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def upgrade(url: str | URL, revision: str = "head") -> str | None:
    """Create or migrate the database at `url` to `revision`; returns the new revision.

    Running it again on a current database changes nothing.
    """
    return _run_alembic(url, "upgrade", revision)


def downgrade(url: str | URL, revision: str) -> str | None:
    """Migrate down to `revision` ('base' drops every table); returns the new revision."""
    return _run_alembic(url, "downgrade", revision)


def current(url: str | URL) -> str | None:
    """The database's Alembic revision, or None for an empty (never upgraded) database.

    Never creates anything: a missing SQLite file is reported as None.
    """
    u = parse_url(url)
    if u.get_backend_name() == "sqlite":
        path = sqlite_path(u)
        if path is not None and not path.expanduser().exists():
            return None
    engine = make_engine(u)
    try:
        with translate_errors(url), engine.connect() as conn:
            return _current(conn)
    finally:
        engine.dispose()


def _run_alembic(url: str | URL, verb: str, revision: str) -> str | None:
    from alembic import command
    from alembic.util import CommandError

    migrations_dir()  # clear error before touching the database
    u = parse_url(url)
    if u.get_backend_name() == "sqlite" and sqlite_path(u) is None:
        raise StoreError(
            "an in-memory SQLite database vanishes with its connection and cannot be "
            "migrated by URL; use sqlite:///PATH"
        )
    engine = make_engine(u)
    try:
        with translate_errors(url), engine.begin() as conn:
            cfg = alembic_config(conn)
            try:
                getattr(command, verb)(cfg, revision)
            except CommandError as exc:
                raise StoreError(f"{verb} of {mask_url(url)} to '{revision}' failed: {exc}") from None
            return _current(conn)
    finally:
        engine.dispose()


def require_current(engine: Engine) -> str:
    """The revision, or SchemaNotCurrent telling the user to run `slurmguard db upgrade`."""
    head = head_revision()
    with translate_errors(engine.url), engine.connect() as conn:
        rev = _current(conn)
    if rev != head:
        state = "empty (never upgraded)" if rev is None else f"at revision {rev}"
        raise SchemaNotCurrent(
            f"database {mask_url(engine.url)} is {state}; this slurmguard needs revision {head}: "
            "run `slurmguard db upgrade`"
        )
    return rev
