"""The slurmrestd backend: tokens, policy, and the real slurmrestd of the local cluster.

The cluster tests start one 2-node cluster with slurmrestd (JWT) for the
module (about 15 s on the 2-core machine) and compare the REST backend with
the command backend on the same cluster.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time
from pathlib import Path

import pytest

from slurmguard.config import ConfigError, parse_policy
from slurmguard.slurm.backend import client_from_policy
from slurmguard.slurm.commands import CommandSlurmClient
from slurmguard.slurm.errors import NotOurs, SlurmError, SlurmUnavailable, UnknownJob
from slurmguard.slurm.restd import FALLBACKS, RestdSlurmClient, TokenSource, sign_token
from tests.fixtures.common import wait_for


def _b64d(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def test_signed_token_is_hs256_with_user_and_expiry():
    tok = sign_token(b"k" * 32, "sgop", 600, now=1000.0)
    header, body, sig = tok.split(".")
    assert json.loads(_b64d(header)) == {"alg": "HS256", "typ": "JWT"}
    assert json.loads(_b64d(body)) == {"exp": 1600, "iat": 1000, "sun": "sgop"}
    want = hmac.new(b"k" * 32, f"{header}.{body}".encode(), hashlib.sha256).digest()
    assert _b64d(sig) == want


def test_signed_tokens_are_renewed_before_expiry(tmp_path):
    key = tmp_path / "jwt.key"
    key.write_bytes(b"x" * 32)
    now = [1000.0]
    src = TokenSource(user="root", key_file=str(key), lifespan_s=900, clock=lambda: now[0])
    first = src.token()
    now[0] += 500  # more than a third left: the same token
    assert src.token() == first
    now[0] += 200  # less than a third left: a new one
    assert src.token() != first


def test_token_file_is_reread_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JWT", raising=False)
    f = tmp_path / "token"
    f.write_text("SLURM_JWT=aaa\n")
    src = TokenSource(user="root", token_file=str(f))
    assert src.token() == "aaa"
    f.write_text("SLURM_JWT=bbbb\n")
    assert src.token() == "bbbb"
    with pytest.raises(SlurmError, match="needs a token"):
        TokenSource(user="root")


def test_policy_backend_values():
    p = parse_policy("slurm:\n  backend: restd\n  restd_url: http://127.0.0.1:6820\n")
    assert p.slurm.backend == "restd" and p.slurm.restd_api == "v0.0.38"
    with pytest.raises(ConfigError, match=r"<policy>:\d+: slurm.*restd_url"):
        parse_policy("slurm:\n  backend: restd\n")
    # pyslurm used to validate and fail at run time: now it is rejected here
    with pytest.raises(ConfigError, match="slurm.backend"):
        parse_policy("slurm:\n  backend: pyslurm\n")
    with pytest.raises(ConfigError, match="not both"):
        parse_policy("slurm:\n  restd_jwt_key_file: /a\n  restd_token_file: /b\n")


def test_unreachable_restd_is_slurm_unavailable(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = tmp_path / "k"
    key.write_bytes(b"k" * 32)
    c = RestdSlurmClient(f"http://127.0.0.1:{port}", TokenSource(user="root", key_file=str(key)), timeout_s=2)
    with pytest.raises(SlurmUnavailable, match="slurmrestd unreachable"):
        c.nodes()


# ------------------------------------------------------------------ on the local cluster
@pytest.fixture(scope="module")
def restd_cluster(tmp_path_factory):
    from slurmguard_dev.devcluster import ClusterSpec, DevCluster

    c = DevCluster(ClusterSpec(state_dir=tmp_path_factory.mktemp("restd"), nodes=2, restd=True))
    c.up()
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def both(restd_cluster):
    cmd = CommandSlurmClient(env=restd_cluster.env, timeout_s=20)
    rest = RestdSlurmClient(
        restd_cluster.restd_url,
        TokenSource(user="root", key_file=str(restd_cluster.jwt_key_path)),
        timeout_s=20,
        fallback=cmd,
    )
    yield cmd, rest
    restd_cluster.run(["scancel", "--partition", restd_cluster.partition])
    for node in restd_cluster.node_names:
        restd_cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
    restd_cluster.run(["scontrol", "delete", "ReservationName=sg_restd_test"])


@pytest.mark.slurm
def test_both_backends_see_the_same_fleet_in_one_call(both, restd_cluster):
    cmd, rest = both
    assert rest.version() == cmd.version()
    jid = restd_cluster.sbatch("#!/bin/sh\nsleep 60\n", "-w", "node2", "-o", "/dev/null")
    wait_for(lambda: rest.node("node2").jobs == (jid,), what="job on node2 via REST")
    nodes, jobs = rest.fleet()
    assert [n.name for n in nodes] == ["node1", "node2"]
    assert (nodes, jobs) == cmd.fleet()
    assert rest.job(jid) == cmd.job(jid)
    with pytest.raises(UnknownJob):
        rest.job(999999)


@pytest.mark.slurm
def test_rest_submit_then_signal_and_cancel_through_commands(both, restd_cluster, tmp_path):
    cmd, rest = both
    out = tmp_path / "sig.out"
    # the batch shell and its step each record USR1 (and the environment we passed)
    script = (
        f'#!/bin/sh\necho "mark=$SG_MARK" >> {out}\n'
        f"trap 'echo batch got USR1 >> {out}' USR1\n"
        f"srun sh -c \"trap 'echo step got USR1 >> {out}' USR1; "
        'i=0; while [ \\$i -lt 120 ]; do sleep 0.5; i=\\$((i+1)); done"\n'
    )
    jid = rest.submit(
        script, job_name="sg-restd", output="/dev/null", time_limit_min=5, env={"SG_MARK": "42"}
    )  # POST /job/submit
    job = wait_for(lambda: (j := cmd.job(jid)).running and j, what="REST-submitted job running")
    assert job.name == "sg-restd" and job.time_limit_min == 5
    wait_for(
        lambda: f"{jid}.0" in restd_cluster.run(["squeue", "-h", "-s", "-j", str(jid)]).stdout,
        what="the job's step started",
    )
    time.sleep(1)  # the step's shell has set its trap
    rest.signal(jid, "SIGUSR1", batch_only=False)  # scancel --signal: the steps, job goes on
    wait_for(lambda: "step got USR1" in out.read_text(), what="USR1 delivered to the step")
    assert "mark=42" in out.read_text() and "batch got USR1" not in out.read_text()
    assert cmd.job(jid).running
    rest.cancel(jid)
    wait_for(lambda: cmd.job(jid).state == "CANCELLED", what="job cancelled")


@pytest.mark.slurm
def test_node_and_reservation_writes_fall_back_to_commands(both, restd_cluster):
    cmd, rest = both
    assert {"drain", "resume", "create_reservation", "requeue"} <= FALLBACKS
    full = rest.drain("node1", "restd backend test")
    assert rest.node("node1").drained_by_us and rest.node("node1").reason == full
    rest.resume("node1")
    assert not rest.node("node1").drained
    restd_cluster.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=admin: psu"])
    with pytest.raises(NotOurs):
        rest.resume("node2")
    rest.create_reservation("sg_restd_test", ["node1"], duration_min=10)
    (r,) = [r for r in rest.reservations() if r.name == "sg_restd_test"]
    assert r.nodes == ("node1",) and {"MAINT", "IGNORE_JOBS"} <= r.flags
    assert rest.reservations() == cmd.reservations()


@pytest.mark.slurm
def test_scontrol_token_file_and_a_wrong_key(restd_cluster, tmp_path):
    res = restd_cluster.run(["scontrol", "token", "username=root", "lifespan=600"])
    f = tmp_path / "token"
    f.write_text(res.stdout)
    p = parse_policy(
        f"slurm:\n  backend: restd\n  restd_url: {restd_cluster.restd_url}\n  restd_token_file: {f}\n"
    )
    client = client_from_policy(p.slurm, env=restd_cluster.env)
    assert isinstance(client, RestdSlurmClient)
    assert [n.name for n in client.nodes()] == ["node1", "node2"]
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not the cluster key" * 2)
    wrong = RestdSlurmClient(
        restd_cluster.restd_url, TokenSource(user="root", key_file=str(bad)), timeout_s=10
    )
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="slurmctld refused the token"):
        wrong.nodes()
    assert time.monotonic() - t0 < 10
    assert Path(restd_cluster.jwt_key_path).stat().st_mode & 0o077 == 0
