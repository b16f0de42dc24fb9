"""NVML source against the fake pynvml built from NVML's documented API."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pynvml
import pytest

from slurmguard.clock import FakeClock
from slurmguard.detect.peers import hard_failures
from slurmguard.telemetry.base import Deadline, Signal, SourceTimeout
from slurmguard.telemetry.fake_nvml import FakeNvml
from slurmguard.telemetry.nvml import NvmlSource

FIX = Path(__file__).parent / "fixtures" / "telemetry" / "nvml_h100x8.json"


def _devices():
    return json.loads(FIX.read_text())["devices"]


def test_values_and_units_from_recorded_h100_node():
    src = NvmlSource("gpu07", FakeNvml(_devices()), clock=FakeClock())
    r = src.sample()
    v = {(s.gpu, s.signal): s for s in r.samples}
    assert v[(0, Signal.GPU_TEMP)].value == 58 and v[(0, Signal.GPU_TEMP)].unit == "C"
    assert v[(0, Signal.SM_CLOCK)].value == 1980 and v[(0, Signal.SM_CLOCK)].unit == "MHz"
    assert v[(0, Signal.POWER)].value == pytest.approx(652.31) and v[(0, Signal.POWER)].unit == "W"  # from mW
    assert v[(2, Signal.GPU_UTIL)].value == 99
    assert v[(3, Signal.THROTTLE_REASONS)].value == 0x4 and v[(3, Signal.THERMAL_THROTTLE)].value == 0
    assert v[(5, Signal.ECC_SBE)].value == 12
    assert v[(1, Signal.NVLINK_ERRORS)].value == 2 and v[(1, Signal.NVLINK_DOWN)].value == 0
    assert len({s.gpu for s in r.samples}) == 8


def test_not_supported_is_reported_unavailable_once():
    src = NvmlSource("gpu07", FakeNvml(_devices()), clock=FakeClock())
    r = src.sample()
    assert (7, Signal.PCIE_REPLAY) not in {(s.gpu, s.signal) for s in r.samples}
    assert (6, Signal.PCIE_REPLAY) in {(s.gpu, s.signal) for s in r.samples}
    ev = {(e.gpu, e.signal) for e in r.events if e.kind == "unavailable"}
    # driver 550 has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: that field answers
    # NOT_SUPPORTED on every GPU, each reported once
    assert ev == {(7, Signal.PCIE_REPLAY)} | {(g, Signal.RECOVERY_ACTION) for g in range(8)}
    assert all(
        e.source == "nvml" and "Not Supported" in e.detail for e in r.events if e.kind == "unavailable"
    )
    assert not [e for e in src.sample().events if e.kind == "unavailable"]  # reported once


def test_one_unsupported_nvlink_counter_switches_off_only_that_counter():
    devs = _devices()
    devs[1]["nvlink"][4]["unsupported"] = ["crc_data"]  # the link that carries 2 CRC flit errors
    for link in devs[2]["nvlink"]:  # Hopper: no DL CRC counters at all
        link["unsupported"] = ["crc_flit", "crc_data"]
    devs[2]["nvlink"][7]["replay"] = 5
    fake = FakeNvml(devs)
    src = NvmlSource("gpu07", fake, clock=FakeClock())
    r = src.sample()
    v = {(s.gpu, s.signal): s.value for s in r.samples}
    assert v[(1, Signal.NVLINK_ERRORS)] == 2  # link 4's CRC flit count still read
    assert v[(2, Signal.NVLINK_ERRORS)] == 5  # replay/recovery of every link still read
    ev = {(e.gpu, e.signal): e.detail for e in r.events if e.kind == "unavailable" and "nvlink" in e.signal}
    assert sorted(ev) == [(1, "nvlink_crc_data"), (2, "nvlink_crc_data"), (2, "nvlink_crc_flit")]
    assert ev[(1, "nvlink_crc_data")] == (
        "GPU 1: NVLink crc_data not supported on link(s) 4; the other counters still count"
    )
    assert "link(s) 0-17;" in ev[(2, "nvlink_crc_flit")]  # one entry per counter, not per link
    fake.devices[1]["nvlink"][0]["crc_flit"] = 7
    v = {(s.gpu, s.signal): s.value for s in src.sample().samples}
    assert v[(1, Signal.NVLINK_ERRORS)] == 9  # other links of GPU 1 keep counting


def test_row_remapping_pending_failed_and_pre_ampere():
    devs = _devices()
    devs[2]["remapped_rows"] = {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
    devs[3]["remapped_rows"] = {"correctable": 3, "uncorrectable": 512, "pending": False, "failure": True}
    del devs[6]["remapped_rows"]  # a GPU without a row remapper
    src = NvmlSource("gpu07", FakeNvml(devs), clock=FakeClock())
    r = src.sample()
    v = {(s.gpu, s.signal): s.value for s in r.samples}
    assert v[(2, Signal.ROW_REMAP_PENDING)] == 1 and v[(2, Signal.REMAPPED_ROWS_UNC)] == 1
    assert v[(3, Signal.ROW_REMAP_FAILURE)] == 1 and v[(3, Signal.REMAPPED_ROWS_COR)] == 3
    assert v[(0, Signal.ROW_REMAP_PENDING)] == 0 and v[(0, Signal.ROW_REMAP_FAILURE)] == 0
    assert (6, Signal.ROW_REMAP_PENDING) not in v
    assert any(e.kind == "unavailable" and e.gpu == 6 and e.signal == "row_remapping" for e in r.events)
    flags = {(f.device, f.reasons) for f in hard_failures(r.samples)}
    assert ("gpu2", ("row remapping pending (GPU reset required)",)) in flags
    assert ("gpu3", ("row remapping failed (uncorrectable memory, replace the GPU)",)) in flags
    assert not any(d in ("gpu0", "gpu6") for d, _ in flags)


def test_xid_154_reads_the_recovery_action():
    devs = _devices()
    for d in devs:
        d["gpu_recovery_action"] = pynvml.NVML_GPU_RECOVERY_ACTION_NONE  # a driver with the field
    fake = FakeNvml(devs)
    src = NvmlSource("gpu07", fake, clock=FakeClock())
    r = src.sample()
    assert not [e for e in r.events if e.kind == "unavailable" and e.signal == Signal.RECOVERY_ACTION]
    assert not hard_failures(r.samples)
    fake.devices[5]["gpu_recovery_action"] = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    fake.inject_xid(5, 154)
    r = src.sample()
    assert [(s.gpu, s.value) for s in r.samples if s.signal == Signal.XID] == [(5, 154)]
    assert {s.value for s in r.samples if s.signal == Signal.RECOVERY_ACTION and s.gpu == 5} == {2}
    assert [(f.device, f.reasons) for f in hard_failures(r.samples)] == [
        ("gpu5", ("recovery action required: node reboot",))
    ]
    # the action back to none (XID 154 again): nothing to do
    fake.devices[5]["gpu_recovery_action"] = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    fake.inject_xid(5, 154)
    assert not hard_failures(src.sample().samples)


def test_gpu_lost_is_a_hard_failure():
    devs = _devices()
    devs[4]["lost"] = True
    src = NvmlSource("gpu07", FakeNvml(devs), clock=FakeClock())
    r = src.sample()
    assert [s.value for s in r.samples if s.gpu == 4] == [1.0]
    assert [s.signal for s in r.samples if s.gpu == 4] == [Signal.GPU_LOST]
    assert any(e.kind == "hard_failure" and e.gpu == 4 and "GPU_IS_LOST" in e.detail for e in r.events)


def test_xid_events_keep_their_gpu():
    fake = FakeNvml(_devices())
    src = NvmlSource("gpu07", fake, clock=FakeClock())
    assert not [s for s in src.sample().samples if s.signal == Signal.XID]
    fake.inject_xid(6, 79)
    fake.inject_xid(6, 48)
    fake.inject_xid(2, 13)
    # as with ctypes, the event's device is a new pointer object: neither == nor
    # id() matches the handle we hold, so the GPU must come from nvmlDeviceGetIndex
    ev_dev = fake._sets[0]["queue"][0].device
    assert ev_dev is not src._handles[6] and ev_dev != src._handles[6]
    xids = [(s.gpu, s.value) for s in src.sample().samples if s.signal == Signal.XID]
    assert xids == [(6, 79), (6, 48), (2, 13)]


def test_hung_nvml_call_becomes_a_timeout_event_not_a_hang():
    fake = FakeNvml(_devices(), hang={"nvmlDeviceGetPowerUsage"})
    src = NvmlSource("gpu07", fake, clock=FakeClock(), timeout_s=0.2)
    t0 = time.monotonic()
    r = src.sample()
    assert time.monotonic() - t0 < 3.0
    assert any(e.kind == "timeout" for e in r.events)
    fake.release()


def test_fake_follows_nvml_error_semantics():
    fake = FakeNvml(_devices())
    with pytest.raises(pynvml.NVMLError) as exc:
        fake.nvmlDeviceGetCount()
    assert exc.value.value == pynvml.NVML_ERROR_UNINITIALIZED
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)
    h = fake.nvmlDeviceGetHandleByIndex(7)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPcieReplayCounter(h)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(fake.nvmlEventSetCreate(), 0)


def test_init_failure_is_an_event():
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    r = NvmlSource("n", NoDriver(copy.deepcopy(_devices())), clock=FakeClock()).sample()
    assert r.samples == [] and r.events[0].kind == "error"


def test_deadline_fails_fast_while_an_earlier_call_is_stuck():
    import threading

    gate = threading.Event()
    d = Deadline(0.1)
    with pytest.raises(SourceTimeout):
        d.call(gate.wait)
    t0 = time.monotonic()
    with pytest.raises(SourceTimeout, match="still hung"):
        d.call(lambda: 1)
    assert time.monotonic() - t0 < 0.05
    gate.set()
    time.sleep(0.05)
    assert d.call(lambda: 7) == 7


def test_gpm_gives_the_profiling_ratios_from_the_second_sample():
    devs = _devices()
    devs[4]["gpm"] = {
        "sm_util_pct": 96.1,
        "any_tensor_util_pct": 33.9,
        "dram_bw_util_pct": 29.5,
    }  # the slow one
    del devs[7]["gpm"]  # a GPU without GPM (pre-Hopper)
    fake = FakeNvml(devs)
    clock = FakeClock()
    src = NvmlSource("gpu07", fake, clock=clock)
    r = src.sample()
    assert not [s for s in r.samples if s.signal == Signal.SM_ACTIVE]  # a metric needs two samples
    assert {(e.gpu, e.signal) for e in r.events if e.kind == "unavailable" and e.gpu == 7} >= {
        (7, Signal.SM_ACTIVE),
        (7, Signal.TENSOR_ACTIVE),
        (7, Signal.DRAM_ACTIVE),
    }
    clock.advance(10)
    v = {(s.gpu, s.signal): s for s in src.sample().samples}
    assert (
        v[(0, Signal.SM_ACTIVE)].value == pytest.approx(0.8745) and v[(0, Signal.SM_ACTIVE)].unit == "ratio"
    )
    assert v[(4, Signal.TENSOR_ACTIVE)].value == pytest.approx(0.339)
    assert v[(4, Signal.DRAM_ACTIVE)].value == pytest.approx(0.295)
    assert (7, Signal.SM_ACTIVE) not in v
    fake.devices[4]["gpm"]["any_tensor_util_pct"] = 50.0
    clock.advance(10)
    v = {(s.gpu, s.signal): s.value for s in src.sample().samples}
    assert v[(4, Signal.TENSOR_ACTIVE)] == pytest.approx(0.5)  # the samples alternate, in order


H200 = Path(__file__).parent / "data" / "gpu" / "h200-nccl2.28.9" / "nvml.jsonl"
#: signals that need two samples (a rate, or GPM's difference of two samples)
TWO_SAMPLE = {"ecc_dbe_new", "pcie_replay_rate", "sm_active", "tensor_active", "dram_active"}


def test_real_h200_samples_match_the_fakes_signals_units_and_timing():
    """NvmlSource on a real NVIDIA H200 (driver 580.159.04; three samples one
    second apart, idle GPU; tests/data/gpu/h200-nccl2.28.9/nvml.jsonl) against
    the same source over the fake: every signal the real GPU gave the fake
    gives too, in the same unit, and the two-sample signals appear from the
    second sample on, as on the real one. The real values are in the units
    the signals name (W, not NVML's mW; ratios, not percent)."""
    real = [json.loads(line) for line in H200.read_text().splitlines()]
    clock = FakeClock()
    src = NvmlSource("gpu07", FakeNvml(_devices()[:1]), clock=clock)
    fake = []
    for _ in real:
        fake.append({s.signal: s.unit for s in src.sample().samples if s.gpu == 0})
        clock.advance(1)
    for k, (r, f) in enumerate(zip(real, fake, strict=True)):
        units = {sig: unit for sig, gpu, _nic, _v, unit in r["samples"] if gpu == 0}
        assert not r["events"], r["events"]
        # the recovery action: NVML answers it on this driver, the fixture's does not
        assert {s: u for s, u in units.items() if s != "gpu_recovery_action"}.items() <= f.items(), k
        assert (TWO_SAMPLE & units.keys()) == (TWO_SAMPLE if k else set()) == (TWO_SAMPLE & f.keys())
        v = {sig: val for sig, gpu, _nic, val, _u in r["samples"] if gpu == 0}
        assert 20 <= v["power"] <= 1000 and 10 <= v["gpu_temp"] <= 100
        assert 100 <= v["sm_clock"] <= 2500 and 0 <= v["gpu_util"] <= 100
        assert all(0 <= v[s] <= 1 for s in ("sm_active", "tensor_active", "dram_active") if s in v)
