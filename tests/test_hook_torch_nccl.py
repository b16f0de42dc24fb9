"""NCCL-backed calls, functional collectives included, are left to the C
hook when it is loaded in the process, so nothing is recorded twice; the
torch hook still records the job's gloo (CPU) calls. Needs a GPU and torch
built with NCCL (skipped elsewhere); the job is
tests/fixtures/hook_nccl_job.py. The C hook is stood in for by naming the
real libnccl as SLURMGUARD_NCCL_HOOK: the torch hook only checks that the
named library is mapped. Measured on an H100 (torch 2.11.0+cu130, NCCL
2.28.9): about 15 s for both runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmguard.hook import ring

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
        reason="needs a GPU and NCCL",
    ),
]

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("fixtures") / "hook_nccl_job.py"


def run(rings: Path, c_hook: bool, site: Path) -> list[tuple]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", SLURMGUARD_RING_DIR=str(rings), SLURMGUARD_STEP_ID="0")
    if c_hook:
        env["SLURMGUARD_NCCL_HOOK"] = "libnccl.so.2"
    res = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "slurmguard:" not in res.stderr, res.stderr[-3000:]
    assert f'"nccl_hook_loaded": {str(c_hook).lower()}' in res.stdout, res.stdout
    with ring.RingReader(str(rings / "rank-0.step-0.torch.ring")) as r:
        return [(x.op_name, x.count) for x in r.read().records if x.op_name != "comm_init"]


def test_nccl_calls_left_to_the_c_hook_functional_ones_too(spank_build, tmp_path):
    # the CUDA tensors have 8 elements, the CPU ones 4: functional, then plain
    alone, beside = tmp_path / "alone", tmp_path / "beside-c-hook"
    alone.mkdir()
    beside.mkdir()
    site = spank_build.torch_site
    assert run(alone, False, site) == [("allreduce", 8)] * 2 + [("allreduce", 4)] * 2
    assert run(beside, True, site) == [("allreduce", 4)] * 2
