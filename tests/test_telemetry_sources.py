"""Prometheus (real local HTTP server) and InfiniBand sysfs: recorded fixtures (DCGM: test_telemetry_dcgm)."""

from __future__ import annotations

import http.server
import shutil
import threading
from pathlib import Path

import pytest

from slurmguard.clock import FakeClock
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.infiniband import InfinibandSource, parse_rate_gbps, parse_state
from slurmguard.telemetry.prometheus import PrometheusSource, Target

FIX = Path(__file__).parent / "fixtures" / "telemetry"


@pytest.fixture
def exporter():
    """http.server on 127.0.0.1 serving the recorded exporter pages; pages can be swapped."""
    pages = {
        "/metrics": (FIX / "dcgm_exporter.prom").read_text(),
        "/node": (FIX / "node_exporter_ib.prom").read_text(),
    }

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = pages.get(self.path)
            if body is None:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", pages
    srv.shutdown()
    srv.server_close()


def _by(r, key):
    return {(s.gpu if s.gpu is not None else s.nic, s.signal): s.value for s in r.samples if s.node == key}


def test_dcgm_exporter_scrape(exporter):
    url, _ = exporter
    src = PrometheusSource([Target(url + "/metrics", "fallback")], clock=FakeClock())
    r = src.sample()
    assert [e.kind for e in r.events] == ["unavailable"] * len(r.events)  # fields this page lacks
    v = _by(r, "gpu-node-07")  # node from the Hostname label
    assert v[(3, Signal.GPU_TEMP)] == 78 and v[(3, Signal.SM_CLOCK)] == 1380
    assert v[(3, Signal.POWER)] == pytest.approx(548.3) and v[(3, Signal.THERMAL_THROTTLE)] == 1
    assert v[(0, Signal.THERMAL_THROTTLE)] == 0 and v[(0, Signal.GPU_UTIL)] == 100
    assert v[(0, Signal.NVLINK_ERRORS)] == 0 and v[(0, Signal.ECC_DBE)] == 0
    assert (0, Signal.XID) not in v  # DCGM_FI_DEV_XID_ERRORS 0 = none
    # DCGM_FI_DEV_MEMORY_TEMP is the "not supported" blank sentinel: absent, and no crash


def test_dcgm_xid_and_counter_rates_across_scrapes(exporter):
    url, pages = exporter
    clock = FakeClock()
    src = PrometheusSource([Target(url + "/metrics", "x")], clock=clock)
    src.sample()
    # GPU 7 (the last XID line) reports XID 48, a double-bit ECC error
    pages["/metrics"] = pages["/metrics"].replace(
        '"} 0\n# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS', '"} 48\n# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS'
    )
    clock.advance(10)
    r = src.sample()
    assert [(s.gpu, s.value) for s in r.samples if s.signal == Signal.XID] == [(7, 48)]
    assert any(s.signal == Signal.PCIE_REPLAY_RATE and s.value == 0 for s in r.samples)


def test_node_exporter_infiniband_scrape(exporter):
    url, _ = exporter
    clock = FakeClock()
    src = PrometheusSource([Target(url + "/node", "gpu-node-07")], clock=clock)
    v = _by(src.sample(), "gpu-node-07")
    assert v[("mlx5_0:1", Signal.NIC_STATE)] == 1
    # mlx5_3 was never ACTIVE since the agent started: not an expected port, not "link down"
    assert ("mlx5_3:1", Signal.NIC_STATE) not in v
    assert v[("mlx5_0:1", Signal.NIC_RATE)] == pytest.approx(400.0)  # 5e10 B/s
    src = PrometheusSource([Target(url + "/node", "gpu-node-07")], clock=clock, expected_ports=("mlx5_*:1",))
    v = _by(src.sample(), "gpu-node-07")
    assert v[("mlx5_3:1", Signal.NIC_STATE)] == 0  # expected by policy: down
    assert v[("mlx5_3:1", Signal.NIC_LINK_DOWNED)] == 2
    assert v[("mlx5_3:1", Signal.NIC_ERRORS)] == 1 + 17 + 4
    # mlx5_0 carries twice the others: the NIC that took over a dead one (Guard Table 1)
    assert v[("mlx5_0:1", Signal.NIC_TX_BYTES)] == pytest.approx(
        2 * v[("mlx5_1:1", Signal.NIC_TX_BYTES)], rel=0.01
    )


