"""DCGM source against a DcgmReader stand-in that behaves as DCGM's own DcgmReader.py:

- GetLatestGpuValuesAsFieldIdDict() -> {gpu_id: {field_id: value}}, blank values
  (DCGM_INT64_BLANK and up, fp64 >= 2^47) dropped (ignoreBlank=True, its default);
- nv-hostengine gone: it catches DCGM_ST_CONNECTION_NOT_VALID, logs, disconnects
  (m_dcgmHandle = None) and returns {} - no exception reaches the caller;
- it reconnects on the next call once the host engine is back.
Values are the recorded 4x A100 node (tests/fixtures/telemetry/dcgm_latest_values.json).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from slurmguard.clock import FakeClock
from slurmguard.detect.peers import hard_failures
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.dcgm import DCGM_INT64_BLANK, DcgmSource

FIX = Path(__file__).parent / "fixtures" / "telemetry"


def recorded() -> dict[int, dict[int, float]]:
    vals = json.loads((FIX / "dcgm_latest_values.json").read_text())["values"]
    return {int(g): {int(f): v for f, v in d.items()} for g, d in vals.items()}


class FakeDcgmReader:
    def __init__(self, values: dict[int, dict[int, float]]) -> None:
        self.values = values
        self.hostengine_up = True
        self.m_dcgmHandle: object | None = object()

    def GetLatestGpuValuesAsFieldIdDict(self):  # noqa: N802 (DCGM's name)
        if not self.hostengine_up:
            self.m_dcgmHandle = None  # SetDisconnected(); the error is only logged
            return {}
        self.m_dcgmHandle = self.m_dcgmHandle or object()  # Reconnect()
        return {
            g: {f: v for f, v in d.items() if not (isinstance(v, (int, float)) and v >= DCGM_INT64_BLANK)}
            for g, d in copy.deepcopy(self.values).items()
        }


def source(values=None, unknown=(1523,), clock=None):
    """DCGM 3.3.5 as recorded: it does not know field 1523 (recovery action)."""
    reader = FakeDcgmReader(values or recorded())
    src = DcgmSource("a100-3", clock=clock or FakeClock(), reader_factory=lambda: (reader, list(unknown)))
    return src, reader


def _by(r):
    return {(s.gpu, s.signal): s.value for s in r.samples}


def test_recorded_values_units_and_profiling_fields():
    src, _ = source()
    r = src.sample()
    v = _by(r)
    assert (
        v[(2, Signal.SM_CLOCK)] == 1095
        and v[(2, Signal.GPU_TEMP)] == 84
        and v[(2, Signal.THERMAL_THROTTLE)] == 1
    )
    assert v[(0, Signal.POWER)] == pytest.approx(312.4)
    assert v[(2, Signal.TENSOR_ACTIVE)] == pytest.approx(0.318442)  # a ratio, not a percentage
    assert v[(0, Signal.SM_ACTIVE)] == pytest.approx(0.931204) and v[
        (0, Signal.DRAM_ACTIVE)
    ] == pytest.approx(0.381652)
    assert v[(3, Signal.REMAPPED_ROWS_COR)] == 2 and v[(3, Signal.ROW_REMAP_PENDING)] == 0
    # the field this DCGM does not know: unavailable once, for the node, naming it
    un = [e for e in r.events if e.kind == "unavailable"]
    assert [(e.signal, e.gpu) for e in un] == [(Signal.RECOVERY_ACTION, None)]
    assert "DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION (1523)" in un[0].detail
    assert not [e for e in src.sample().events if e.kind == "unavailable"]


def test_last_xid_field_flags_a_new_xid_once_not_every_sample():
    clock = FakeClock()
    src, reader = source(clock=clock)
    r = src.sample()
    # field 230 = the last XID, of unknown age when the source starts: noted, not flagged
    assert not [s for s in r.samples if s.signal == Signal.XID]
    assert [(e.kind, e.gpu) for e in r.events if "last XID 79" in e.detail] == [("info", 1)]
    reader.values[1][230] = 79
    reader.values[2][230] = 79  # a new XID on GPU 2
    clock.advance(10)
    assert [(s.gpu, s.value) for s in src.sample().samples if s.signal == Signal.XID] == [(2, 79)]
    for _ in range(3):
        clock.advance(10)
        r = src.sample()
        assert not [s for s in r.samples if s.signal == Signal.XID]  # still 79: no new XID
        assert not hard_failures(r.samples)
    reader.values[1][230] = 48  # a different XID arrives
    clock.advance(10)
    assert [(s.gpu, s.value) for s in src.sample().samples if s.signal == Signal.XID] == [(1, 48)]


def test_dead_hostengine_is_an_error_not_no_data():
    clock = FakeClock()
    src, reader = source(clock=clock)
    src.sample()
    reader.hostengine_up = False
    clock.advance(10)
    r = src.sample()
    assert r.samples == []
    assert [e.kind for e in r.events] == ["error", "unavailable"]
    assert "nv-hostengine unreachable" in r.events[0].detail and r.events[1].signal == "source"
    clock.advance(10)
    assert [e.kind for e in src.sample().events] == ["error"]  # unavailable reported once
    reader.hostengine_up = True  # back: DcgmReader reconnects
    clock.advance(10)
    r = src.sample()
    assert r.samples and [(e.kind, e.signal) for e in r.events] == [("available", "source")]


def test_hostengine_down_at_start_then_up():
    calls = []
    reader = FakeDcgmReader(recorded())

    def factory():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("DCGM_ST_CONNECTION_NOT_VALID: Host engine connection invalid/disconnected")
        return reader, []

    src = DcgmSource("a100-3", clock=FakeClock(), reader_factory=factory)
    r = src.sample()
    assert r.samples == [] and "cannot connect to nv-hostengine" in r.events[0].detail
    assert src.sample().samples  # retried, connected


def test_blank_field_is_unavailable_for_that_gpu_once_and_returns():
    vals = recorded()
    vals[3][204] = 9223372036854775794  # DCGM_INT64_NOT_SUPPORTED: DcgmReader drops it
    vals[2][1004] = 140737488355328.0  # DCGM_FP64_BLANK
    src, reader = source(vals)
    r = src.sample()
    v = _by(r)
    assert (3, Signal.MEM_UTIL) not in v and (2, Signal.MEM_UTIL) in v
    assert (2, Signal.TENSOR_ACTIVE) not in v
    un = {(e.gpu, e.signal) for e in r.events if e.kind == "unavailable" and e.gpu is not None}
    assert un == {(3, Signal.MEM_UTIL), (2, Signal.TENSOR_ACTIVE)}
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE (1004)" in next(e.detail for e in r.events if e.gpu == 2)
    reader.values[2][1004] = 0.31
    r = src.sample()
    assert [(e.kind, e.gpu, e.signal) for e in r.events] == [("available", 2, Signal.TENSOR_ACTIVE)]


def test_row_remap_and_recovery_action_fields_are_hard_failures():
    vals = recorded()
    vals[0][396] = 1  # DCGM_FI_DEV_ROW_REMAP_PENDING
    vals[1][395] = 1  # DCGM_FI_DEV_ROW_REMAP_FAILURE
    for g in vals:
        vals[g][1523] = 0
    vals[2][1523] = 1  # GPU reset required (DCGM 4 knows field 1523)
    src, _ = source(vals, unknown=())
    reasons = {(f.device, f.reasons[0]) for f in hard_failures(src.sample().samples)}
    assert reasons == {
        ("gpu0", "row remapping pending (GPU reset required)"),
        ("gpu1", "row remapping failed (uncorrectable memory, replace the GPU)"),
        ("gpu2", "recovery action required: GPU reset"),
    }


def test_without_bindings_is_reported_unavailable():
    def missing():
        raise ImportError("No module named 'DcgmReader'")

    src = DcgmSource("n", reader_factory=missing, clock=FakeClock())
    r = src.sample()
    assert r.samples == [] and "bindings not found" in r.events[0].detail
    assert [e.kind for e in r.events] == ["error", "unavailable"]
