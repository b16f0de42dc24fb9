"""Standard tools as sweep stages: parsers on recorded outputs, and the stage runner's
handling of a missing, hanging, failing or garbled tool (real subprocesses)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from slurmguard.config import SweepPolicy, ToolStage
from slurmguard.sweeps import tools
from slurmguard.sweeps.result import parse_result
from slurmguard.sweeps.verdict import Outcome, judge_result
from tests.fixtures.sweeps import node_doc

FIX = Path(__file__).parent / "fixtures" / "sweep_tools"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def test_nccl_tests_busbw_per_size_and_average():
    p = tools.parse_nccl_tests(fixture("nccl_allreduce_h100x8.txt"))
    assert not p.failed
    assert p.figures["busbw_gbps/1024MB"] == 463.72 and p.figures["busbw_gbps/4096MB"] == 484.54
    assert p.figures["busbw_inplace_gbps/2048MB"] == 482.97
    assert p.figures["avg_busbw_gbps"] == 477.087
    # busbw = algbw * 2(n-1)/n with n = 8 (nccl-tests PERFORMANCE.md)
    assert pytest.approx(463.72, abs=0.01) == 264.98 * 2 * 7 / 8


def test_nccl_tests_wrong_values_fail_and_old_layout_parses():
    p = tools.parse_nccl_tests(fixture("nccl_allreduce_wrong.txt"))
    assert p.failed == ("12 wrong values at 1024MB", "out of bounds values: 12 FAILED")
    old = tools.parse_nccl_tests(fixture("nccl_allreduce_v100_old.txt"))  # no root, float error
    assert not old.failed and old.figures["busbw_gbps/1250MB"] == 1.11  # -b 1250M
    with pytest.raises(tools.ParseError, match="no result rows"):
        tools.parse_nccl_tests("# nThread 1 nGpus 8\n# Avg bus bandwidth    : 0\n")
    with pytest.raises(tools.ParseError, match="unexpected result row"):
        tools.parse_nccl_tests("  1024  256  float  sum  12.0  0.1\n")


def test_dcgm_diag_3x_pass_4x_hardware_fail_and_config_finding():
    p = tools.parse_dcgm_diag(fixture("dcgm3_diag_r1_pass.txt"))  # banner before the JSON
    assert not p.failed and not p.errors and p.figures["tests"] == 10
    p = tools.parse_dcgm_diag(fixture("dcgm4_diag_r2_memory_fail.json"))
    assert p.failed == (
        "memory gpu1: A memory mismatch was detected on GPU 1, but no error was reported by CUDA or NVML.",
    )
    p = tools.parse_dcgm_diag(fixture("dcgm4_diag_r1_persistence.json"))
    assert not p.failed and len(p.errors) == 1 and "Persistence mode for GPU 0 is disabled" in p.errors[0]
    for bad in ("", "Error: unable to establish a connection to the host engine", '{"tests": []}'):
        with pytest.raises(tools.ParseError):
            tools.parse_dcgm_diag(bad)
    with pytest.raises(tools.ParseError, match="unknown status 'Aborted'"):
        tools.parse_dcgm_diag(
            '{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware",'
            ' "tests": [{"name": "memory", "results": [{"entity_id": 0, "status": "Aborted"}]}]}]}}'
        )


def test_nvbandwidth_sums_and_smallest_pair():
    p = tools.parse_nvbandwidth(fixture("nvbandwidth_h100x8.txt"))
    assert p.figures["device_to_device_memcpy_read_ce/sum_gbps"] == 22126.64
    assert p.figures["device_to_device_memcpy_read_ce/min_gbps"] == 395.05
    assert p.figures["host_to_device_memcpy_ce/min_gbps"] == 54.02
    with pytest.raises(tools.ParseError):
        tools.parse_nvbandwidth("nvbandwidth Version: v0.10.0\nERROR: no CUDA device\n")


def test_ib_write_bw_units():
    p = tools.parse_ib_write_bw(fixture("ib_write_bw_ndr_gbits.txt"))
    assert p.figures["avg_gbps"] == pytest.approx(392.17 / 8) and p.figures["bytes"] == 65536
    p = tools.parse_ib_write_bw(fixture("ib_write_bw_roce_mbsec.txt"))  # MB/sec = MiB/s
    assert p.figures["avg_gbps"] == pytest.approx(11076.33 * 1048576 / 1e9)
    with pytest.raises(tools.ParseError, match="no result row"):
        tools.parse_ib_write_bw(
            " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
        )


@pytest.fixture
def fake_tool(tmp_path):
    """Write an executable script standing in for a tool (real subprocess, resolved path)."""

    def make(name: str, body: str) -> str:
        p = tmp_path / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
        return str(p)

    return make


def test_stage_statuses_from_real_subprocesses(fake_tool, tmp_path):
    out = fake_tool("all_reduce_perf", f"cat {FIX / 'nccl_allreduce_h100x8.txt'}\n")
    st = tools.run_stage(
        "nccl_all_reduce",
        ToolStage(command=out),
        ["-g", "8"],
        tools.parse_nccl_tests,
        min_key=r"busbw_gbps/.*",
    )
    assert (st.status, st.reason) == ("pass", "ok") and st.figures["busbw_gbps/4096MB"] == 484.54
    st = tools.run_stage(
        "nccl_all_reduce",
        ToolStage(command=out, min_gbps=470.0),
        [],
        tools.parse_nccl_tests,
        min_key=r"busbw_gbps/.*",
    )
    assert st.status == "fail" and st.reason == "busbw_gbps/1024MB 463.7 GB/s below 470"
    wrong = fake_tool("wrong", f"cat {FIX / 'nccl_allreduce_wrong.txt'}\nexit 1\n")
    st = tools.run_stage("nccl_all_reduce", ToolStage(command=wrong), [], tools.parse_nccl_tests)
    assert st.status == "fail" and "12 wrong values" in st.reason and "Avg bus bandwidth" in st.evidence
    dcgm = fake_tool("dcgmi", f"cat {FIX / 'dcgm4_diag_r1_persistence.json'}\nexit 226\n")
    st = tools.run_stage(
        "dcgm_diag", ToolStage(command=dcgm), ["diag", "-r", "1", "-j"], tools.parse_dcgm_diag
    )
    assert st.status == "error" and st.reason.startswith("configuration: software gpu0: Persistence Mode")
    garbled = fake_tool("garbled", "echo 'Segmentation fault (core dumped)'\nexit 139\n")
    st = tools.run_stage("nvbandwidth", ToolStage(command=garbled), [], tools.parse_nvbandwidth)
    assert st.status == "error" and st.reason.startswith("exit 139, unrecognised output")
    hang = fake_tool("hang", "echo starting\nexec sleep 30\n")
    st = tools.run_stage("nvbandwidth", ToolStage(command=hang, timeout_s=0.5), [], tools.parse_nvbandwidth)
    assert st.status == "error" and st.reason == "timed out after 0.5s" and st.seconds < 5
    missing = str(tmp_path / "not-installed")
    assert (
        tools.run_stage("dcgm_diag", ToolStage(command=missing), [], tools.parse_dcgm_diag).status
        == "skipped"
    )
    st = tools.run_stage("dcgm_diag", ToolStage(command=missing, run="required"), [], tools.parse_dcgm_diag)
    assert st.status == "error" and "not installed on this node (required)" in st.reason
    assert (
        tools.run_stage("dcgm_diag", ToolStage(command=out, run="never"), [], tools.parse_dcgm_diag).status
        == "skipped"
    )


def test_cpu_path_skips_gpu_tools_and_a_missing_tool_does_not_fail_the_node():
    sts = tools.node_stages(SweepPolicy().stages, gpus=1, device="cpu")
    assert [(s.name, s.status) for s in sts] == [
        ("dcgm_diag", "skipped"),
        ("nccl_all_reduce", "skipped"),
        ("nvbandwidth", "skipped"),
    ]
    assert all(s.reason.startswith("not applicable") for s in sts)


def _with_stage(status: str, reason: str):
    st = tools.StageOutcome("dcgm_diag", status, reason, 61.0, {"tests": 12.0}, "...").to_dict()
    return parse_result({**node_doc("node2"), "stages": [st]}, "t")


def test_verdict_failing_stage_fails_with_its_evidence_error_is_inconclusive():
    pol = SweepPolicy(floors=())
    v = judge_result(_with_stage("fail", "memory gpu1: A memory mismatch was detected on GPU 1"), None, pol)
    assert v.outcome is Outcome.FAIL
    assert (
        v.reason == "slurmguard: sweep1 dcgm_diag fail: memory gpu1: A memory mismatch was detected on GPU 1"
    )
    assert [c.key for c in v.failures] == ["stage/dcgm_diag"]
    v = judge_result(_with_stage("error", "timed out after 900s"), None, SweepPolicy())
    assert v.outcome is Outcome.INCONCLUSIVE and not v.outcome.returns_node
    assert v.reason == "slurmguard: sweep1 stage dcgm_diag error: timed out after 900s"
    assert (
        judge_result(_with_stage("skipped", "dcgmi: not installed"), None, SweepPolicy()).outcome
        is Outcome.PASS
    )  # judged by the H100 floor; the missing tool changes nothing