def test_unreachable_and_malformed_exporters_are_events(exporter):
    url, pages = exporter
    pages["/bad"] = 'DCGM_FI_DEV_GPU_TEMP{gpu="0" 55\n'
    src = PrometheusSource(
        [
            Target(url + "/missing", "n1"),
            Target("http://127.0.0.1:9/metrics", "n2"),
            Target(url + "/bad", "n3"),
        ],
        clock=FakeClock(),
        timeout_s=1.0,
    )
    r = src.sample()
    assert r.samples == []
    assert [(e.node, e.kind) for e in r.events] == [
        (n, k) for n in ("n1", "n2", "n3") for k in ("error", "unavailable")
    ]
    assert "bad exposition format" in r.events[4].detail and r.events[5].signal.startswith("source:")
    r = src.sample()  # still down: the error again, "unavailable" only once
    assert [e.kind for e in r.events] == ["error"] * 3


def test_infiniband_sysfs_fixture():
    # every port, as the prolog's nic_link check reads them (expected_ports=None)
    src = InfinibandSource("n1", FIX / "sysfs" / "class" / "infiniband", clock=FakeClock())
    v = _by(src.sample(), "n1")
    assert v[("mlx5_0:1", Signal.NIC_STATE)] == 1 and v[("mlx5_0:1", Signal.NIC_RATE)] == 400
    assert v[("mlx5_1:1", Signal.NIC_STATE)] == 0 and v[("mlx5_1:1", Signal.NIC_RATE)] == 0
    assert v[("mlx5_1:1", Signal.NIC_PHYS_STATE)] == 3
    assert v[("mlx5_0:1", Signal.NIC_TX_BYTES)] == 5928471234112 * 4  # sysfs counts 4-octet words
    assert v[("mlx5_1:1", Signal.NIC_ERRORS)] == 3 + 1 + 17 + 4
    assert v[("mlx5_2:1", Signal.NIC_ERRORS)] == 12 + 1  # RoCE hw_counters
    assert v[("mlx5_2:1", Signal.NIC_CONGESTION)] == 3982 + 4410


def test_infiniband_rates_from_two_samples(tmp_path):
    root = tmp_path / "infiniband"
    shutil.copytree(FIX / "sysfs" / "class" / "infiniband", root)
    clock = FakeClock()
    src = InfinibandSource("n1", root, clock=clock)
    src.sample()
    c = root / "mlx5_0" / "ports" / "1" / "counters"
    c.joinpath("port_xmit_data").write_text(str(5928471234112 + 250_000_000_000 // 4 * 10) + "\n")
    c.joinpath("symbol_error").write_text("30\n")
    clock.advance(10)
    v = _by(src.sample(), "n1")
    assert v[("mlx5_0:1", Signal.NIC_TX_GBPS)] == pytest.approx(2000.0, rel=1e-6)  # 2.5e12 B in 10 s
    assert v[("mlx5_0:1", Signal.NIC_ERROR_RATE)] == pytest.approx(3.0)
    (root / "mlx5_2" / "ports" / "1" / "state").write_text("garbage\n")
    r = src.sample()
    assert any(e.kind == "error" and e.nic == "mlx5_2:1" for e in r.events)


def test_infiniband_missing_root_and_parsers(tmp_path):
    r = InfinibandSource("n1", tmp_path / "none", clock=FakeClock()).sample()
    assert r.samples == [] and r.events[0].kind == "unavailable" and r.events[0].signal == "source"
    assert parse_state("4: ACTIVE") == 4 and parse_rate_gbps("100 Gb/sec (4X EDR)") == 100.0
