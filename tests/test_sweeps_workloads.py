"""CPU smoke tests of the real sweep workloads (torch on CPU, gloo over loopback).

Small sizes and sub-second GEMMs: the machine is shared. Faults come from the
documented injection knob, keyed by node name, exactly as in the demo.
"""

import json
import re

import pytest

from slurmguard.config import SweepPolicy
from slurmguard.sweeps.baseline import baseline_for
from slurmguard.sweeps.local import run_node_local, run_pair_local
from slurmguard.sweeps.result import load_result, parse_result
from slurmguard.sweeps.verdict import (
    JobOutcome,
    Outcome,
    ReferenceStatus,
    judge_job,
    judge_multi,
    judge_result,
)
from slurmguard_dev.sweepfaults import launcher

POL = SweepPolicy()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """The workloads run by the development tools' fault launcher, which reads the
    SLURMGUARD_SWEEP_INJECT each test passes (the product's own run never injects)."""
    return POL.model_copy(update={"python": str(launcher(tmp_path_factory.mktemp("faults") / "python"))})


SMALL = [
    "--device",
    "cpu",
    "--duration",
    "0.3",
    "--gemm-size",
    "96",
    "--dtypes",
    "float32,bfloat16",
    "--membw-bytes",
    str(2 << 20),
    "--message-sizes-mb",
    "1",
    "--repeats",
    "3",
    "--threads",
    "1",
    "--comm-timeout",
    "60",
]


