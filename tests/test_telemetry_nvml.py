"""NVML source against the fake pynvml built from NVML's documented API."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pynvml
import pytest

from slurmguard.clock import FakeClock
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


def test_not_supported_means_signal_absent():
    src = NvmlSource("gpu07", FakeNvml(_devices()), clock=FakeClock())
    r = src.sample()
    assert (7, Signal.PCIE_REPLAY) not in {(s.gpu, s.signal) for s in r.samples}
    assert (6, Signal.PCIE_REPLAY) in {(s.gpu, s.signal) for s in r.samples}
    ev = [e for e in r.events if e.kind == "unsupported"]
    assert len(ev) == 1 and ev[0].gpu == 7
    assert not [e for e in src.sample().events if e.kind == "unsupported"]  # reported once


def test_gpu_lost_is_a_hard_failure():
    devs = _devices()
    devs[4]["lost"] = True
    src = NvmlSource("gpu07", FakeNvml(devs), clock=FakeClock())
    r = src.sample()
    assert [s.value for s in r.samples if s.gpu == 4] == [1.0]
    assert [s.signal for s in r.samples if s.gpu == 4] == [Signal.GPU_LOST]
    assert any(e.kind == "hard_failure" and e.gpu == 4 and "GPU_IS_LOST" in e.detail for e in r.events)


def test_xid_events_arrive_through_the_event_set():
    fake = FakeNvml(_devices())
    src = NvmlSource("gpu07", fake, clock=FakeClock())
    assert not [s for s in src.sample().samples if s.signal == Signal.XID]
    fake.inject_xid(6, 79)
    fake.inject_xid(6, 48)
    xids = [(s.gpu, s.value) for s in src.sample().samples if s.signal == Signal.XID]
    assert xids == [(6, 79), (6, 48)]


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
