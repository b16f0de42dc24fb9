"""Issue 18.2 and 18.7: which policy and which secret root trusts.

Each attack is made by a real unprivileged user (tests/fixtures/security.py)
and fails: the admin CLI never reads ./policies.yaml, and run as root it
refuses a policy or a secret that is not root's alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmguard.cli import cli
from slurmguard.config import load_policy, read_trusted
from slurmguard.errors import ConfigError
from slurmguard.wire import node_key, read_secret
from tests.fixtures.security import attacker, plant  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "slurmguard.cli"]


@pytest.fixture
def user_dir(attacker):
    """A directory the attacker owns (their home, their job's working directory)."""
    d = Path(tempfile.mkdtemp(prefix="sg-attacker-"))
    os.chown(d, attacker.pw_uid, attacker.pw_gid)
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], timeout=30)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update({"PYTHONPATH": str(ROOT), "SLURM_CONF": "/nonexistent/slurm.conf", **extra})
    return env


def test_root_running_the_admin_cli_in_a_users_directory_runs_nothing_of_theirs(attacker, user_dir):
    """Attack (18.2): ./policies.yaml set slurm.bin_dir, so root ran the user's `sinfo`."""
    plant(attacker, user_dir / "policies.yaml", f"slurm:\n  bin_dir: {user_dir}\n")
    plant(
        attacker,
        user_dir / "sinfo",
        f"#!/bin/sh\n/usr/bin/touch {user_dir}/pwned-by-$(/usr/bin/id -u)\necho 'slurm 22.05.8'\n",
        0o755,
    )
    assert (user_dir / "policies.yaml").stat().st_uid == attacker.pw_uid
    # no Slurm on PATH: only a bin_dir from the user's policy could find a `sinfo`
    out = subprocess.run(
        CLI + ["nodes"],
        cwd=user_dir,
        env=_env(PATH="/nonexistent"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not list(user_dir.glob("pwned-by-*")), "root ran the user's sinfo"
    assert "Traceback" not in out.stderr
    shown = subprocess.run(
        CLI + ["policy", "show"], cwd=user_dir, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and '"bin_dir": null' in shown.stdout


def test_policy_not_owned_by_root_or_writable_by_others_is_refused(attacker, user_dir, tmp_path):
    """Named explicitly ($SLURMGUARD_POLICY / --policy) it is still refused when root runs it."""
    theirs = user_dir / "p.yaml"
    plant(attacker, theirs, "slurm: {}\n")
    out = subprocess.run(
        CLI + ["policy", "show"],
        env=_env(SLURMGUARD_POLICY=str(theirs)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{theirs}: policy file is owned by uid {attacker.pw_uid}, not root" in out.stderr
    shared = tmp_path / "p.yaml"
    shared.write_text("slurm: {}\n")
    shared.chmod(0o666)
    with pytest.raises(ConfigError, match=r"writable by group or others \(mode 0666\)"):
        load_policy(shared)
    shared.chmod(0o644)
    assert load_policy(shared).slurm.bin_dir is None
    # validating a user's file acts on nothing: allowed
    ok = subprocess.run(
        CLI + ["policy", "check", str(theirs)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # and does not block
        load_policy(fifo)


def test_secret_must_be_roots_and_private(attacker, user_dir, tmp_path):
    """Attack (18.7): the secret file's permissions were never checked."""
    theirs = user_dir / "secret"
    plant(attacker, theirs, "x" * 64, 0o600)
    with pytest.raises(ConfigError, match=f"owned by uid {attacker.pw_uid}, not root"):
        read_secret(theirs)
    mine = tmp_path / "secret"
    mine.write_text("y" * 64)
    mine.chmod(0o644)
    with pytest.raises(ConfigError, match=r"accessible by others \(mode 0644\)"):
        read_secret(mine)
    mine.chmod(0o600)
    assert read_secret(mine) == b"y" * 64
    mine.write_text("short")
    with pytest.raises(ConfigError, match="too short"):
        read_secret(mine)
    # not root: no owner check (a developer's own files), the mode check stays
    assert read_trusted(theirs, "secret", secret=True, as_root=False) == b"x" * 64


def test_keys_derive_gives_the_key_the_controller_expects(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURMGUARD_POLICY", raising=False)
    master = tmp_path / "secret"
    master.write_text("m" * 64 + "\n")
    master.chmod(0o600)
    out = CliRunner().invoke(cli, ["keys", "derive", "node7", "--secret-file", str(master)])
    assert out.exit_code == 0, out.output
    assert out.output.strip().encode() == node_key(b"m" * 64, "node7")
    assert node_key(b"m" * 64, "node7") != node_key(b"m" * 64, "node8")
    dest = tmp_path / "node7.key"
    out = CliRunner().invoke(cli, ["keys", "derive", "node7", "--secret-file", str(master), "-o", str(dest)])
    assert out.exit_code == 0 and oct(dest.stat().st_mode & 0o777) == "0o600"
    assert read_secret(dest, "node key") == node_key(b"m" * 64, "node7")
    with pytest.raises(ConfigError, match="invalid node name"):
        CliRunner().invoke(
            cli, ["keys", "derive", "node7;rm", "--secret-file", str(master)], catch_exceptions=False
        )
