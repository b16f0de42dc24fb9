"""IB/RoCE sysfs: expected ports and saturating counters.

Trees are copies of the recorded one (tests/fixtures/telemetry/sysfs): mlx5_0
an NDR InfiniBand port (ACTIVE), mlx5_1 a DOWN/Disabled InfiniBand port,
mlx5_2 a RoCE (Ethernet link layer) port. Counter widths are the kernel's
(drivers/infiniband/core/sysfs.c PORT_PMA_ATTR): symbol_error 16 bits,
link_downed and link_error_recovery 8, port_xmit_wait 32, port_xmit_data 32
without extended counters; they stop at 2^w - 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slurmguard.clock import FakeClock
from slurmguard.detect.peers import hard_failures
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.infiniband import InfinibandSource, saturated

FIX = Path(__file__).parent / "fixtures" / "telemetry" / "sysfs" / "class" / "infiniband"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "infiniband"
    shutil.copytree(FIX, root)
    return root


def write(root: Path, nic: str, rel: str, value) -> None:
    dev, port = nic.split(":")
    p = root / dev / "ports" / port / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"{value}\n")


def _by(r):
    return {(s.nic, s.signal): s.value for s in r.samples}


def test_widths_follow_the_kernel():
    assert saturated("symbol_error", 65535) and not saturated("symbol_error", 65534)
    assert saturated("link_downed", 255) and saturated("link_error_recovery", 255)
    assert saturated("local_link_integrity_errors", 15)  # 4-bit
    assert saturated("port_xmit_wait", 2**32 - 1) and not saturated("port_xmit_wait", 2**32 - 2)
    assert saturated("port_xmit_data", 2**32 - 1)  # 32-bit PortCounters, pegged
    assert not saturated("port_xmit_data", 5928471234112)  # extended (64-bit) counter
    assert not saturated("out_of_sequence", 2**32 - 1)  # hw_counters are 64-bit


def test_learned_ports_down_at_start_are_not_link_down(tree):
    src = InfinibandSource("n1", tree, clock=FakeClock(), expected_ports=())
    r = src.sample()
    v = _by(r)
    assert ("mlx5_1:1", Signal.NIC_STATE) not in v  # never ACTIVE: uncabled/unused
    assert v[("mlx5_0:1", Signal.NIC_STATE)] == 1 and v[("mlx5_2:1", Signal.NIC_STATE)] == 1
    assert not hard_failures(r.samples)
    info = [e for e in r.events if e.kind == "info"]
    assert len(info) == 1 and "mlx5_1:1 (InfiniBand, state 1: DOWN)" in info[0].detail
    assert not [e for e in src.sample().events if e.kind == "info"]  # said once


def test_learned_port_that_goes_down_or_vanishes_is_link_down(tree):
    clock = FakeClock()
    src = InfinibandSource("n1", tree, clock=clock, expected_ports=())
    src.sample()
    write(tree, "mlx5_0:1", "state", "1: DOWN")
    write(tree, "mlx5_0:1", "phys_state", "2: Polling")
    clock.advance(10)
    r = src.sample()
    assert [(f.device, f.reasons) for f in hard_failures(r.samples)] == [("mlx5_0:1", ("link down",))]
    shutil.rmtree(tree / "mlx5_2")  # the RoCE HCA fell off PCIe
    clock.advance(10)
    r = src.sample()
    assert {f.device for f in hard_failures(r.samples)} == {"mlx5_0:1", "mlx5_2:1"}
    assert any(e.kind == "error" and "mlx5_2:1: expected port missing" in e.detail for e in r.events)


def test_policy_patterns_decide_which_ports_matter(tree):
    src = InfinibandSource("n1", tree, clock=FakeClock(), expected_ports=("mlx5_0:1", "mlx5_1:1"))
    r = src.sample()
    v = _by(r)
    assert ("mlx5_2:1", Signal.NIC_STATE) not in v  # the Ethernet port is not ours
    assert [(f.device, f.reasons) for f in hard_failures(r.samples)] == [("mlx5_1:1", ("link down",))]


def test_saturated_error_counter_makes_the_rate_unavailable_not_zero(tree):
    clock = FakeClock()
    src = InfinibandSource("n1", tree, clock=clock, expected_ports=())
    src.sample()
    write(tree, "mlx5_0:1", "counters/symbol_error", 65535)  # pegged at 16 bits
    write(tree, "mlx5_0:1", "counters/link_downed", 255)  # pegged at 8 bits
    clock.advance(10)
    r = src.sample()
    v = _by(r)
    assert ("mlx5_0:1", Signal.NIC_ERROR_RATE) not in v  # not a silent 0/s
    un = {e.signal: e.detail for e in r.events if e.kind == "unavailable" and e.nic == "mlx5_0:1"}
    assert "symbol_error=65535 (16-bit, saturated)" in un[Signal.NIC_ERROR_RATE]
    assert "link_downed=255 (8-bit, saturated)" in un[Signal.NIC_LINK_DOWNED]
    assert v[("mlx5_2:1", Signal.NIC_ERROR_RATE)] == 0.0  # the other ports still rate
    clock.advance(10)
    r = src.sample()  # still pegged: said once
    assert not [e for e in r.events if e.kind == "unavailable"]
    assert ("mlx5_0:1", Signal.NIC_ERROR_RATE) not in _by(r)
    write(tree, "mlx5_0:1", "counters/symbol_error", 0)  # perfquery -R
    clock.advance(10)
    r = src.sample()
    assert [(e.kind, e.signal) for e in r.events if e.nic == "mlx5_0:1"] == [
        ("available", Signal.NIC_ERROR_RATE)
    ]
    write(tree, "mlx5_0:1", "counters/symbol_error", 40)
    clock.advance(10)
    assert _by(src.sample())[("mlx5_0:1", Signal.NIC_ERROR_RATE)] == pytest.approx(4.0)


def test_pegged_32bit_xmit_wait_and_data_counters(tree):
    clock = FakeClock()
    src = InfinibandSource("n1", tree, clock=clock, expected_ports=())
    src.sample()
    write(tree, "mlx5_0:1", "counters/port_xmit_wait", 2**32 - 1)
    write(tree, "mlx5_0:1", "counters/port_xmit_data", 2**32 - 1)  # an HCA without extended counters
    clock.advance(10)
    r = src.sample()
    v = _by(r)
    assert ("mlx5_0:1", Signal.NIC_CONGESTION_RATE) not in v and ("mlx5_0:1", Signal.NIC_TX_GBPS) not in v
    assert {e.signal for e in r.events if e.kind == "unavailable"} == {
        Signal.NIC_CONGESTION_RATE,
        Signal.NIC_TX_GBPS,
    }


def test_64bit_counters_ext_preferred(tree):
    clock = FakeClock()
    write(tree, "mlx5_0:1", "counters/port_xmit_data", 2**32 - 1)  # legacy file pegged
    write(tree, "mlx5_0:1", "counters_ext/port_xmit_data_64", 9_000_000_000_000)
    src = InfinibandSource("n1", tree, clock=clock, expected_ports=())
    assert _by(src.sample())[("mlx5_0:1", Signal.NIC_TX_BYTES)] == 9_000_000_000_000 * 4
    write(tree, "mlx5_0:1", "counters_ext/port_xmit_data_64", 9_000_000_000_000 + 62_500_000_000)
    clock.advance(10)
    r = src.sample()
    assert _by(r)[("mlx5_0:1", Signal.NIC_TX_GBPS)] == pytest.approx(200.0)  # 2.5e11 B in 10 s
    assert not [e for e in r.events if e.kind == "unavailable"]


def test_open_source_adds_the_ib_ports_the_policy_names(tree):
    """agent.telemetry: infiniband, ib_sysfs_root and ib_expected_ports reach the sources."""
    import json

    from slurmguard.config import parse_policy
    from slurmguard.telemetry import MultiSource, open_source
    from slurmguard.telemetry.fake_nvml import FakeNvml

    t = parse_policy(
        f"agent:\n  telemetry:\n    ib_sysfs_root: {tree}\n    ib_expected_ports: ['mlx5_0:1', 'mlx5_1:1']\n"
    ).agent.telemetry
    devs = json.loads((FIX.parents[2] / "nvml_h100x8.json").read_text())["devices"][:2]
    src = open_source(
        "nvml",
        "n1",
        nvml=FakeNvml(devs),
        clock=FakeClock(),
        infiniband=t.infiniband,
        ib_root=t.ib_sysfs_root,
        expected_ports=t.ib_expected_ports,
        timeout_s=t.call_timeout_s,
    )
    assert isinstance(src, MultiSource) and src.name == "nvml+infiniband"
    r = src.sample()
    assert {s.gpu for s in r.samples if s.gpu is not None} == {0, 1}
    assert {s.nic for s in r.samples if s.nic} == {"mlx5_0:1", "mlx5_1:1"}
    assert [f.device for f in hard_failures(r.samples)] == ["mlx5_1:1"]
    off = parse_policy("agent:\n  telemetry:\n    infiniband: false\n").agent.telemetry
    assert (
        open_source("nvml", "n1", nvml=FakeNvml(devs), clock=FakeClock(), infiniband=off.infiniband).name
        == "nvml"
    )
