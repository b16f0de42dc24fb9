"""Alembic environment of slurmguard.

slurmguard runs migrations programmatically (slurmguard.store.db.upgrade) and
hands over an open connection in config.attributes['connection']. For the
`alembic` command line (`alembic -c sql/alembic.ini ...`) the URL comes from
-x db=URL, then $SLURMGUARD_DB.
"""

from __future__ import annotations

import os
from typing import Any

from alembic import context
from sqlalchemy import Connection

from slurmguard.store.models import Base

target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("db") or os.environ.get("SLURMGUARD_DB")
    if not url:
        raise SystemExit("no database URL: pass -x db=URL or set SLURMGUARD_DB")
    return url


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        **kwargs,
    )


def run_offline() -> None:
    from slurmguard.store.db import parse_url

    _configure(url=parse_url(_url()), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from slurmguard.store.db import make_engine

    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table.
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
