"""Stopped processes on the guarded local cluster: Slurm's own suspension is
left alone, a rank frozen from outside the job names its node.

- `scontrol suspend` (what gang scheduling and preemption by suspension do)
  stops every process of a DDP job for longer than the stall window, then
  `scontrol resume`: slurmguard skips the job while Slurm says it is
  suspended, and after the resume neither the silence nor the iteration that
  spans the suspension counts: no action. Before, the first cycle after the
  resume could read the agents' last reports, sent while the job was stopped,
  as a stall and requeue the job, draining a node.
- SIGSTOP to one rank while both ranks are inside an all-reduce (in flight
  alike, their last completed collectives within a millisecond of each
  other): the agent sees the process stopped, the stall names its node, which
  is drained, and the job is requeued. Before, the stall named whichever rank
  had the older last completion, a coin toss.

About 2.5 minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from slurmguard.hook.ring import RingError, RingReader
from slurmguard_dev.devcluster.scenario import Scenario
from tests.fixtures.guard import nothing_happened, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STALL_S = 8.0


def _scontrol(run, *args: str) -> None:
    out = run.cluster.run(["scontrol", *args])
    assert out.returncode == 0, (args, out.stdout, out.stderr)


def _rank_rings(run, job: int) -> dict[int, Path]:
    """The job's rings in the guard's ring directory: global rank -> path."""
    found = {}
    for p in Path(run.guard.ring_root).glob(f"{job}/rank-*.ring"):
        try:
            with RingReader(p) as r:
                found[r.header.global_rank] = p
        except RingError:
            continue
    return found


def _in_flight(path: Path) -> bool:
    with RingReader(path) as r:
        return r.in_flight()[1] is not None


def _job_rings(run, job: int) -> dict[int, Path]:
    return wait_for(
        lambda: (lambda r: r if len(r) == 2 else None)(_rank_rings(run, job)), 30, "the job's rings"
    )


def _stop_in_flight(rings: dict[int, Path], stop, resume, what: str, tries: int = 100) -> int:
    """stop() at moments some tens of ms apart, resume() when the ranks were not
    both inside a collective, until they were; returns the try that landed."""
    for attempt in range(tries):
        stop()
        time.sleep(0.5)
        if _in_flight(rings[0]) and _in_flight(rings[1]):
            return attempt + 1
        resume()
        time.sleep(0.1 + (attempt % 7) * 0.07)
    pytest.fail(f"no {what} landed with both ranks in flight in {tries} tries")


def _ddp_job(run) -> tuple[Scenario, int]:
    """A DDP job past its warm-up under an 8 s stall window."""
    run.configure(response={"tiers": {"stall_s": STALL_S}})
    sc = Scenario(run.guard, say=print, workload="ddp")
    job = sc.submit(steps=100000, ckpt_every=0)
    sc.wait_steps(job, 40)
    return sc, job


def test_a_job_slurm_suspends_and_resumes_is_left_alone(guarded):
    run = guarded
    sc, job = _ddp_job(run)
    # suspended while both ranks wait inside a collective: in the cycle after the
    # resume, reports sent while it was stopped then say "in flight for 24 s"
    tries = _stop_in_flight(
        _job_rings(run, job),
        lambda: _scontrol(run, "suspend", str(job)),
        lambda: _scontrol(run, "resume", str(job)),
        "suspension",
    )
    suspended_at = len(sc.log(job))
    time.sleep(3 * STALL_S)
    _scontrol(run, "resume", str(job))
    # the steps after the resume, and the controller's cycles over them
    wait_for(lambda: len(sc.log(job)) >= suspended_at + 60, 120, "steps after the resume")
    print(
        f"\nsuspended in flight (try {tries}) for {3 * STALL_S:.0f} s after {suspended_at} steps,"
        f" then {len(sc.log(job))} steps"
    )
    nothing_happened(run)
    assert sc.job_nodes(job) and not run.audit("requeue")


def test_a_rank_frozen_inside_a_collective_gets_its_node_drained(guarded):
    run = guarded
    sc, job = _ddp_job(run)
    nodes = sc.job_nodes(job)
    rings = _job_rings(run, job)
    with RingReader(rings[1]) as r:
        pid = r.header.pid
    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    frozen_node = env[b"SLURMD_NODENAME"].decode()
    tries = _stop_in_flight(
        rings, lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT), "stop", tries=300
    )
    stopped_at = time.time()
    try:
        drain = wait_for(lambda: sc.drain(frozen_node), 90, f"a drain of {frozen_node}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # requeued: the process is gone
            os.kill(pid, signal.SIGCONT)
    print(
        f"\nrank 1 stopped in flight after {tries} tries; {frozen_node} drained "
        f"{sc.epoch(drain.at) - stopped_at:.1f}s later: {drain.reason}"
    )
    assert "process is stopped" in drain.reason
    other = [n for n in nodes if n != frozen_node]
    assert other and all(sc.drain(n) is None for n in other)
    wait_for(lambda: run.audit("requeue"), 30, "the job's requeue")
