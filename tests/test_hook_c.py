"""The C side's own tests (spank_plugin/tests): ring protocol under
concurrency, the hook against the fake libnccl (counts, sizes, results,
return codes, hold), CUDA-event GPU timing against the fake CUDA runtime
(test_hook_cuda), the NCCL profiler plugin driven by a fake NCCL core
(test_profiler), missing NCCL and missing symbols, the plugin's
argument/option/path rules and ring directory ownership, exported symbols
and hardening; everything once plain and once under ASan/UBSan."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.hook import SPANK_DIR

C_TESTS = (
    "test_args",
    "test_ring",
    "test_clock",
    "test_hook",
    "test_hook_cuda",
    "test_old",
    "test_nolib",
    "test_profiler (interface <= v6)",
    "test_profiler (interface <= v5)",
    "test_profiler (interface <= v4)",
    "test_profiler (interface <= v3)",
    "test_profiler in flight (interface <= v6)",
    "test_profiler in flight (interface <= v5)",
    "test_profiler in flight (interface <= v4)",
)


def test_make_test_passes():
    res = subprocess.run(
        ["make", "-C", str(SPANK_DIR), "-s", "test"], capture_output=True, text=True, timeout=900
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for name in C_TESTS:
        # once in the plain build, once in the sanitizer build
        assert out.count(f"{name}: ") >= 2 and f"{name}: " in out.split("FAIL")[0], out[-4000:]
    assert "0 failed: OK" in out and "FAIL" not in out
    assert "spank_plugin: all C tests passed (plain and ASan/UBSan)" in out


def test_missing_cuda_runtime_is_one_stderr_line():
    """A process without a CUDA runtime (test_hook links only the fake
    NCCL): host timing goes on (test_hook's own checks), and the hook says
    so once, not once per call."""
    build = SPANK_DIR / "build"
    subprocess.run(
        ["make", "-C", str(SPANK_DIR), "-s", "tests"], check=True, capture_output=True, timeout=600
    )
    env = dict(os.environ, LD_PRELOAD=str(build / "libslurmguard_nccl.so"))
    res = subprocess.run(
        [str(build / "tests" / "test_hook")], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("slurmguard:")]
    assert lines == [
        "slurmguard: GPU timing of NCCL calls off: no CUDA runtime loaded in this "
        "process; host times only from now on"
    ]


@pytest.mark.slurm
def test_spank_sets_the_profiler_plugin_for_guarded_steps(devcluster, spank_build, tmp_path):
    """plugstack.conf names the profiler plugin: guarded steps get
    NCCL_PROFILER_PLUGIN (with the hook still preloaded, for NCCL < 2.27), a
    job's own profiler plugin is kept, an opted-out step gets neither."""
    prof = spank_build.hook.parent / "libslurmguard_nccl_profiler.so"
    root = Path(tempfile.mkdtemp(prefix="sg-prof-", dir="/dev/shm"))
    os.chmod(root, 0o755)
    out = tmp_path / "o.out"
    os.chmod(tmp_path, 0o1777)
    devcluster.set_plugstack(
        f"optional {spank_build.plugin} nccl_hook={spank_build.hook} "
        f"nccl_profiler={prof} ring_root={root}/rings\n"
    )
    script = textwrap.dedent("""\
        #!/bin/bash
        srun bash -c 'echo "step=${NCCL_PROFILER_PLUGIN:-none},${LD_PRELOAD:-none}"'
        srun --straggler-guard=off bash -c 'echo "optout=${NCCL_PROFILER_PLUGIN:-none}"'
        NCCL_PROFILER_PLUGIN=inspector srun bash -c 'echo "own=${NCCL_PROFILER_PLUGIN:-none}"'
        """)
    try:
        jid = devcluster.sbatch(script, "-o", str(out), "-N1", "--straggler-guard")
        state = devcluster.wait_job(jid, timeout=120)
    finally:
        devcluster.set_plugstack("")
        shutil.rmtree(root, ignore_errors=True)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", text
    lines = text.splitlines()
    assert f"step={prof},{spank_build.hook}" in lines
    assert "optout=none" in lines
    assert "own=inspector" in lines


def test_gpu_event_bench_report():
    """`slurmguard bench hook`'s CUDA-event part: added cost = events minus
    host-only timing in the same run, and its share of a 50 ms step with
    100 collectives, judged against both targets."""
    from slurmguard_dev.bench.hook import GpuCallCost, report

    g = GpuCallCost(
        calls_per_round=20000,
        rounds=3,
        runs=5,
        burst=100,
        cpu_ns={"base": 150.0, "host": 700.0, "events": 1100.0},
        wall_ns={"base": 170.0, "host": 1100.0, "events": 1700.0},
    )
    assert g.added_ns == pytest.approx(600.0) and g.added() == pytest.approx(400.0)
    assert g.step_pct == pytest.approx(100 * 600e-9 * 100 / 50e-3)
    text = report(None, None, None, g)
    assert "FAKE CUDA runtime" in text
    assert (
        "added by event timing over host timing: 600 ns per call wall (400 ns thread CPU) "
        "= 0.120% of a 50 ms step with 100 collectives (meets targets < 2 us per call, "
        "< 1% of the step)"
    ) in text
    g.wall_ns["events"] = 4000.0
    assert "(MISSES targets" in report(None, None, None, g)
