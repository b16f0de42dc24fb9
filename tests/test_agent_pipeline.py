"""Rings (real writer) -> agents -> signed HTTP -> controller (real server), on FakeSlurm.

The timestamps are synthetic but follow a DDP job: each iteration computes,
then all ranks meet in one all-reduce; the slowed rank computes longer and
its peer waits for it inside the collective.
"""

from __future__ import annotations

import getpass
import os
import time
import urllib.request

import pytest

from slurmguard.agent.daemon import Agent
from slurmguard.agent.sender import ReportSender
from slurmguard.clock import FakeClock
from slurmguard.config import parse_policy
from slurmguard.controller.loop import Controller
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP
from slurmguard.hook.ring import SOURCE_TORCH, RingWriter
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.wire import NODE_HEADER, AgentReport, node_key, sign

SECRET = b"0123456789abcdef0123456789abcdef"
POLICY = parse_policy("""
response:
  tiers: {moderate_slowdown: 0.10, severe_slowdown: 0.20, sustained_s: 5}
  escalation: {drain_checkpoint_gpu_s: 1.0, requeue_gpu_s: 2.0}
safety:
  breaker: {max_nodes: 2, max_partition_percent: 50}
agent:
  warmup_steps: 2
  baseline_steps: 10
""")


def write_job(
    root, job_id, nodes, iters, slow_from, slow_node, *, compute=0.08, comm=0.02, slow_extra=0.04, t0_ns=None
):
    """One ring per rank; returns the monotonic ns of the last record."""
    t = t0_ns or time.monotonic_ns() - int(iters * 0.2e9)
    writers = {}
    d = root / str(job_id)
    d.mkdir(parents=True, exist_ok=True)
    for rank, node in enumerate(nodes):
        writers[node] = RingWriter(
            str(d / f"rank-{rank}.step-batch.torch.ring"),
            capacity=4096,
            job_id=job_id,
            step_id=0,
            global_rank=rank,
            local_rank=0,
            world_size=len(nodes),
            source=SOURCE_TORCH,
            node_name=node,
        )
    for i in range(iters):
        extra = slow_extra if i >= slow_from else 0.0
        arrive = {n: t + int((compute + (extra if n == slow_node else 0.0)) * 1e9) for n in nodes}
        done = max(arrive.values()) + int(comm * 1e9)
        for n, w in writers.items():
            w.append(1, comm_id=7, count=1000, nbytes=4000, start_ns=arrive[n], end_ns=done)
        t = done
    for w in writers.values():
        w.close()
    return t


@pytest.fixture
def stack(sqlite_store, tmp_path):
    clock = FakeClock(start=time.time())
    slurm = FakeSlurm(clock=clock)
    metrics = ControllerMetrics()
    ctl = Controller(POLICY, sqlite_store, slurm, clock, metrics=metrics)
    http = ControllerHTTP(
        "127.0.0.1",
        0,
        secret=SECRET,
        ingest=lambda r: ctl.fleet.ingest(r, clock.now()),
        metrics=metrics,
        now=time.time,
        health=lambda: (True, "ok"),
    )
    http.start()
    url = f"http://127.0.0.1:{http.port}"

    def agent(node: str) -> Agent:
        sender = ReportSender(url, node_key(SECRET, node), timeout_s=5, max_reports=5, now=time.time)
        return Agent(
            node=node,
            policy=POLICY,
            sender=sender,
            clock=clock,
            ring_root=str(tmp_path / "rings"),
            slurm=slurm,
        )

    yield ctl, slurm, clock, agent, url, metrics
    http.stop()


def test_slow_rank_in_rings_gets_its_node_drained_and_job_requeued(stack, tmp_path):
    ctl, slurm, clock, agent, url, metrics = stack
    job = slurm.start_job(["node1", "node2"], user=getpass.getuser())
    # 70 slow iterations of 0.14 s: the controller names a node over its last 4 s of
    # iterations and the 4 s before them (assess.LOCALISE_S, the sustained check)
    write_job(tmp_path / "rings", job, ["node1", "node2"], iters=100, slow_from=30, slow_node="node2")
    os.mkfifo(tmp_path / "rings" / str(job) / "rank-7.step-batch.torch.ring")  # a broken ring beside
    a1, a2 = agent("node1"), agent("node2")
    r1, r2 = a1.step(), a2.step()
    assert a1.sender.sent == 1 and a2.sender.sent == 1
    # each agent only took its own node's ring
    assert [rk.rank for rk in r1.jobs[0].ranks] == [0] and [rk.rank for rk in r2.jobs[0].ranks] == [1]
    rk2 = r2.jobs[0].ranks[0]
    assert rk2.baseline_step_s == pytest.approx(0.10, rel=0.01)
    assert rk2.steps[-1].step_s == pytest.approx(0.14, rel=0.01)
    assert rk2.changes and rk2.changes[0].direction == "slower"
    clock.advance(6)
    res = ctl.cycle()
    assert [c.node for c in res.assessments[job].culprits] == ["node2"]
    assert ("drain", "node2") in res.actions and ("requeue", str(job)) in res.actions
    assert not slurm.node("node1").drained
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    assert 'slurmguard_reports_total{outcome="ok"} 2.0' in body
    assert 'slurmguard_actions_total{action="drain"} 1.0' in body
    assert 'slurmguard_agent_ring_errors{kind="invalid",node="node1"} 1.0' in body


def test_controller_rejects_unsigned_stale_and_replayed_reports(stack):
    ctl, slurm, clock, agent, url, metrics = stack
    rep = AgentReport(node="node1", seq=5, sent_at=time.time())
    body = rep.model_dump_json().encode()

    key = node_key(SECRET, "node1")

    def post(ts, sig):
        req = urllib.request.Request(
            url + "/v1/report",
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "X-Slurmguard-Time": ts,
                NODE_HEADER: "node1",
                "X-Slurmguard-Signature": sig,
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    now = f"{time.time():.3f}"
    assert post(now, "0" * 64)[0] == 401
    old = f"{time.time() - 3600:.3f}"
    assert post(old, sign(key, old, "node1", body))[0] == 401
    assert post(now, sign(key, now, "node1", body)) == (200, b'{"accepted": true}')
    code, answer = post(now, sign(key, now, "node1", body))
    assert code == 409 and b"not newer" in answer


def test_sender_buffers_bounded_while_controller_down(tmp_path):
    clock = FakeClock(start=time.time())
    sender = ReportSender(
        "http://127.0.0.1:9", node_key(SECRET, "n1"), timeout_s=0.5, max_reports=3, now=clock.now
    )
    for seq in range(1, 6):
        sender.enqueue(AgentReport(node="n1", seq=seq, sent_at=clock.now()))
        sender.flush()
        clock.advance(120)
    assert [r.seq for r in sender.queue] == [3, 4, 5] and sender.dropped == 2 and sender.failures >= 1


def test_one_collective_per_iteration_despite_startup_broadcasts_and_final_barrier():
    import numpy as np

    from slurmguard.agent.analysis import iteration_starts
    from slurmguard.config import Policy
    from slurmguard.detect.records import RankOps

    n = 50
    t = np.cumsum(np.full(n, 100_000_000)).astype(np.int64)
    op = np.ones(n, np.int64)
    op[:3] = 4  # DDP's start-up broadcasts
    op[-1] = 14  # the job's final barrier
    starts = iteration_starts(
        RankOps(0, op, np.zeros(n), np.full(n, 4000), t, t + 20_000_000), Policy().detection.period
    )
    assert len(starts) == n - 4 and set(np.diff(starts)) == {100_000_000}
