"""GPU-path code that runs here too: the GEMM reference check, the NVML sampler of a sweep
(FakeNvml from slurmguard.telemetry), the cgroup throttling reader, nccl-tests' busbw."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweeps"))
import sweeplib as sl  # noqa: E402

from slurmguard.telemetry.fake_nvml import FakeNvml  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "telemetry" / "nvml_h100x8.json"


@pytest.mark.parametrize(
    "dtype,n", [("float32", 256), ("bfloat16", 256), ("float16", 128), ("float32", 1024)]
)
def test_verify_gemm_accepts_correct_products_and_catches_one_wrong_element(dtype, n):
    g = torch.Generator().manual_seed(7)
    t = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    a = torch.randn(n, n, generator=g).to(t)
    b = torch.randn(n, n, generator=g).to(t)
    c = a @ b
    assert sl.verify_gemm(a, b, c, dtype, seed=1) < 0.5
    rms = float(c.float().pow(2).mean().sqrt())
    bad = c.clone()
    bad[n // 2, n // 3] += 4 * rms  # a few times the typical element: far outside rounding
    assert sl.verify_gemm(a, b, bad, dtype, seed=1) > 1.0
    bad[0, 0] = float("nan")
    assert sl.verify_gemm(a, b, bad, dtype, seed=1) == math.inf


def test_busbw_factors_are_nccl_tests():
    assert sl.busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert sl.busbw_factor("all_gather", 8) == pytest.approx(0.875)
    assert sl.busbw_factor("send_recv", 2) == 1.0


def test_run_telemetry_samples_clocks_power_and_names_throttle_reasons():
    nv = FakeNvml.from_fixture(FIX)
    nv.devices[3]["clocks_event_reasons"] = 0x20 | 0x4  # sw thermal slowdown + sw power cap
    tel = sl.RunTelemetry("cuda", "node1", len(nv.devices), 0.02, nvml=nv).start()
    time.sleep(0.15)
    out = tel.stop()
    assert len(out) == len(nv.devices)
    t = out[3]
    assert t["source"] == "nvml" and t["samples"] >= 2
    assert t["sm_clock_mhz"]["min"] == nv.devices[3]["clock_sm_mhz"]
    assert t["power_w"]["median"] == pytest.approx(nv.devices[3]["power_usage_mw"] / 1000.0)
    assert t["throttle_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert sl.throttle_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]


def test_run_telemetry_without_nvml_is_recorded_not_fatal(monkeypatch):
    import slurmguard.telemetry.nvml as nvml_mod

    def broken():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml_mod, "load_pynvml", broken)
    out = sl.RunTelemetry("cuda", "node1", 2, 0.05).start().stop()
    assert out[0]["source"] == "none" and "NVML unavailable" in out[0]["error"]


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_cpu_stat_reads_the_throttled_ancestor(tmp_path, version):
    root = tmp_path / "cg"
    if version == 1:
        proc = "4:memory:/x\n2:cpu,cpuacct:/slurmguard-devcluster/abc-node3/job\n"
        base = root / "cpu"
        stat = "nr_periods 353\nnr_throttled 351\nthrottled_time 17817046724\n"
    else:
        proc = "0::/slurmguard-devcluster/abc-node3/job\n"
        base = root
        stat = "usage_usec 1\nnr_periods 353\nnr_throttled 351\nthrottled_usec 17817046\n"
    leaf = base / "slurmguard-devcluster" / "abc-node3" / "job"
    leaf.mkdir(parents=True)
    (leaf / "cpu.stat").write_text(stat.replace("353", "0").replace("351", "0"))  # no quota here
    (leaf.parent / "cpu.stat").write_text(stat)  # the node's cap
    (tmp_path / "cgroup").write_text(proc)
    st = sl.cgroup_cpu_stat(str(tmp_path / "cgroup"), str(root))
    assert st == {"nr_periods": 353.0, "nr_throttled": 351.0, "throttled_s": pytest.approx(17.817, abs=1e-3)}
