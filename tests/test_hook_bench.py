"""`slurmguard bench hook` runs end to end (small sizes, no cluster) and
reports figures that hang together; the targets themselves are checked by
running the benchmark, not here."""

from __future__ import annotations

import json
import subprocess

import pytest

from slurmguard.hook.bench import CallCost, StepCost, TorchCallCost, report

pytestmark = pytest.mark.slow


def test_bench_hook_small_run(spank_build):
    res = subprocess.run(
        ["slurmguard", "bench", "hook", "--no-cluster", "--calls", "200000", "--rounds", "2",
         "--repeats", "1", "--torch-calls", "100", "--json"],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    cpu = out["nccl"]["cpu_ns"]
    assert set(cpu) == {"base", "hook", "passthrough", "reference"}
    assert all(v > 0 for v in cpu.values())
    # recording costs more than forwarding alone, and forwarding more than nothing
    assert cpu["hook"] > cpu["passthrough"] >= 0.5 * cpu["base"]
    assert out["nccl"]["added_cpu_ns"]["hook"] == pytest.approx(cpu["hook"] - cpu["base"])
    assert out["torch"]["hooked_us"] > 0 and out["torch"]["plain_us"] > 0
    assert "step" not in out


def test_report_lines():
    c = CallCost(calls_per_round=10, rounds=3, runs=5, clocksource="tsc",
                 cpu_ns={"base": 8.0, "hook": 58.0, "passthrough": 10.0, "reference": 70.0},
                 wall_ns={"base": 9.0, "hook": 60.0, "passthrough": 11.0, "reference": 75.0})
    t = TorchCallCost(calls=100, plain_us=15.0, hooked_us=45.0)
    s = StepCost(steps=40, pairs=3, params=1000, collectives_per_step=2.0, guarded_ms=50.25,
                 unguarded_ms=50.0, guarded_runs_ms=[50.5, 40.2, 61.0],
                 unguarded_runs_ms=[50.0, 40.0, 61.0])
    text = report(c, t, s)
    assert "added by the hook: 50.0 ns per call (meets target <= 60 ns)" in text
    assert "the reference shim adds 62.0 ns" in text
    assert "added 30.00 us" in text
    assert "overhead +0.50% (meets target < 1%)" in text
    assert "per pair: +1.0%, +0.5%, +0.0%" in text
    assert "2.0 collective(s) x 30.0 us = 60.0 us = 0.120% of a step" in text
