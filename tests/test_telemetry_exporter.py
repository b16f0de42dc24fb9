"""dcgm-exporter scrapes with the default counter set and with the full set
(tests/fixtures/telemetry/dcgm_exporter_{default,full}.prom: the metrics, types
and HELP of the exporter's etc/default-counters.csv, and that plus the
dcp-metrics-included.csv profiling ratios, ECC, NVLink error totals,
clocks-event reasons, row-remap pending and the recovery action)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmguard.clock import FakeClock
from slurmguard.config import PeerPolicy
from slurmguard.detect.peers import PeerScorer, hard_failures
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.prometheus import PrometheusSource, Target

FIX = Path(__file__).parent / "fixtures" / "telemetry"
NODE = "gpu-node-11"


def scrape(page: str, clock=None) -> tuple[PrometheusSource, dict]:
    pages = {"u": (FIX / page).read_text()}
    src = PrometheusSource(
        [Target("u", "fallback")], clock=clock or FakeClock(), fetch=lambda url: pages[url]
    )
    return src, pages


def _by(r):
    return {(s.gpu, s.signal): s.value for s in r.samples if s.node == NODE}


def test_default_counter_set_reports_what_it_lacks_once():
    src, _ = scrape("dcgm_exporter_default.prom")
    r = src.sample()
    v = _by(r)
    assert v[(0, Signal.POWER)] == pytest.approx(648.213) and v[(0, Signal.SM_CLOCK)] == 1980
    assert v[(6, Signal.REMAPPED_ROWS_UNC)] == 1 and v[(6, Signal.ROW_REMAP_FAILURE)] == 0
    missing = {e.signal for e in r.events if e.kind == "unavailable"}
    assert missing == {
        Signal.THROTTLE_REASONS,
        Signal.ECC_SBE,
        Signal.ECC_DBE,
        Signal.ROW_REMAP_PENDING,
        Signal.RECOVERY_ACTION,
        Signal.SM_ACTIVE,
        Signal.TENSOR_ACTIVE,
        Signal.DRAM_ACTIVE,
        *(
            f"nvlink_errors:DCGM_FI_DEV_NVLINK_{c}_ERROR_COUNT_TOTAL"
            for c in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")
        ),
    }
    ecc = next(e for e in r.events if e.signal == Signal.ECC_DBE)
    assert ecc.node == NODE and ecc.gpu is None
    assert ecc.detail == (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL (311): not exported by dcgm-exporter "
        "(add it to the exporter's counters CSV)"
    )
    assert not [e for e in src.sample().events if e.kind == "unavailable"]  # once, not every scrape


def test_last_xid_gauge_is_flagged_on_change_only():
    clock = FakeClock()
    src, pages = scrape("dcgm_exporter_default.prom", clock)
    r = src.sample()
    # 79 on GPU 3 was there before the source started (time unknown): noted, not flagged,
    # so restarting an agent never drains a node again for an old XID
    assert not [s for s in r.samples if s.signal == Signal.XID] and not hard_failures(r.samples)
    assert [(e.kind, e.gpu, e.source) for e in r.events if "last XID 79" in e.detail] == [
        ("info", 3, "prometheus")
    ]
    for _ in range(3):  # the gauge stays 79: no new XID, no flag
        clock.advance(15)
        r = src.sample()
        assert not [s for s in r.samples if s.signal == Signal.XID] and not hard_failures(r.samples)
    gpu3 = 'Hostname="gpu-node-11",DCGM_FI_DRIVER_VERSION="570.133.20"} 79'
    pages["u"] = pages["u"].replace(gpu3, gpu3[:-2] + "94")
    clock.advance(15)
    assert [(s.gpu, s.value) for s in src.sample().samples if s.signal == Signal.XID] == [(3, 94)]


def test_full_counter_set_row_remap_nvlink_blanks_and_profiling():
    src, _ = scrape("dcgm_exporter_full.prom")
    r = src.sample()
    v = _by(r)
    # H100 answers NOT_SUPPORTED (blank) for the NVLink CRC totals; replay/recovery still count
    assert v[(1, Signal.NVLINK_ERRORS)] == 3 and v[(0, Signal.NVLINK_ERRORS)] == 0
    blank = {(e.gpu, e.signal) for e in r.events if e.kind == "unavailable"}
    assert blank == {
        (g, f"nvlink_errors:DCGM_FI_DEV_NVLINK_{c}_ERROR_COUNT_TOTAL")
        for g in range(8)
        for c in ("CRC_FLIT", "CRC_DATA")
    }
    assert v[(2, Signal.THERMAL_THROTTLE)] == 1 and v[(5, Signal.ECC_SBE)] == 12
    assert v[(0, Signal.RECOVERY_ACTION)] == 0
    assert v[(2, Signal.TENSOR_ACTIVE)] == pytest.approx(0.347710)
    assert [(f.device, f.reasons) for f in hard_failures(r.samples)] == [
        ("gpu6", ("row remapping pending (GPU reset required)",))
    ]


def test_profiling_ratios_single_out_the_slow_gpu():
    """GPU 2 of the full scrape: tensor and DRAM active well below its peers, SM
    active above (it computes longer while they wait): flagged on those signals
    alone, which clocks, power and utilisation (all normal) would not show."""
    clock = FakeClock()
    src, _ = scrape("dcgm_exporter_full.prom", clock)
    scorer = PeerScorer(PeerPolicy(consecutive_windows=2))
    flags = []
    for _ in range(2):
        flags = [f for f in scorer.window(src.sample().samples) if not f.hard]
        clock.advance(30)
    assert [f.device for f in flags] == ["gpu2"]
    assert {d.signal for d in flags[0].deviations} == {
        Signal.SM_ACTIVE,
        Signal.TENSOR_ACTIVE,
        Signal.DRAM_ACTIVE,
    }


def test_xid_154_without_the_recovery_action_field_fails_the_gpu():
    """Default counters: no DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION. XID 154 then says
    the driver wants an action we cannot see: a hard failure, not ignored."""
    src, pages = scrape("dcgm_exporter_default.prom")
    src.sample()
    gpu0 = 'gpu="0",UUID="GPU-3f1c9a52-8d4e-4b7a-a1c3-5e2d9b70c600",pci_bus_id="00000000:18:00.0",'
    xid0 = next(line for line in pages["u"].splitlines() if line.startswith("DCGM_FI_DEV_XID_ERRORS{" + gpu0))
    pages["u"] = pages["u"].replace(xid0, xid0[:-2] + " 154")
    assert [(f.device, f.reasons) for f in hard_failures(src.sample().samples)] == [
        ("gpu0", ("XID 154: recovery action changed, action not readable",))
    ]


def test_open_source_scrapes_the_policy_targets():
    from slurmguard.config import parse_policy
    from slurmguard.telemetry import open_source

    t = parse_policy(
        "agent:\n  telemetry:\n    prometheus_targets: [http://10.0.0.7:9400/metrics]\n"
        "    ib_expected_ports: ['mlx5_0:1']\n"
    ).agent.telemetry
    src = open_source("prometheus", "n7", targets=t.prometheus_targets, expected_ports=t.ib_expected_ports)
    assert [(x.url, x.node) for x in src.targets] == [("http://10.0.0.7:9400/metrics", "n7")]
    assert src.expected.patterns == ("mlx5_0:1",)


def test_node_exporter_saturated_counters_and_64bit_legacy_data():
    """node_exporter reads the same sysfs counters: the same widths, the same rule."""
    clock = FakeClock()
    page = (
        'node_infiniband_state_id{device="mlx5_0",port="1"} 4\n'
        'node_infiniband_port_transmit_wait_total{device="mlx5_0",port="1"} %d\n'
        'node_infiniband_port_errors_received_total{device="mlx5_0",port="1"} %d\n'
        'node_infiniband_port_data_transmitted_bytes_total{device="mlx5_0",port="1"} %d\n'
        'node_infiniband_legacy_data_transmitted_bytes_total{device="mlx5_0",port="1"} %d\n'
    )
    pages = {"u": page % (100, 3, (2**32 - 1) * 4, 4_000_000_000_000)}
    src = PrometheusSource([Target("u", "n1")], clock=clock, fetch=lambda url: pages[url])
    src.sample()
    pages["u"] = page % (2**32 - 1, 65535, (2**32 - 1) * 4, 4_000_000_000_000 + 250_000_000_000)
    clock.advance(10)
    r = src.sample()
    v = {(s.nic, s.signal): s.value for s in r.samples}
    assert v[("mlx5_0:1", Signal.NIC_TX_GBPS)] == pytest.approx(200.0)  # from the 64-bit counter
    assert ("mlx5_0:1", Signal.NIC_CONGESTION_RATE) not in v and ("mlx5_0:1", Signal.NIC_ERROR_RATE) not in v
    assert {e.signal for e in r.events if e.kind == "unavailable"} == {
        Signal.NIC_CONGESTION_RATE,
        Signal.NIC_ERROR_RATE,
    }
