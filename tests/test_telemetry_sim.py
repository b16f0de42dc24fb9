"""Sim telemetry: deterministic fault profiles that the peer scorer must catch."""

from __future__ import annotations

import numpy as np
import pytest

from slurmguard.clock import FakeClock
from slurmguard.detect.peers import PeerScorer
from slurmguard.errors import InputError
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.sim import SimTelemetrySource, parse_profiles

NODES = [f"node{i}" for i in range(1, 9)]


def _run(profiles, windows=4, seed=1):
    clock = FakeClock()
    src = SimTelemetrySource(NODES, profiles, seed=seed, clock=clock)
    ps = PeerScorer()
    readings, flags = [], []
    for _ in range(windows):
        clock.advance(30)
        r = src.sample()
        readings.append(r)
        flags.append(ps.window(r.samples))
    return readings, flags


def _vals(r, node, signal):
    return np.array([s.value for s in r.samples if s.node == node and s.signal == signal])


def test_same_seed_and_clock_give_the_same_samples():
    a, _ = _run({"node2": "thermal_throttle"}, 2)
    b, _ = _run({"node2": "thermal_throttle"}, 2)
    assert [s.to_dict() for s in a[1].samples] == [s.to_dict() for s in b[1].samples]
    c, _ = _run({"node2": "thermal_throttle"}, 2, seed=2)
    assert [s.value for s in c[1].samples] != [s.value for s in a[1].samples]


def test_thermal_throttle_matches_guard_table_2_and_is_flagged():
    readings, flags = _run({"node2": "thermal_throttle"})
    r = readings[-1]
    hot, ok = _vals(r, "node2", Signal.GPU_TEMP), _vals(r, "node3", Signal.GPU_TEMP)
    assert hot.min() >= 75 and ok.max() <= 66
    assert _vals(r, "node2", Signal.SM_CLOCK).mean() == pytest.approx(1380, abs=30)
    assert _vals(r, "node3", Signal.SM_CLOCK).mean() > 1950
    assert _vals(r, "node2", Signal.POWER).mean() < 0.9 * _vals(r, "node3", Signal.POWER).mean()
    assert _vals(r, "node2", Signal.GPU_UTIL).min() >= 98  # utilisation unchanged
    assert set(_vals(r, "node2", Signal.THERMAL_THROTTLE)) == {1.0}
    flagged = {f.node for f in flags[2]}
    assert flagged == {"node2"} and flags[0] == [] and flags[1] == []


def test_nic_down_reroutes_traffic_to_nic0():
    readings, flags = _run({"node5": {"profile": "nic_down", "nic": "mlx5_2:1"}})
    r = readings[-1]
    tx = {s.nic: s.value for s in r.samples if s.node == "node5" and s.signal == Signal.NIC_TX_GBPS}
    assert tx["mlx5_2:1"] == 0 and tx["mlx5_0:1"] == pytest.approx(2 * tx["mlx5_1:1"], rel=0.1)
    assert any(f.hard and f.node == "node5" and f.device == "mlx5_2:1" for f in flags[0])


def test_link_flap_error_burst_low_power_and_cpu_contention_are_caught():
    for prof, expect in (
        ("link_flap", "hard"),
        ("error_burst", "node"),
        ("low_power", "gpu"),
        ("cpu_contention", "gpu"),
    ):
        _, flags = _run({"node4": prof}, windows=5)
        hits = [f for fl in flags for f in fl if f.node == "node4"]
        assert hits, prof
        assert all(f.node == "node4" for fl in flags for f in fl), prof
        if expect == "hard":
            assert any(f.hard for f in hits)
        else:
            assert any(f.device.startswith(expect) for f in hits), (prof, hits)


def test_healthy_fleet_is_quiet_and_faults_start_on_time():
    _, flags = _run({}, windows=6)
    assert all(f == [] for f in flags)
    _, flags = _run({"node7": {"profile": "thermal_throttle", "start_s": 100}}, windows=6)
    first = next(i for i, f in enumerate(flags) if f)
    assert first == 5  # active from t=120 (4th window), flagged 3 windows later


def test_profile_config_errors_name_the_node():
    assert parse_profiles({"node2": "low_power"})["node2"].profile == "low_power"
    with pytest.raises(InputError, match="node2: unknown profile 'melted'"):
        parse_profiles({"node2": "melted"})
    with pytest.raises(InputError, match="node3: unknown key"):
        parse_profiles({"node3": {"profile": "low_power", "when": 3}})
    with pytest.raises(InputError, match="node9: not one of the simulated nodes"):
        SimTelemetrySource(NODES, {"node9": "low_power"}, clock=FakeClock())


def test_open_source_builds_each_kind():
    from slurmguard.errors import ConfigError
    from slurmguard.telemetry import open_source
    from slurmguard.telemetry.fake_nvml import FakeNvml

    clock = FakeClock()
    assert open_source("none", "n1") is None
    assert open_source("sim", "n1", clock=clock).sample().samples[0].node == "n1"
    nv = open_source("nvml", "n1", nvml=FakeNvml([]), clock=clock)
    assert nv.sample().samples == []
    with pytest.raises(ConfigError, match="unknown source 'snmp'"):
        open_source("snmp", "n1")
