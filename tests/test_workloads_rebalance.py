"""The ddp workload's gradient accumulation under slurmguard's rebalance plan
(python -m slurmguard.workloads ddp --accum M): every rank switches to rank 0's
plan at the same step, and the training is the uniform split's whatever the plan
(the same micro-batches, each loss weighted dp_size / M)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from slurmguard.mitigate.client import PlanPoller
from slurmguard.mitigate.plan import JobPlan
from slurmguard.workloads.rebalance import Shares

REPO = Path(__file__).resolve().parents[1]


class _Source:
    """A plan client: the plan the controller serves now."""

    def __init__(self) -> None:
        self.plan: JobPlan | None = None
        self.fetches = 0

    def fetch(self) -> JobPlan | None:
        self.fetches += 1
        return self.plan


def _step(shares: list[Shares], step: int) -> None:
    """One step's flags all-reduce (a sum over the ranks), then every rank adopts."""
    summed = [sum(col) for col in zip(*(s.proposal(step) for s in shares))]
    for s in shares:
        s.adopt(summed)


def test_every_rank_switches_to_rank_zeros_plan_at_the_same_step():
    src = _Source()
    poller = PlanPoller(src, every_n_steps=2, dp_size=3, total=9)  # type: ignore[arg-type]
    ranks = [Shares(0, 3, 9, poller), Shares(1, 3, 9, None), Shares(2, 3, 9, None)]
    assert [s.share.count for s in ranks] == [3, 3, 3]
    _step(ranks, 0)
    assert [s.version for s in ranks] == [None] * 3  # no plan yet
    src.plan = JobPlan(job_id="7", version=4, microbatches=(5, 3, 1))
    _step(ranks, 1)  # not a request step: rank 0 has not asked yet
    assert [s.share.count for s in ranks] == [3, 3, 3]
    _step(ranks, 2)
    assert [(s.version, s.share.count, s.share.offset) for s in ranks] == [(4, 5, 0), (4, 3, 5), (4, 1, 8)]
    assert {s.share.loss_scale for s in ranks} == {3 / 9}
    # a plan for another size is refused (by the poller): the split stays
    src.plan = JobPlan(job_id="7", version=5, microbatches=(5, 5))
    _step(ranks, 4)
    assert [(s.version, s.share.count) for s in ranks] == [(4, 5), (4, 3), (4, 1)]
    assert poller.rejected == 1
    # the controller withdraws the rebalance: back to the uniform split
    src.plan = JobPlan(job_id="7", version=6, microbatches=None)
    _step(ranks, 6)
    assert [(s.version, s.share.count) for s in ranks] == [(6, 3), (6, 3), (6, 3)]
    assert src.fetches == 4  # steps 0, 2, 4, 6


def _serve_plan(body: dict) -> tuple[HTTPServer, str]:
    data = json.dumps(body).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path.endswith("/plan") else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def _train(tmp: Path, name: str, job: str, url: str | None) -> tuple[list[list[dict]], dict]:
    """A 2-rank ddp --accum 4 job on localhost; its step logs and final model."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = tmp / name
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SLURMGUARD_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", SLURM_JOB_ID=job)
        env["PYTHONPATH"] = str(REPO)
        if url:
            env["SLURMGUARD_CONTROLLER_URL"] = url
        argv = [sys.executable, "-m", "slurmguard.workloads", "ddp", "--steps", "6", "--accum", "4"]
        argv += ["--plan-every", "1", "--batch", "8", "--width", "32", "--hidden", "64", "--depth", "2"]
        argv += ["--ckpt-dir", str(ckpt), "--ckpt-every", "0"]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    logs = [[json.loads(x) for x in (ckpt / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]
    latest = (ckpt / "latest").read_text().strip()
    dcp_to_torch_save(str(ckpt / f"step-{latest}"), str(tmp / f"{name}.pt"))
    return logs, torch.load(tmp / f"{name}.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_a_rebalanced_job_trains_the_same_model_as_the_uniform_split(tmp_path):
    """~30 s: two 2-rank jobs, one without a controller (2 + 2 micro-batches),
    one whose controller serves the plan [3, 1] from the first request."""
    import torch

    uniform_logs, uniform = _train(tmp_path, "uniform", "9101", None)
    srv, url = _serve_plan({"job_id": "9102", "version": 1, "microbatches": [3, 1]})
    try:
        planned_logs, planned = _train(tmp_path, "planned", "9102", url)
    finally:
        srv.shutdown()
    assert [(e["microbatches"], e["plan"]) for e in uniform_logs[1]] == [(2, None)] * 6
    # asked at step 0, in force from step 1 on both ranks
    assert [(e["microbatches"], e["plan"]) for e in planned_logs[0]] == [(2, None)] + [(3, 1)] * 5
    assert [(e["microbatches"], e["plan"]) for e in planned_logs[1]] == [(2, None)] + [(1, 1)] * 5
    assert uniform.keys() == planned.keys()
    for k in uniform:
        assert torch.allclose(uniform[k], planned[k], atol=1e-5, rtol=1e-4), k
