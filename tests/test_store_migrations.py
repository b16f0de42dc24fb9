"""Migrations are the schema's source of truth: from empty, repeatable, reversible, equal to the models."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from slurmguard.store import SchemaNotCurrent, Store, db
from slurmguard.store.errors import MigrationsMissing
from slurmguard.store.models import Base

TABLES = {
    "nodes",
    "node_transitions",
    "incidents",
    "telemetry_summaries",
    "step_time_summaries",
    "sweeps",
    "triage_actions",
    "audit_log",
    "action_intents",
}


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migration_from_empty_creates_every_table(db_url):
    assert db.current(db_url) is None
    assert _tables(db_url) == set()
    rev = db.upgrade(db_url)
    assert rev == db.head_revision() == "0002"
    assert db.current(db_url) == rev
    assert _tables(db_url) == TABLES | {"alembic_version"}


def test_upgrade_is_idempotent_and_keeps_data(db_url, fake_clock):
    db.upgrade(db_url)
    with Store.open(db_url, fake_clock) as s:
        s.get_or_create_node("gpu001")
    assert db.upgrade(db_url) == db.head_revision()
    assert db.upgrade(db_url) == db.head_revision()
    with Store.open(db_url, fake_clock) as s:
        assert [n.name for n in s.list_nodes()] == ["gpu001"]


def test_migrated_schema_matches_models(db_url):
    """Alembic autogenerate finds nothing to do: models and migrations agree."""
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_models_differ_from_schema_is_detected(db_url):
    """The comparison above can fail: an extra model column shows up as a diff."""
    import sqlalchemy as sa

    db.upgrade(db_url)
    md = sa.MetaData()
    for t in Base.metadata.sorted_tables:
        t.to_metadata(md)
    md.tables["nodes"].append_column(sa.Column("bogus", sa.Integer()))
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), md)
    finally:
        engine.dispose()
    assert [(d[0], d[3].name) for d in diff] == [("add_column", "bogus")]


def test_downgrade_to_base_then_upgrade_round_trip(db_url, fake_clock):
    db.upgrade(db_url)
    with Store.open(db_url, fake_clock) as s:
        s.get_or_create_node("gpu001")
    assert db.downgrade(db_url, "base") is None
    assert _tables(db_url) <= {"alembic_version"}
    assert db.current(db_url) is None
    assert db.upgrade(db_url) == db.head_revision()
    assert _tables(db_url) == TABLES | {"alembic_version"}
    with Store.open(db_url, fake_clock) as s:
        assert s.list_nodes() == []  # the downgrade really dropped the data


def test_store_refuses_an_unmigrated_database(db_url, fake_clock):
    with pytest.raises(SchemaNotCurrent, match=r"run `slurmguard db upgrade`"):
        Store.open(db_url, fake_clock)


def test_missing_migrations_directory_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(db.MIGRATIONS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(MigrationsMissing, match=r"nowhere.*SLURMGUARD_MIGRATIONS"):
        db.upgrade(f"sqlite:///{tmp_path / 'x.db'}")
    assert not (tmp_path / "x.db").exists()


def test_current_does_not_create_a_sqlite_file(tmp_path):
    path = tmp_path / "sub" / "none.db"
    assert db.current(f"sqlite:///{path}") is None
    assert not path.exists()


def _model_constraints(dialect) -> dict[tuple[str, str], set[str]]:
    """(table, constraint name) -> quoted values in its CHECK text, from the models' own DDL."""
    import re

    from sqlalchemy.schema import CreateTable

    out = {}
    for table in Base.metadata.sorted_tables:
        ddl = str(CreateTable(table).compile(dialect=dialect))
        for name, kind, rest in re.findall(r"CONSTRAINT (\w+) (CHECK|FOREIGN KEY|UNIQUE)(.*)", ddl):
            values = set(re.findall(r"'([^']*)'", rest)) if kind == "CHECK" else set()
            out[(table.name, name)] = values
    return out


def test_constraint_names_and_enum_values_match_models(db_url):
    """Autogenerate ignores CHECK constraints; compare their names and allowed values here."""
    import re

    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    try:
        insp = inspect(engine)
        got = {}
        for table in TABLES:
            for ck in insp.get_check_constraints(table):
                got[(table, ck["name"])] = set(re.findall(r"'([^']*)'", ck["sqltext"]))
            for fk in insp.get_foreign_keys(table):
                got[(table, fk["name"])] = set()
            for uq in insp.get_unique_constraints(table):
                got[(table, uq["name"])] = set()
        expected = _model_constraints(engine.dialect)
    finally:
        engine.dispose()
    assert ("nodes", "ck_nodes_state") in expected and (
        "sweeps",
        "fk_sweeps_reference_node_id_nodes",
    ) in expected
    assert got == expected
