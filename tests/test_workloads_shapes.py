"""The training workloads (python -m slurmguard.workloads) as jobs on the real
local cluster, without slurmguard: each shape trains (its own step log per rank,
the loss going down), a pipeline job checkpoints on SIGUSR1 and resumes after a
requeue, and bad arguments get one clear line."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmguard.slurm.commands import CommandSlurmClient
from slurmguard.workloads import SHAPES
from tests.fixtures.common import wait_for


def _script(shape: str, steps: int, ckpt: Path, *extra: str) -> str:
    # no MASTER_PORT: the ranks meet through slurmguard.rendezvous
    return (
        "#!/bin/bash\n"
        f"srun --kill-on-bad-exit=1 {sys.executable} -m slurmguard.workloads {shape} "
        f"--steps {steps} --ckpt-dir {ckpt} {' '.join(extra)}\n"
    )


def _log(ckpt: Path, rank: int) -> list[dict]:
    p = ckpt / f"rank{rank}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_help_and_bad_arguments_are_one_clear_line():
    run = [sys.executable, "-m", "slurmguard.workloads"]
    res = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "SLURM_PROCID" in res.stdout and "SIGUSR1" in res.stdout
    res = subprocess.run(run + ["ddp", "--steps", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == "error: --steps must be at least 1"
    res = subprocess.run(run + ["moe"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid choice: 'moe'" in res.stderr
    res = subprocess.run(run + ["ddp", "--rank0-save-s", "0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: --rank0-save-every must be >= 0, --rank0-save-s in (0, 86400] and --rank0-save-mbps > 0"
    )
    res = subprocess.run(run + ["pp", "--rank0-save-every", "5"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "only in the ddp shape (not pp)" in res.stderr


def test_rank0_save_writes_the_model_for_the_time_asked(tmp_path):
    """save_model_for: the model's state on disk (torch.save, renamed into
    place), written again until the time asked has passed, at the pace asked."""
    import time

    import torch

    from slurmguard.workloads.runtime import save_model_for

    model = torch.nn.Linear(256, 256)
    t0 = time.monotonic()
    mb = save_model_for(model, tmp_path / "m" / "model.pt", 0.5, mb_per_s=10.0)
    assert time.monotonic() - t0 >= 0.5
    one = (tmp_path / "m" / "model.pt").stat().st_size / 1e6
    assert 2 * one <= mb <= 10.0 * 0.5 + one  # again and again, at 10 MB/s
    assert torch.load(tmp_path / "m" / "model.pt")["weight"].shape == (256, 256)
    assert not (tmp_path / "m" / "model.pt.tmp").exists()


@pytest.mark.slurm
@pytest.mark.slow
def test_every_shape_trains_and_logs_its_own_step_times(clean_cluster, tmp_path):
    """~90 s: the five shapes, two jobs at a time on the 4 nodes (2d: 2x2 ranks)."""
    c = clean_cluster
    jobs = {}
    for shape in SHAPES:
        tasks = 2 if shape == "2d" else 1
        jobs[shape] = c.sbatch(
            _script(shape, 30, tmp_path / shape, "--ckpt-every", "10"),
            "-N2",
            f"--ntasks-per-node={tasks}",
            "--exclusive",
            "-o",
            str(tmp_path / f"{shape}.out"),
        )
    for shape, job in jobs.items():
        assert c.wait_job(job, timeout=300) == "COMPLETED", (tmp_path / f"{shape}.out").read_text()[-2000:]
    for shape in SHAPES:
        ckpt = tmp_path / shape
        ranks = 4 if shape == "2d" else 2
        logs = [_log(ckpt, r) for r in range(ranks)]
        for r, log in enumerate(logs):
            assert [e["iter"] for e in log] == list(range(30)), (shape, r)
            assert all(e["step_s"] > 0 and e["restart"] == 0 for e in log)
            assert sum(e["ckpt_s"] > 0 for e in log) == 3  # steps 10, 20, 30
        assert len({e["node"] for log in logs for e in log}) == 2
        loss = [e["loss"] for e in logs[0]]
        assert all(math.isfinite(x) for x in loss)
        assert sum(loss[-5:]) < sum(loss[:5]), (shape, loss)  # it learns
        assert (ckpt / "done").exists() and (ckpt / "latest").read_text().strip() == "30"
        out = (tmp_path / f"{shape}.out").read_text()
        assert "stopped at step 30 of 30" in out, out[-1000:]
    buckets = re.search(r"ddp: (\d+) gradient buckets per step", (tmp_path / "ddp.out").read_text())
    assert buckets and int(buckets.group(1)) >= 3


@pytest.mark.slurm
@pytest.mark.slow
def test_pipeline_checkpoints_on_sigusr1_and_resumes_after_requeue(clean_cluster, tmp_path):
    """~60 s: no periodic checkpoints; SIGUSR1 makes one; a requeue resumes from it."""
    c = clean_cluster
    ckpt = tmp_path / "pp"
    job = c.sbatch(
        _script("pp", 100000, ckpt, "--ckpt-every", "0"),
        "-N2",
        "--ntasks-per-node=1",
        "--exclusive",
        "-o",
        str(tmp_path / "pp.out"),
    )
    wait_for(lambda: len(_log(ckpt, 1)) >= 15, 180, "15 pipeline steps")
    assert not (ckpt / "latest").exists()
    assert c.run(["scancel", "--signal=USR1", str(job)]).returncode == 0
    wait_for(lambda: (ckpt / "latest").exists(), 60, "the checkpoint on SIGUSR1")
    saved = int((ckpt / "latest").read_text())
    for r in (0, 1):
        assert any(e["ckpt_s"] > 0 and e["iter"] == saved - 1 for e in _log(ckpt, r))
    slurm = CommandSlurmClient(env=c.env, timeout_s=30)
    slurm.requeue(job, settle_s=30)

    def restarted():
        # the old run may take longer than settle_s to finish completing; the
        # begin-time hold Slurm then sets is lifted here, as the controller
        # does on its later cycles
        slurm.release_requeue_hold(job)
        return [e for e in _log(ckpt, 1) if e["restart"] == 1]

    wait_for(restarted, 240, "the restarted run", interval=2.0)
    resumed = [e for e in _log(ckpt, 1) if e["restart"] == 1]
    assert resumed[0]["iter"] == saved
    c.run(["scancel", str(job)])
