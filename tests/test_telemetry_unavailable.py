"""A signal that cannot be read is reported unavailable once by its source, and
is visible in every agent report and on the controller's /metrics until it can
be read again (real controller HTTP server, FakeSlurm, sources on recorded data)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from slurmguard.agent.daemon import Agent
from slurmguard.agent.sender import ReportSender
from slurmguard.clock import FakeClock
from slurmguard.config import Policy
from slurmguard.controller.loop import Controller
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.telemetry import MultiSource
from slurmguard.telemetry.dcgm import DcgmSource
from slurmguard.telemetry.fake_nvml import FakeNvml
from slurmguard.telemetry.nvml import NvmlSource
from slurmguard.wire import node_key
from tests.test_telemetry_dcgm import FakeDcgmReader, recorded

SECRET = b"0123456789abcdef0123456789abcdef"
FIX = Path(__file__).parent / "fixtures" / "telemetry"


@pytest.fixture
def stack(sqlite_store):
    clock = FakeClock(start=time.time())
    metrics = ControllerMetrics()
    ctl = Controller(Policy(), sqlite_store, FakeSlurm(clock=clock), clock, metrics=metrics)
    http = ControllerHTTP(
        "127.0.0.1",
        0,
        secret=SECRET,
        ingest=lambda r: ctl.fleet.ingest(r, clock.now()),
        metrics=metrics,
        now=time.time,
        health=lambda: (True, "ok"),
    )
    http.start()
    yield ctl, clock, f"http://127.0.0.1:{http.port}"
    http.stop()


def gauges(url: str) -> set[tuple[str, str, str, str]]:
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = set()
    for line in body.splitlines():
        if line.startswith("slurmguard_telemetry_unavailable{") and line.endswith(" 1.0"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            out.add(tuple(labels[k].strip('"') for k in ("node", "source", "signal", "device")))
    return out


def test_unavailable_signals_reach_the_report_and_metrics_and_leave_them(stack, tmp_path):
    ctl, clock, url = stack
    nvml = NvmlSource(
        "node1", FakeNvml(json.loads((FIX / "nvml_h100x8.json").read_text())["devices"]), clock=clock
    )
    reader = FakeDcgmReader(recorded())
    dcgm = DcgmSource("node1", clock=clock, reader_factory=lambda: (reader, [1523]))
    sender = ReportSender(url, node_key(SECRET, "node1"), timeout_s=5, max_reports=5, now=time.time)
    agent = Agent(
        node="node1",
        policy=Policy(),
        sender=sender,
        clock=clock,
        source=MultiSource([nvml, dcgm]),
        ring_root=str(tmp_path / "rings"),
    )

    agent.sample_telemetry()
    rep = agent.step()
    got = {(u.source, u.signal, u.gpu) for u in rep.unavailable}
    assert ("nvml", "pcie_replay", 7) in got  # NOT_SUPPORTED on GPU 7
    assert ("dcgm", "gpu_recovery_action", None) in got  # DCGM 3.3.5 lacks field 1523
    clock.advance(6)
    ctl.cycle()
    g = gauges(url)
    assert ("node1", "nvml", "pcie_replay", "gpu7") in g and (
        "node1",
        "dcgm",
        "gpu_recovery_action",
        "node",
    ) in g

    # the next samples repeat no event, yet every report still carries the set
    clock.advance(5)
    agent.sample_telemetry()
    rep = agent.step()
    assert not [e for e in rep.events if " unavailable: " in e]
    assert {(u.source, u.signal, u.gpu) for u in rep.unavailable} == got

    reader.hostengine_up = False  # nv-hostengine dies
    clock.advance(5)
    agent.sample_telemetry()
    rep = agent.step()
    assert ("dcgm", "source", None) in {(u.source, u.signal, u.gpu) for u in rep.unavailable}
    assert any("nv-hostengine unreachable" in e for e in rep.events)
    clock.advance(6)
    ctl.cycle()
    assert ("node1", "dcgm", "source", "node") in gauges(url)

    reader.hostengine_up = True  # back: it leaves report and /metrics
    clock.advance(5)
    agent.sample_telemetry()
    rep = agent.step()
    assert ("dcgm", "source", None) not in {(u.source, u.signal, u.gpu) for u in rep.unavailable}
    clock.advance(6)
    ctl.cycle()
    g = gauges(url)
    assert ("node1", "dcgm", "source", "node") not in g and ("node1", "nvml", "pcie_replay", "gpu7") in g
