"""The agent daemon keeps reporting a healthy guarded job while its ring
directories fill with broken, hostile and stale rings.

The healthy job is a real 2-rank gloo DDP job (tests/fixtures/agent_patterns.py)
with the torch hook writing its rings; Slurm is the fake (the job, its user
and its nodes are what the agent asks it). The agent runs its real loop
(`run`) in a thread, one per node, as it does as a service.
"""

from __future__ import annotations

import getpass
import os
import struct
import threading
import time

import pytest

from slurmguard.agent.daemon import Agent, run
from slurmguard.clock import SystemClock
from slurmguard.config import parse_policy
from slurmguard.hook import ring
from slurmguard.slurm.fake import FakeSlurm
from tests.fixtures.agent import start_pattern

pytestmark = pytest.mark.slow

POLICY = parse_policy("""
agent:
  sample_interval_s: 0.2
  report_interval_s: 0.3
  telemetry_source: none
  warmup_steps: 2
  baseline_steps: 5
""")


class Collect:
    """Stands in for ReportSender: keeps what the agent would send."""

    def __init__(self) -> None:
        self.queue: list = []
        self.reports: list = []
        self.sent = self.dropped = 0

    def enqueue(self, report) -> None:
        self.reports.append(report)

    def flush(self) -> int:
        self.sent = len(self.reports)
        return 0


def plant_broken_rings(root, job_dir, other_user_job, stale_job):
    """Every kind of bad ring a job owner (or a crash) can leave behind."""
    # a second ring claiming rank 0, with older records than the job's own
    good = ring.RingWriter(
        str(job_dir / "rank-9.step-0.torch.ring"), capacity=16, global_rank=0, world_size=2, node_name="node0"
    )
    for i in range(30):
        t = time.monotonic_ns() - (60 - i) * 10**8
        good.append(ring.OP["allreduce"], comm_id=1, nbytes=4, start_ns=t, end_ns=t + 10**6)
    good.close()
    os.mkfifo(job_dir / "rank-2.step-0.torch.ring")  # would block an open()
    (job_dir / "rank-3.step-0.torch.ring").write_bytes(b"\1" * 100)  # truncated
    sparse = job_dir / "rank-4.step-0.torch.ring"  # huge geometry, a hole
    raw = bytearray((job_dir / "rank-9.step-0.torch.ring").read_bytes()[: ring.HEADER_SIZE])
    struct.pack_into("<I", raw, 20, ring.MAX_CAPACITY)
    sparse.write_bytes(bytes(raw))
    os.truncate(sparse, ring.HEADER_SIZE + ring.MAX_CAPACITY * ring.RECORD_SIZE)
    (job_dir / "rank-5.step-0.torch.ring").symlink_to("/etc/passwd")
    # nonsense records: absurd and reversed times, out of order
    w = ring.RingWriter(
        str(job_dir / "rank-1.step-0.nccl.ring"), capacity=64, global_rank=1, world_size=2, node_name="node0"
    )
    now = time.monotonic_ns()
    for i in range(60):
        s = now - (i * 7919 % 60) * 10**7
        w.append(
            ring.OP["allreduce"],
            comm_id=3,
            nbytes=4 * (i % 3),
            start_ns=s,
            end_ns=s + 2**62 if i % 2 else now + 10**15,
        )
    w.close()
    # another user's directory for a running job, and a stale job's leftovers
    for jid in (other_user_job, stale_job):
        d = root / str(jid)
        d.mkdir()
        ring.RingWriter(
            str(d / "rank-0.step-0.torch.ring"), capacity=16, global_rank=0, world_size=1, node_name="node0"
        ).close()
    # (both directories stay owned by the test's user; job `other_user_job` runs as nobody)


@pytest.mark.timeout(600)
def test_agent_survives_broken_rings_while_a_healthy_job_is_reported(tmp_path):
    root = tmp_path / "rings"
    slurm = FakeSlurm(nodes=("node0", "node1"))
    user = getpass.getuser()
    job = slurm.start_job(["node0", "node1"], user=user)
    other = slurm.start_job(["node0"], user="nobody")
    stale = 9999
    job_dir = root / str(job)
    job_dir.mkdir(parents=True)
    plant_broken_rings(root, job_dir, other, stale)

    agents, threads, stop = [], [], threading.Event()
    for node in ("node0", "node1"):
        a = Agent(
            node=node, policy=POLICY, sender=Collect(), clock=SystemClock(), ring_root=str(root), slurm=slurm
        )
        t = threading.Thread(target=run, args=(a, stop), daemon=True)
        t.start()
        agents.append(a)
        threads.append(t)
    job_proc = start_pattern(tmp_path, "ddp", 50, ring_root=root, job_id=job)
    try:
        # and a ring that shrinks while the agent holds it
        shrink = job_dir / "rank-6.step-0.torch.ring"
        w = ring.RingWriter(str(shrink), capacity=16, global_rank=1, world_size=2, node_name="node1")
        w.close()
        time.sleep(2.0)
        os.truncate(shrink, 64)
        job_proc.wait(timeout=400)
        time.sleep(1.5)  # last reports after the job's final records
    finally:
        job_proc.kill_all()
        stop.set()
        for t in threads:
            t.join(timeout=30)
    for t in threads:
        assert not t.is_alive()
    for a in agents:
        reps = a.sender.reports
        assert len(reps) >= 10, "the agent stopped reporting"
        last = reps[-1]
        jobs = {j.job_id: j for j in last.jobs}
        assert set(jobs) == {job}, "only the running job of this user is reported"
        ranks = jobs[job].ranks
        assert len(ranks) == 1 and ranks[0].rank == (0 if a.node == "node0" else 1)
        assert len(ranks[0].steps) >= 30 and ranks[0].baseline_step_s
        # the healthy mean the controller measures an intermittent slowdown against
        assert ranks[0].baseline_mean_s is not None and ranks[0].baseline_mean_s >= ranks[0].baseline_step_s
        assert all(s.step_s > 0 for s in ranks[0].steps)
    e0 = agents[0].sender.reports[-1].ring_errors
    e1 = agents[1].sender.reports[-1].ring_errors
    # FIFO, truncated, sparse, symlink, duplicate rank 0 on node0
    assert e0.get("invalid", 0) >= 5
    assert e0.get("untrusted", 0) >= 1  # job `other` runs as another user
    assert e1.get("unreadable", 0) == 1  # the ring that shrank under node1's agent
    assert e0.get("corrupt_records", 0) == 60  # the ring of impossible times, counted once
