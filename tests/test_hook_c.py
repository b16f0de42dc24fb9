"""The C side's own tests (spank_plugin/tests): ring protocol under
concurrency, the hook against the fake libnccl (counts, sizes, results,
return codes, hold), CUDA-event GPU timing against the fake CUDA runtime
(test_hook_cuda), the NCCL profiler plugin driven by a fake NCCL core
(test_profiler), missing NCCL and missing symbols, the plugin's
argument/option/path rules and ring directory ownership, exported symbols
and hardening; everything once plain and once under ASan/UBSan."""

from __future__ import annotations

import os
import subprocess

from tests.fixtures.hook import SPANK_DIR

C_TESTS = ("test_args", "test_ring", "test_clock", "test_hook", "test_hook_cuda", "test_old",
           "test_nolib", "test_profiler (interface <= v6)", "test_profiler (interface <= v5)",
           "test_profiler (interface <= v4)", "test_profiler (interface <= v3)")


def test_make_test_passes():
    res = subprocess.run(["make", "-C", str(SPANK_DIR), "-s", "test"], capture_output=True,
                         text=True, timeout=900)
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
    subprocess.run(["make", "-C", str(SPANK_DIR), "-s", "tests"], check=True, capture_output=True,
                   timeout=600)
    env = dict(os.environ, LD_PRELOAD=str(build / "libslurmguard_nccl.so"))
    res = subprocess.run([str(build / "tests" / "test_hook")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("slurmguard:")]
    assert lines == ["slurmguard: GPU timing of NCCL calls off: no CUDA runtime loaded in this "
                     "process; host times only from now on"]
