"""Engine set-up, URL handling and the lifecycle table."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from slurmguard.store import ALLOWED, NodeState, StoreError, db
from slurmguard.store.lifecycle import check_transition
from slurmguard.store.types import jsonable, to_utc


def test_sqlite_engine_creates_parent_dir_and_sets_pragmas(tmp_path):
    path = tmp_path / "a" / "b" / "sg.db"
    engine = db.make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30_000
    finally:
        engine.dispose()
    assert path.exists()


def test_sqlite_foreign_keys_are_enforced(tmp_path):
    url = f"sqlite:///{tmp_path / 'fk.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with pytest.raises(Exception, match="FOREIGN KEY"), engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO triage_actions (node_id, rung, at, is_entry, status, evidence) "
                    "VALUES (42, 'reboot', '2024-01-01 00:00:00', 0, 'planned', '{}')"
                )
            )
    finally:
        engine.dispose()


def test_check_constraints_guard_enum_columns(db_url):
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        with (
            pytest.raises(Exception, match="(?i)check constraint"),
            engine.begin() as conn,
        ):
            conn.execute(
                text(
                    "INSERT INTO nodes (name, state, state_since, partitions, created_at) "
                    "VALUES ('n1', 'broken', '2024-01-01 00:00:00+00', '[]', '2024-01-01 00:00:00+00')"
                )
            )
    finally:
        engine.dispose()


def test_url_parsing_and_masking():
    assert db.parse_url("postgresql://u:p@h/d").drivername == "postgresql+psycopg"
    assert db.parse_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert db.mask_url("postgresql+psycopg://u:s3cret@h:5432/d") == "postgresql+psycopg://u:***@h:5432/d"
    assert db.mask_url("sqlite:////var/lib/x.db") == "sqlite:////var/lib/x.db"
    for bad, msg in [
        ("", "empty database URL"),
        ("oracle://x", "unsupported database URL scheme"),
        ("sqlite+aiosqlite:///x", "unsupported SQLite driver"),
    ]:
        with pytest.raises(StoreError, match=msg):
            db.parse_url(bad)


def test_every_state_can_reach_healthy_or_terminal_and_terminal_is_closed():
    assert ALLOWED[NodeState.TERMINAL] == frozenset()
    for start in NodeState:
        seen, todo = {start}, [start]
        while todo:
            for nxt in ALLOWED[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        if start is not NodeState.TERMINAL:
            assert NodeState.HEALTHY in seen and NodeState.TERMINAL in seen, start
    # The sweep gate: only a quarantined (swept) or merely suspect node returns to healthy.
    assert {s for s in NodeState if NodeState.HEALTHY in ALLOWED[s]} == {
        NodeState.SUSPECT,
        NodeState.QUARANTINED,
    }
    check_transition("n", NodeState.TERMINAL, NodeState.HEALTHY, force=True)


def test_time_and_json_conversions():
    assert to_utc(0).isoformat() == "1970-01-01T00:00:00+00:00"
    with pytest.raises(StoreError, match="finite"):
        to_utc(float("inf"))
    with pytest.raises(StoreError, match="keys must be strings"):
        jsonable({(1, 2): 3})
    assert jsonable({1: [float("-inf")]}) == {"1": [None]}


def test_in_memory_sqlite_cannot_be_upgraded_by_url():
    with pytest.raises(StoreError, match="in-memory SQLite"):
        db.upgrade("sqlite://")
