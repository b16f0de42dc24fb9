"""Issue 18.1 end to end: a job owner's rings name another user's job.

On the guarded local cluster (agents, controller, plugin), an unprivileged user
(tests/fixtures/security.py) runs a guarded job on node3 that drops rings into
its own ring directory whose headers claim a victim's job id (the victim: an
unguarded 2-node job of another user on node1,node2), with one rank slowing
down and then stalling. Before issue 18 this drained node3 and requeued the
victim; now the victim is untouched. (The controller drops ranks reported from
nodes outside the victim's allocation; the agent attributes a ring to the job
that owns its directory.) About 90 s.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from slurmguard.hook.ring import SOURCE_TORCH, RingWriter
from tests.fixtures.guard import wait_for
from tests.fixtures.security import attacker, traversable  # noqa: F401 - fixture

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def forge_rings(d: Path, victim: int, node: str, iters: int = 120) -> None:
    """Two ranks of `victim` on `node`, DDP-like; rank 1 computes 50% longer from the middle."""
    t = time.monotonic_ns() - int(iters * 0.2e9)
    ws = [
        RingWriter(
            str(d / f"rank-{r}.step-batch.torch.ring"),
            capacity=4096,
            job_id=victim,
            step_id=0,
            global_rank=r,
            local_rank=r,
            world_size=2,
            source=SOURCE_TORCH,
            node_name=node,
        )
        for r in (0, 1)
    ]
    for i in range(iters):
        slow = 0.05 if i >= iters // 2 else 0.0
        arrive = [t + int(0.08e9), t + int((0.08 + slow) * 1e9)]
        done = max(arrive) + int(0.02e9)
        for w, a in zip(ws, arrive):
            w.append(1, comm_id=7, count=1000, nbytes=4000, start_ns=a, end_ns=done)
        t = done
    for w in ws:
        w.close()


def test_rings_claiming_another_users_job_do_not_touch_it(guarded, attacker):
    run = guarded
    c = run.cluster
    work = Path(tempfile.mkdtemp(prefix="sg-attack-"))
    try:
        work.chmod(0o777)
        victim = c.sbatch(
            "#!/bin/sh\nsleep 300\n",
            "-N2",
            "-w",
            "node1,node2",
            "--exclusive",
            "-J",
            "victim",
            "-o",
            "/dev/null",
        )
        wait_for(lambda: c.job_state(victim) == "RUNNING", 60, "victim running")
        forged = work / "forged"
        forged.mkdir(mode=0o755)
        forge_rings(forged, victim, "node3")
        for p in forged.iterdir():
            p.chmod(0o644)
        script = (
            f'#!/bin/sh\ncp {forged}/*.ring "$SLURMGUARD_RING_DIR"/ && '
            f"echo planted > {work}/planted\nsleep 120\n"
        )
        with traversable(c.state_dir / "spool"):
            mallory = c.sbatch(
                script,
                "-N1",
                "-w",
                "node3",
                "--straggler-guard",
                "--exclusive",
                f"--uid={attacker.pw_name}",
                f"--gid={attacker.pw_gid}",
                f"--chdir={work}",
                "-J",
                "mallory",
                "-o",
                str(work / "out-%j"),
            )
            wait_for(lambda: (work / "planted").exists(), 60, "the attacker's rings in place")
            ring_dir = Path(run.guard.ring_root) / str(mallory)
            assert os.stat(ring_dir).st_uid == attacker.pw_uid
            # long enough for the old code to drain and requeue (reports every 1 s, cycles
            # every 1 s, a drain/requeue costs 0.3/0.6 GPU-s in the guard's policy)
            time.sleep(30)
        # the agents did report meanwhile (with their own node keys): the attack was heard
        metrics = urllib.request.urlopen(run.guard.controller_url + "/metrics", timeout=5).read()
        assert b'slurmguard_report_lag_seconds{node="node3"}' in metrics
        assert b'slurmguard_reports_total{outcome="unauthorized"}' not in metrics
        assert c.job_state(victim) == "RUNNING"
        assert not any(e.job_id == str(victim) for e in run.audit())
        with run.store() as s:
            assert s.incidents(job_id=str(victim)) == []
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(victim)],
            env=c.env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert "Restarts=0" in out
    finally:
        c.run(["scancel", "--partition", c.partition])
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], timeout=60)
