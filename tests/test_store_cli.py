"""`slurmguard db upgrade|current|downgrade` through the real CLI entry points."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from slurmguard.cli import cli, main
from slurmguard.store import db


@pytest.fixture
def runner(tmp_path, monkeypatch):
    # An empty policy file = built-in defaults, independent of ./policies.yaml.
    policy = tmp_path / "empty-policy.yaml"
    policy.write_text("")
    monkeypatch.setenv("SLURMGUARD_POLICY", str(policy))
    monkeypatch.delenv("SLURMGUARD_DB", raising=False)
    return CliRunner()


def _invoke(runner, args, **kw):
    res = runner.invoke(cli, args, catch_exceptions=False, **kw)
    return res.exit_code, res.output


def test_upgrade_with_db_option_creates_and_reports(runner, db_url):
    code, out = _invoke(runner, ["--db", db_url, "db", "upgrade"])
    assert code == 0, out
    assert f"database: {db.mask_url(db_url)}" in out
    assert "revision: 0002 (head), upgraded from empty" in out
    assert db.current(db_url) == "0002"
    code, out = _invoke(runner, ["--db", db_url, "db", "upgrade"])
    assert code == 0 and "already up to date" in out
    code, out = _invoke(runner, ["--db", db_url, "db", "current", "--check"])
    assert code == 0 and "revision: 0002 (head)" in out


def test_upgrade_with_environment_variable(runner, db_url):
    code, out = _invoke(runner, ["db", "current", "--check"], env={"SLURMGUARD_DB": db_url})
    assert code == 1 and "revision: none (empty database)" in out
    code, out = _invoke(runner, ["db", "upgrade"], env={"SLURMGUARD_DB": db_url})
    assert code == 0 and "upgraded from empty" in out
    assert db.current(db_url) == "0002"


def test_db_option_beats_environment(runner, tmp_path):
    opt, env = tmp_path / "opt" / "a.db", tmp_path / "env" / "b.db"
    code, _ = _invoke(
        runner,
        ["--db", f"sqlite:///{opt}", "db", "upgrade"],
        env={"SLURMGUARD_DB": f"sqlite:///{env}"},
    )
    assert code == 0 and opt.exists() and not env.exists()


def test_policy_database_url_is_the_default(runner, tmp_path):
    path = tmp_path / "deep" / "dir" / "sg.db"
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"database:\n  url: sqlite:///{path}\n")
    code, out = _invoke(runner, ["--policy", str(policy), "db", "upgrade"])
    assert code == 0, out
    assert path.exists() and f"sqlite:///{path}" in out


def test_downgrade_needs_confirmation(runner, tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    db.upgrade(url)
    res = runner.invoke(cli, ["--db", url, "db", "downgrade", "base"])
    assert res.exit_code == 2 and "--yes" in res.output
    assert db.current(url) == "0002"
    code, out = _invoke(runner, ["--db", url, "db", "downgrade", "base", "--yes"])
    assert code == 0 and "revision: none" in out and db.current(url) is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "url, message",
    [
        (
            "mysql://root:hunter2@db/x",
            "unsupported database URL scheme 'mysql' in 'mysql://root:***@db/x'",
        ),
        ("not a url", "bad database URL 'not a url'"),
        ("postgresql+asyncpg://u@h/d", "unsupported PostgreSQL driver 'asyncpg'"),
        (
            None,
            "cannot use database postgresql+psycopg://sg:***@127.0.0.1:{port}/sg: connection failed",
        ),
    ],
)
def test_errors_are_one_line_without_traceback_or_password(runner, capsys, url, message):
    port = _closed_port()
    url = url or f"postgresql+psycopg://sg:hunter2@127.0.0.1:{port}/sg"
    with pytest.raises(SystemExit) as exc:
        main(["--db", url, "db", "upgrade"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("slurmguard: error: ") and message.format(port=port) in err
    assert len(err.strip().splitlines()) == 1
    assert "hunter2" not in err and "Traceback" not in err
