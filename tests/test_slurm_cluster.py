"""The Slurm client against the real local cluster."""

from __future__ import annotations

import time

import pytest

from slurmguard.slurm.commands import CommandSlurmClient
from slurmguard.slurm.errors import NotOurs, SlurmUnavailable, UnknownJob, UnknownNode
from slurmguard_dev.devcluster import ClusterSpec, DevCluster
from tests.fixtures.common import wait_for as _wait

pytestmark = pytest.mark.slurm


@pytest.fixture
def client(clean_cluster):
    return CommandSlurmClient(env=clean_cluster.env, timeout_s=20)


@pytest.mark.parametrize("use_json", [True, False], ids=["json", "scontrol"])
def test_nodes_listed_with_partitions_and_jobs(clean_cluster, use_json):
    client = CommandSlurmClient(env=clean_cluster.env, use_json=use_json)
    jid = clean_cluster.sbatch("#!/bin/sh\nsleep 30\n", "-w", "node2", "-o", "/dev/null")
    node2 = _wait(lambda: (n := client.node("node2")).jobs and n, what="job on node2")
    assert node2.jobs == (jid,)
    names = [n.name for n in client.nodes()]
    assert names == ["node1", "node2", "node3", "node4"]
    assert all(n.partitions == ("debug",) for n in client.nodes())


def test_drain_reason_visible_in_sinfo_and_scontrol(client, clean_cluster):
    full = client.drain("node1", "step +23% since 14:02, gpu3 sm_clock 1.38GHz vs peers 1.93GHz")
    assert full.startswith("slurmguard: step +23%")
    sinfo = clean_cluster.run(["sinfo", "-R", "-h", "-o", "%N|%E"]).stdout
    assert f"node1|{full}" in sinfo.splitlines()
    show = clean_cluster.run(["scontrol", "show", "node", "node1"]).stdout
    assert f"Reason={full}" in show
    assert client.node("node1").drained_by_us
    client.resume("node1")
    assert not client.node("node1").drained


def test_resume_refused_for_admin_drain_and_node_stays_drained(client, clean_cluster):
    clean_cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=admin: bad PSU"])
    with pytest.raises(NotOurs, match="someone else"):
        client.resume("node3")
    with pytest.raises(NotOurs):
        client.drain("node3", "our reason")
    n = client.node("node3")
    assert n.drained and n.reason == "admin: bad PSU"


def test_comment_ownership(client, clean_cluster):
    client.set_comment("node2", "pending verification: gpu3 temp +12C vs peers")
    assert client.node("node2").comment == "slurmguard: pending verification: gpu3 temp +12C vs peers"
    client.clear_comment("node2")
    assert client.node("node2").comment is None
    clean_cluster.run(["scontrol", "update", "NodeName=node2", "Comment=admin note"])
    with pytest.raises(NotOurs):
        client.set_comment("node2", "x")
    with pytest.raises(NotOurs):
        client.clear_comment("node2")
    assert client.node("node2").comment == "admin note"


def test_maintenance_reservation_keeps_ordinary_jobs_off(client, clean_cluster, tmp_path):
    client.create_reservation("slurmguard_quarantine_node4", ["node4"], duration_min=30)
    assert any(
        r.name == "slurmguard_quarantine_node4" and r.nodes == ("node4",) for r in client.reservations()
    )
    # an ordinary job asking for node4 cannot start; one inside the reservation can
    ordinary = client.submit("#!/bin/sh\nhostname\n", nodelist=["node4"], output="/dev/null")
    inside = client.submit(
        f"#!/bin/sh\necho $SLURMD_NODENAME > {tmp_path}/where\n",
        nodelist=["node4"],
        reservation="slurmguard_quarantine_node4",
        output="/dev/null",
        time_limit_min=2,
    )
    assert clean_cluster.wait_job(inside, timeout=60) == "COMPLETED"
    assert (tmp_path / "where").read_text().strip() == "node4"
    assert client.job(ordinary).state == "PENDING"
    # fill the rest of the cluster's free capacity: ordinary jobs go elsewhere
    free = [
        client.submit("#!/bin/sh\necho $SLURMD_NODENAME\nsleep 1\n", output=str(tmp_path / f"o{i}"))
        for i in range(3)
    ]
    for j in free:
        assert clean_cluster.wait_job(j, timeout=60) == "COMPLETED"
        assert client.job(j).nodes != ("node4",)
    client.delete_reservation("slurmguard_quarantine_node4")
    assert clean_cluster.wait_job(ordinary, timeout=60) == "COMPLETED"


def test_submit_signal_requeue(client, clean_cluster, tmp_path):
    marker = tmp_path / "sig"
    script = (
        f"#!/bin/bash\ntrap 'echo got-usr1 >> {marker}' USR1\n"
        f"echo start >> {marker}\nfor i in $(seq 300); do sleep 0.1; done\n"
    )
    jid = client.submit(script, job_name="sg-test", nodelist=["node1"], output="/dev/null", time_limit_min=5)
    _wait(lambda: client.job(jid).state == "RUNNING", what="job running")
    _wait(lambda: marker.exists(), what="job started")
    client.signal(jid, "USR1")
    _wait(lambda: "got-usr1" in marker.read_text(), what="USR1 delivered")
    # restarted at once on the node it ran on, every time: a restart within the
    # second the old run's credential was revoked would be refused and the job killed
    for n in (1, 2, 3):
        client.requeue(jid)
        _wait(lambda n=n: client.job(jid).restarts >= n, what="requeue counted")
        _wait(
            lambda n=n: marker.read_text().count("start") >= n + 1,
            timeout=60,
            what=f"job restarted ({client.job(jid)}, {marker.read_text()!r})",
        )
        assert client.job(jid).state == "RUNNING"
    client.cancel(jid)
    with pytest.raises(UnknownJob):
        client.job(99999999)
    with pytest.raises(UnknownNode):
        client.drain("node99", "x")


def test_stopped_slurmctld_gives_typed_error_within_timeout(tmp_path):
    cluster = DevCluster(ClusterSpec(state_dir=tmp_path / "dc", nodes=1))
    cluster.up()
    try:
        client = CommandSlurmClient(env=cluster.env, timeout_s=8)
        assert client.node("node1").state == "IDLE"
        cluster.down()
        start = time.monotonic()
        with pytest.raises(SlurmUnavailable) as exc:
            client.nodes()
        assert time.monotonic() - start < 8 + 2
        assert "sinfo" in str(exc.value) or "scontrol" in str(exc.value)
    finally:
        cluster.down()
