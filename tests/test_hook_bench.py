"""`slurmguard bench hook` runs end to end (small sizes, no cluster) and
reports figures that hang together; the targets themselves are checked by
running the benchmark, not here."""

from __future__ import annotations

import json
import subprocess

import pytest

from slurmguard_dev.bench.hook import CallCost, ExitRace, StepCost, TorchCallCost, report

pytestmark = pytest.mark.slow


def test_bench_hook_small_run(spank_build):
    res = subprocess.run(
        [
            "slurmguard",
            "bench",
            "hook",
            "--no-cluster",
            "--calls",
            "200000",
            "--rounds",
            "2",
            "--repeats",
            "1",
            "--torch-calls",
            "100",
            "--torch-blocks",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    cpu = out["nccl"]["cpu_ns"]
    assert set(cpu) == {"base", "hook", "passthrough", "reference"}
    assert all(v > 0 for v in cpu.values())
    # recording costs more than forwarding alone, and forwarding more than nothing
    assert cpu["hook"] > cpu["passthrough"] >= 0.5 * cpu["base"]
    assert out["nccl"]["added_cpu_ns"]["hook"] == pytest.approx(cpu["hook"] - cpu["base"])
    torch_ = out["torch"]
    assert torch_["hooked_us"] > 0 and torch_["plain_us"] > 0 and torch_["ranks"] == 2
    # added = median of the 2 neighbouring on/off block differences
    assert torch_["paired_us"]["thread"][1] <= torch_["added_us"] <= torch_["paired_us"]["thread"][2]
    # recorded: the 200 warm-up calls and the 2 hooked blocks of 10 + 100
    # calls; the blocks with the hook removed leave no records
    assert torch_["records"] == 200 + 2 * 110
    assert torch_["lost"] == 0  # every hooked call's record is in the ring
    assert "step" not in out


def test_report_lines():
    c = CallCost(
        calls_per_round=10,
        rounds=3,
        runs=5,
        clocksource="tsc",
        cpu_ns={"base": 8.0, "hook": 58.0, "passthrough": 10.0, "reference": 70.0},
        wall_ns={"base": 9.0, "hook": 60.0, "passthrough": 11.0, "reference": 75.0},
    )
    t = TorchCallCost(
        ranks=2,
        calls=100,
        blocks=8,
        thread_us={"plain": 15.0, "hooked": 45.0},
        process_us={"plain": 20.0, "hooked": 60.0},
        wall_us={"plain": 30.0, "hooked": 80.0},
        records=400,
    )
    s = StepCost(
        iters=300,
        pairs=3,
        compute_ms=80.0,
        collectives_per_step=2.0,
        guarded_ms=80.4,
        unguarded_ms=80.0,
        guarded_runs_ms=[80.8, 80.4, 81.0],
        unguarded_runs_ms=[80.0, 80.4, 81.0],
        steps_used=850,
        ci_pct=(-0.1, 0.9),
    )
    text = report(c, t, s)
    assert "added by the hook: 50.0 ns per call (meets target <= 60 ns)" in text
    assert "the reference shim adds 62.0 ns" in text
    assert "added per call *        +30.0         +40.0    +50.0" in text
    t.paired_us = {"thread": [28.0, 25.0, 33.0], "process": [41.0, 30.0, 50.0], "wall": [49.0, 20.0, 70.0]}
    text2 = report(None, t, s)
    assert "added per call *        +28.0         +41.0    +49.0" in text2
    assert "quartiles: thread +25.0 .. +33.0   process +30.0 .. +50.0   wall +20.0 .. +70.0" in text2
    assert "2.0 collective(s) x 28.0 us = 56.0 us = 0.070% of a step" in text2
    assert "overhead +0.50% (95% interval -0.10% .. +0.90%; meets target < 1%)" in text
    assert "per pair: +1.00%, +0.00%, +0.00%" in text
    s.aborted, s.lost = {"guarded": 1, "unguarded": 2}, 3
    assert (
        "jobs: 3 guarded, 3 unguarded; aborted in teardown (pytorch issue 190489): "
        "guarded 1, unguarded 2; guarded rings: 3 records lost"
    ) in report(None, None, s)
    assert "2.0 collective(s) x 30.0 us = 60.0 us = 0.075% of a step" in text


def test_report_exit_race_and_lost_records():
    t = TorchCallCost(
        ranks=2,
        calls=100,
        blocks=8,
        thread_us={"plain": 15.0, "hooked": 45.0},
        process_us={"plain": 20.0, "hooked": 60.0},
        wall_us={"plain": 30.0, "hooked": 80.0},
        records=400,
        lost=2,
    )
    e = ExitRace(
        runs=100,
        shape="ddp",
        ending="destroy",
        aborts={"guarded": 3, "unguarded": 5},
        failures={"guarded": 0, "unguarded": 1},
        lost=0,
        p_value=0.86,
        examples=["unguarded run 7: rank 1: exit status 1"],
    )
    text = report(None, t, None, e=e)
    assert "(400 allreduce records in rank 0's ring, 2 lost)" in text
    assert (
        "aborted at finalisation (pytorch issue 190489): guarded 3/100 (3.0%), unguarded 5/100 (5.0%)"
    ) in text
    assert "p = 0.860, no evidence that the hook raises it" in text
    assert "other failures: guarded 0, unguarded 1; guarded rings: 0 records lost" in text
    assert "  unguarded run 7: rank 1: exit status 1" in text
    e.aborts, e.p_value = {"guarded": 20, "unguarded": 2}, 0.0001
    assert "the hook RAISES it" in report(None, None, None, e=e)


def test_fisher_one_sided():
    from slurmguard.hook.exits import fisher_greater

    assert fisher_greater(2, 100, 1, 100) > 0.4  # the 2/10 vs 1/10 scale: no evidence
    assert fisher_greater(20, 100, 2, 100) < 0.001
    assert fisher_greater(0, 100, 10, 100) == 1.0
