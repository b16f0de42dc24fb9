"""`slurmguard node drain|resume` and `slurmguard nodes` on the real cluster, audited."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slurmguard.store import Store, db

pytestmark = pytest.mark.slurm


def sg(args, env, db_url):
    return subprocess.run(
        [sys.executable, "-m", "slurmguard.cli", "--db", db_url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def db_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'sg.db'}"
    db.upgrade(url)
    return url


def test_drain_and_resume_are_audited(clean_cluster, db_file):
    env = clean_cluster.env
    r = sg(["node", "drain", "node2", "--reason", "fan noise"], env, db_file)
    assert r.returncode == 0, r.stderr
    assert "slurmguard: fan noise" in clean_cluster.run(["scontrol", "show", "node", "node2"]).stdout
    r = sg(["nodes", "--format", "json"], env, db_file)
    node2 = next(n for n in json.loads(r.stdout) if n["name"] == "node2")
    assert node2["drained_by"] == "slurmguard" and node2["lifecycle"] == "draining"
    r = sg(["node", "resume", "node2"], env, db_file)
    assert r.returncode == 0, r.stderr
    with Store.open(db_file) as store:
        entries = store.audit_entries(node="node2")
    assert [(e.action, str(e.outcome)) for e in entries] == [("drain", "ok"), ("resume", "ok")]
    assert entries[0].reason == "slurmguard: fan noise" and entries[0].actor.startswith("admin:")


def test_resume_of_admin_drain_refused_cleanly(clean_cluster, db_file):
    clean_cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=RMA ticket 42"])
    r = sg(["node", "resume", "node3"], clean_cluster.env, db_file)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "someone else" in r.stderr and "node3" in r.stderr
    assert "Reason=RMA ticket 42" in clean_cluster.run(["scontrol", "show", "node", "node3"]).stdout
    with Store.open(db_file) as store:
        (entry,) = store.audit_entries(node="node3")
    assert entry.action == "resume" and str(entry.outcome) == "error"


def test_drain_without_database_does_not_touch_slurm(clean_cluster, tmp_path):
    r = sg(
        ["node", "drain", "node1", "--reason", "x"], clean_cluster.env, f"sqlite:///{tmp_path / 'missing.db'}"
    )
    assert r.returncode != 0 and "db upgrade" in r.stderr
    assert "Reason=" not in clean_cluster.run(["scontrol", "show", "node", "node1"]).stdout.replace(
        "Reason=(null)", ""
    )
