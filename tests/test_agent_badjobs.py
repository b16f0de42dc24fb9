"""Guarded jobs that go wrong: one that opts in but never calls a
collective, and one whose rank dies mid-run. The agent reads their rings
while they run (real gloo jobs, torch hook on); nothing crashes, and the
controller's assessment names no node (no drain)."""

from __future__ import annotations

import getpass
import time

import pytest

from slurmguard.agent.daemon import Agent
from slurmguard.clock import SystemClock
from slurmguard.config import parse_policy
from slurmguard.controller.assess import assess_job
from slurmguard.slurm.fake import FakeSlurm
from tests.fixtures.agent import start_pattern
from tests.test_agent_daemon import Collect

pytestmark = pytest.mark.slow

POLICY = parse_policy("""
agent: {telemetry_source: none, warmup_steps: 2, baseline_steps: 5}
response: {tiers: {stall_s: 5}}
""")


def watch(tmp_path, pattern, iters):
    root = tmp_path / "rings"
    slurm = FakeSlurm(nodes=("node0", "node1"))
    job = slurm.start_job(["node0", "node1"], user=getpass.getuser())
    agents = [
        Agent(node=n, policy=POLICY, sender=Collect(), clock=SystemClock(), ring_root=str(root), slurm=slurm)
        for n in ("node0", "node1")
    ]
    proc = start_pattern(tmp_path, pattern, iters, ring_root=root, job_id=job)
    try:
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in proc.procs) and time.monotonic() < deadline:
            for a in agents:
                a.step()
            time.sleep(0.3)
        for a in agents:
            a.step()
    finally:
        proc.kill_all()
    codes = [p.returncode for p in proc.procs]
    ranks = [
        (a.node, rk) for a in agents for j in a.sender.reports[-1].jobs if j.job_id == job for rk in j.ranks
    ]
    return job, codes, ranks, agents


@pytest.mark.timeout(600)
def test_job_that_never_calls_a_collective(tmp_path):
    job, codes, ranks, agents = watch(tmp_path, "idle", 20)
    assert codes == [0, 0]
    # its only collective is the teardown barrier: no iteration, no baseline
    assert all(not rk.steps and rk.baseline_step_s is None for _, rk in ranks)
    later = time.time() + 600
    assert assess_job(job, ("node0", "node1"), ranks, {}, POLICY, later) is None
    assert not any(a.tracker.errors.get("analysis") for a in agents)


@pytest.mark.timeout(600)
def test_job_whose_rank_dies(tmp_path):
    job, codes, ranks, agents = watch(tmp_path, "die", 40)
    assert codes[1] == 9 and codes[0] != 0  # rank 1 died, rank 0 lost its peer
    assert ranks and all(rk.exited for _, rk in ranks)
    later = time.time() + 600  # long silent: would read as a stall
    assert assess_job(job, ("node0", "node1"), ranks, {}, POLICY, later) is None
    assert not any(a.tracker.errors.get("analysis") for a in agents)