def test_node_sweep_cpu_two_devices_with_slowed_gpu(tmp_path, faulty):
    out = tmp_path / "node.json"
    # a strong fault: on a loaded 2-core machine the twin's own speed varies 2-3x
    inject = json.dumps({"node3": {"gemm_slowdown": 0.85, "gpus": [1]}})
    res = run_node_local(
        str(out),
        "node3",
        SMALL + ["--cpu-devices", "2"],
        faulty,
        timeout_s=180,
        env={"SLURMGUARD_SWEEP_INJECT": inject},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    r = load_result(str(out))
    assert (r.kind, r.nodes, r.device, r.devices_per_node) == ("node", ("node3",), "cpu", 2)
    assert [g.dtype for g in r.devices[0].gemm] == ["float32", "bfloat16"]
    assert all(d.membw_gbps and d.membw_gbps > 0 for d in r.devices)
    assert {(c.src, c.dst) for c in r.p2p} == {(0, 1), (1, 0)}
    assert [(a.scope, a.size_mb, a.ranks) for a in r.allreduce] == [("intra", 1, 2)]
    assert r.allreduce[0].busbw_gbps == pytest.approx(r.allreduce[0].algbw_gbps)  # 2(n-1)/n = 1
    assert r.injected == {
        "node3": json.loads(inject)["node3"]
        | {
            "membw_slowdown": 0.0,
            "p2p_slowdown": 0.0,
            "link_slowdown": 0.0,
            "link_direction": "both",
            "crash": False,
            "hang_s": 0.0,
            "corrupt_output": False,
            "gemm_corrupt": False,
        }
    }
    # 85% slower by injection: well below its twin even on a noisy shared CPU
    g0, g1 = (d.gemm[0].tflops for d in r.devices)
    assert g1 < 0.6 * g0
    # the node's own GPUs are the reference when two or more are compared: with two,
    # the median is their mean, so 0.15 of its twin reads about -74%
    v = judge_result(r, None, POL.model_copy(update={"peer_min_devices": 2}), suspected=False)
    assert v.outcome is Outcome.FAIL
    assert re.match(r"slurmguard: sweep1 gpu1 gemm_(fp32|bf16) -[2-9]\d% vs node", v.reason), v.reason
    assert {c.key for c in v.failures} >= {"gemm_float32/gpu1", "gemm_bfloat16/gpu1"}


def test_pair_sweep_names_the_link_slowed_node_under_test(tmp_path, faulty):
    healthy_out, slow_out = tmp_path / "healthy.json", tmp_path / "slow.json"
    rs = run_pair_local(str(healthy_out), ["node2", "node1"], SMALL, POL, timeout_s=180)
    assert [r.returncode for r in rs] == [0, 0], [r.stderr[-1500:] for r in rs]
    healthy = load_result(str(healthy_out))
    assert (healthy.kind, healthy.node_under_test, healthy.reference) == ("pair", "node2", "node1")
    assert {(t.src_node, t.dst_node) for t in healthy.transfers} == {("node2", "node1"), ("node1", "node2")}
    assert [(a.scope, a.ranks) for a in healthy.allreduce] == [("cross", 2)]

    inject = json.dumps({"node2": {"link_slowdown": 0.9}})
    rs = run_pair_local(
        str(slow_out),
        ["node2", "node1"],
        SMALL,
        faulty,
        timeout_s=180,
        env={"SLURMGUARD_SWEEP_INJECT": inject},
    )
    assert [r.returncode for r in rs] == [0, 0], [r.stderr[-1500:] for r in rs]
    text = slow_out.read_text()
    slow = parse_result(json.loads(text))
    # a slowed link reads slow from both ends: the measurement alone cannot tell who
    by_dir = {(t.src_node, t.dst_node): t.gbps for t in slow.transfers}
    assert by_dir[("node2", "node1")] < 0.6 * max(t.gbps for t in healthy.transfers)
    # ...so the class baseline (healthy pairs of other nodes with the same reference) and a
    # trusted reference pin it on the node under test
    doc = json.loads(healthy_out.read_text())
    hist = []
    for n in ("node3", "node4", "node5"):
        d = json.loads(json.dumps(doc).replace('"node2"', f'"{n}"'))
        hist.append(parse_result(d))
    v = judge_job(
        JobOutcome("COMPLETED", 0, text, str(slow_out)),
        kind="pair",
        node="node2",
        baseline=baseline_for(slow, hist),
        policy=POL,
        reference="node1",
        ref_status=ReferenceStatus("node1", True, "passed its own sweep"),
    )
    assert v.outcome is Outcome.FAIL and v.node == "node2"
    # the node under test's GPU 0 link, both directions, and the all-reduce over it
    assert {c.key for c in v.failures} >= {"send/gpu0/1MB", "recv/gpu0/1MB"}
    assert v.reason.startswith("slurmguard: sweep2 ") and "vs class" in v.reason
    assert "node1" not in v.reason


def test_crashed_and_corrupt_sweeps_fail(tmp_path, faulty):
    out = tmp_path / "crash.json"
    res = run_node_local(
        str(out),
        "node4",
        SMALL,
        faulty,
        timeout_s=120,
        env={"SLURMGUARD_SWEEP_INJECT": '{"node4": {"crash": true}}'},
    )
    assert res.returncode == 3 and not out.exists()
    v = judge_job(
        JobOutcome("FAILED", res.returncode, None, str(out)),
        kind="node",
        node="node4",
        baseline=None,
        policy=POL,
    )
    assert v.outcome is Outcome.FAIL and v.reason == "slurmguard: sweep1 crashed (FAILED exit 3)"

    out = tmp_path / "corrupt.json"
    res = run_node_local(
        str(out),
        "node4",
        SMALL,
        faulty,
        timeout_s=120,
        env={"SLURMGUARD_SWEEP_INJECT": '{"node4": {"corrupt_output": true}}'},
    )
    assert res.returncode == 0
    v = judge_job(
        JobOutcome("COMPLETED", 0, out.read_bytes(), str(out)),
        kind="node",
        node="node4",
        baseline=None,
        policy=POL,
        suspected=False,
    )
    assert v.outcome is Outcome.FAIL and v.reason.startswith("slurmguard: sweep1 bad result: invalid JSON")


def test_the_product_workload_cannot_be_told_to_fake_a_fault(tmp_path, faulty):
    # the variables the development launcher reads do nothing to the product's own run
    out = tmp_path / "node.json"
    res = run_node_local(
        str(out),
        "node4",
        SMALL,
        POL,
        timeout_s=120,
        env={"SLURMGUARD_SWEEP_INJECT": '{"node4": {"crash": true}}'},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert load_result(str(out)).injected is None
    # and the launcher refuses a bad fault spec with one line naming it, before measuring
    res = run_node_local(
        str(tmp_path / "x.json"),
        "node4",
        SMALL,
        faulty,
        timeout_s=120,
        env={"SLURMGUARD_SWEEP_INJECT": '{"node4": {"crash": 1}}'},
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "slurmguard sweep: SLURMGUARD_SWEEP_INJECT: node4.crash: expected true or false, got 1"
    )


def test_bad_options_are_one_line_errors(tmp_path):
    res = run_node_local(str(tmp_path / "x.json"), "node4", ["--dtypes", "float8"], POL, timeout_s=120)
    assert res.returncode == 2
    assert (
        res.stderr.strip()
        == "slurmguard sweep: error: unknown GEMM dtype 'float8' (known: float32, tf32, bfloat16, float16)"
    )


@pytest.mark.slow
def test_three_node_pass_sweep_localizes_the_slow_node(tmp_path, faulty):
    out = tmp_path / "multi.json"
    rs = run_pair_local(
        str(out),
        ["n0", "n1", "n2"],
        SMALL,
        faulty,
        timeout_s=240,
        env={"SLURMGUARD_SWEEP_INJECT": '{"n1": {"link_slowdown": 0.9}}'},
    )
    assert [r.returncode for r in rs] == [0, 0, 0], [r.stderr[-1500:] for r in rs]
    r = load_result(str(out))
    assert r.kind == "multi" and r.label == "sweep3" and r.reference is None
    # odd ring: 3 passes; tree over 3 ranks: children 1 and 2 (left/right at level 1)
    assert {(t.schedule, t.pass_index, t.src_node, t.dst_node) for t in r.transfers} == {
        ("ring", 0, "n0", "n1"),
        ("ring", 1, "n1", "n2"),
        ("ring", 2, "n2", "n0"),
        ("tree", 0, "n1", "n0"),
        ("tree", 1, "n2", "n0"),
    }
    verdicts = {v.node: v for v in judge_multi(r, POL.model_copy(update={"pass_tolerance": 0.4}))}
    assert verdicts["n1"].outcome is Outcome.FAIL and "link n1-" in verdicts["n1"].reason
    assert verdicts["n0"].outcome is Outcome.PASS and verdicts["n2"].outcome is Outcome.PASS


def test_silent_data_corruption_fails_the_sweep(tmp_path, faulty):
    """One wrong element per verified product (gemm_corrupt): the float64 reference check
    catches it, the sweep reports an error and the verdict fails with it."""
    out = tmp_path / "node.json"
    fp32 = ["float32" if a == "float32,bfloat16" else a for a in SMALL]
    res = run_node_local(
        str(out),
        "node3",
        fp32,
        faulty,
        timeout_s=180,
        env={"SLURMGUARD_SWEEP_INJECT": '{"node3": {"gemm_corrupt": true}}'},
    )
    assert res.returncode == 1, res.stderr[-2000:]
    r = load_result(str(out))
    [g] = r.devices[0].gemm
    assert g.checks >= 1 and g.max_error > 1.0
    assert r.errors[0].where == "gemm float32 gpu0"
    assert r.errors[0].message.startswith("wrong result (silent data corruption): error ")
    v = judge_result(r, None, POL, suspected=False)
    assert v.outcome is Outcome.FAIL
    assert v.reason.startswith("slurmguard: sweep1 error in gemm float32 gpu0: wrong result (silent")
    # a healthy run verifies every window and stays well inside the rounding bound
    ok = tmp_path / "ok.json"
    assert run_node_local(str(ok), "node3", SMALL, POL, timeout_s=180).returncode == 0  # fp32 + bf16
    for g in load_result(str(ok)).devices[0].gemm:
        assert g.checks >= 1 and g.max_error < 0.5, g
    assert load_result(str(ok)).devices[0].telemetry["source"] in ("cgroup", "none")


def test_pair_sweep_runs_ib_write_bw_per_hca_between_the_two_nodes(tmp_path):
    """The ib_write_bw stage on two real processes meeting through the sweep's store: the
    reference runs the server of each HCA, the node under test the client; a stand-in
    ib_write_bw prints perftest's recorded table (client) or waits (server)."""
    import os
    import stat
    from pathlib import Path

    fix = Path(__file__).parent / "fixtures" / "sweep_tools" / "ib_write_bw_ndr_gbits.txt"
    tool = tmp_path / "bin" / "ib_write_bw"
    tool.parent.mkdir()
    log = tmp_path / "calls"
    # server: ib_write_bw -d HCA -p PORT --report_gbits -F ; client: the same + server host
    tool.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\nif [ "$#" -eq 6 ]; then sleep 0.5; exit 0; fi\ncat {fix}\n'
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    policy = tmp_path / "policy.yaml"
    policy.write_text("sweeps:\n  stages:\n    ib_hcas: [mlx5_0, mlx5_1]\n    ib_port_base: 19515\n")
    out = tmp_path / "pair.json"
    env = {"PATH": f"{tool.parent}:{os.environ['PATH']}"}
    rs = run_pair_local(
        str(out), ["node2", "node1"], SMALL + ["--policy", str(policy)], POL, timeout_s=180, env=env
    )
    assert [r.returncode for r in rs] == [0, 0], [r.stderr[-1500:] for r in rs]
    [st] = load_result(str(out)).stages
    assert (st.name, st.status) == ("ib_write_bw", "pass"), st
    assert st.figures["mlx5_0/avg_gbps"] == pytest.approx(392.17 / 8)
    assert st.figures["mlx5_1/avg_gbps"] == pytest.approx(392.17 / 8)
    calls = sorted(log.read_text().splitlines())
    assert (
        sum(1 for c in calls if c.startswith("-d mlx5_0 -p 19515 --report_gbits -F")) == 2
    )  # server + client
    assert any(c.startswith("-d mlx5_1 -p 19516") and len(c.split()) == 7 for c in calls)
