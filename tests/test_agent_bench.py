"""`slurmguard bench agent` (issue 17.5): the loaded agent really watches the
writer's rings (its Slurm view says the job runs on its node), and the bench
prints the loaded agent beside the idle baseline."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from slurmguard_dev.bench.agent import JOB_ID, make_agent, write_rings


def _policy(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    os.chmod(secret, 0o600)
    policy = tmp_path / "policies.yaml"
    policy.write_text(f"agent:\n  secret_file: {secret}\n")
    return policy


def test_bench_agent_trusts_the_writers_rings_through_its_slurm_view(tmp_path):
    root = tmp_path / "rings"
    root.mkdir()
    write_rings(str(root), "benchnode", JOB_ID, ranks=3, collectives=8, step_s=0.04, stop_after_s=1.5)
    policy = _policy(tmp_path)
    loaded = make_agent("benchnode", "http://127.0.0.1:9", str(policy), str(root), JOB_ID)
    rep = loaded.build_report()
    assert [j.job_id for j in rep.jobs] == [JOB_ID]
    assert [r.rank for r in rep.jobs[0].ranks] == [0, 1, 2]
    assert all(r.steps for r in rep.jobs[0].ranks)  # analysed, not only listed
    # the same rings without the job in the agent's Slurm view: nothing is read
    blind = make_agent("benchnode", "http://127.0.0.1:9", str(policy), str(root), None)
    assert blind.build_report().jobs == []
    loaded.tracker.close()


@pytest.mark.slow
def test_bench_agent_prints_loaded_and_idle_rows():
    """About 25 s: the real bench, small and short."""
    exe = Path(sys.executable).with_name("slurmguard")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "slurmguard.cli"]
    out = subprocess.run(
        [
            *cmd,
            "bench",
            "agent",
            "--duration",
            "5",
            "--warmup",
            "1",
            "--ranks",
            "2",
            "--collectives",
            "16",
            "--step-s",
            "0.5",
            "--report-interval",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    rows = {line.split("  ")[0]: line.split() for line in out.stdout.splitlines()}
    loaded = rows["2 ranks, 16 coll/step"]
    idle = rows["idle (no rings), baseline"]
    # ..., CPU %, peak RSS MB, reports, ranks analysed, ops per iteration found
    assert loaded[-2] == "2" and idle[-2] == "0"  # ranks analysed
    assert all(int(p) > 0 for p in loaded[-1].split(",")) and idle[-1] == "-"
    assert float(loaded[-5]) >= 0 and float(loaded[-4]) > 10  # CPU %, peak RSS MB
    assert "target: <= 1% of one core, <= 100 MB" in out.stdout


def test_replay_reads_and_analyses_the_same_rings_every_run(capsys):
    """A few seconds: the deterministic replay finds the same iterations twice
    and times each part."""
    import json

    from slurmguard_dev.bench.agent import replay

    runs = []
    for _ in range(2):
        replay(ranks=2, collectives=16, step_s=0.05, polls=3, poll_steps=10)
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["periods"] == runs[1]["periods"]
    assert runs[0]["periods"][-1] and all(p > 0 for p in runs[0]["periods"][-1])  # iterations found
    assert set(runs[0]["ms_per_poll"]) == {"read", "analysis", "detector"}
    assert all(v >= 0 for v in runs[0]["ms_per_poll"].values())
