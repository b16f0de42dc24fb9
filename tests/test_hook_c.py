"""The C side's own tests (spank_plugin/tests): ring protocol under
concurrency, the hook against the fake libnccl (counts, sizes, results,
return codes, hold), missing NCCL and missing symbols, the plugin's
argument/option/path rules and ring directory ownership, exported symbols
and hardening."""

from __future__ import annotations

import subprocess

from tests.fixtures.hook import SPANK_DIR


def test_make_test_passes():
    res = subprocess.run(["make", "-C", str(SPANK_DIR), "-s", "test"], capture_output=True,
                         text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    for name in ("test_args", "test_ring", "test_clock", "test_hook", "test_old", "test_nolib"):
        assert f"{name}: " in out and f"{name}: " in out.split("FAIL")[0], out[-4000:]
    assert "0 failed: OK" in out and "FAIL" not in out
    assert "spank_plugin: all C tests passed" in out
