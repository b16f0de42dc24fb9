"""An agent reports to both controllers of a pair (agent.also_report_to), so the
one that takes the lease over already has the fleet's reports; a controller
that is down holds back none of the others. Real senders, real HTTP listeners
on loopback; about 1 s."""

from __future__ import annotations

import time

import pytest

from slurmguard.agent.daemon import Agent
from slurmguard.agent.sender import ReportSender
from slurmguard.clock import SystemClock
from slurmguard.config import parse_policy
from slurmguard.controller.loop import Controller
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.wire import AgentReport, TelemetryRecord, node_key
from tests.fixtures.server import start_listener

SECRET = b"m" * 32
POLICY = parse_policy("agent: {telemetry_source: none}")


def _sender(url: str) -> ReportSender:
    return ReportSender(url, node_key(SECRET, "node1"), timeout_s=2.0, now=time.time)


def test_every_report_goes_to_each_controller_and_a_dead_one_blocks_none(tmp_path):
    (a, fleet_a, _), (b, fleet_b, _) = start_listener(SECRET), start_listener(SECRET)
    try:
        to_a, to_b = _sender(f"http://127.0.0.1:{a.port}"), _sender(f"http://127.0.0.1:{b.port}")
        agent = Agent(
            node="node1",
            policy=POLICY,
            sender=to_a,
            also=[to_b],
            clock=SystemClock(),
            ring_root=str(tmp_path),
        )
        agent.step()
        assert "node1" in fleet_a.report_lag(time.time()) and "node1" in fleet_b.report_lag(time.time())
        assert (to_a.sent, to_b.sent) == (1, 1)
        a.stop()  # the active controller's host dies
        agent.step()
        assert to_b.sent == 2 and not to_b.queue  # the other one still gets every report
        assert to_a.sent == 1 and len(to_a.queue) == 1 and to_a.failures == 1  # kept for its return
    finally:
        a.stop()
        b.stop()


def _tel_report(node: str, seq: int, at: float, first: float, n: int) -> AgentReport:
    # value = timestamp: a sample scored twice or lost moves the window's mean
    tel = [
        TelemetryRecord(signal="sm_clock", value=first + i, unit="MHz", timestamp=first + i, gpu=0)
        for i in range(n)
    ]
    return AgentReport(node=node, seq=seq, sent_at=at, telemetry=tel)


def test_a_standby_leaves_the_telemetry_to_the_active_one_and_scores_from_its_takeover(
    sqlite_store, fake_clock
):
    """Both controllers get every report; the active one scores each sample once. The
    standby drops what it got meanwhile (stand_by), so when it takes over its first
    window holds only what arrived since, not the old leader's windows again."""
    pol = parse_policy("detection: {peers: {window_s: 10}}")
    slurm = FakeSlurm(["node1"], clock=fake_clock)
    active, standby = (Controller(pol, sqlite_store, slurm, fake_clock) for _ in range(2))
    scored: dict[str, list[float]] = {"active": [], "standby": []}
    for who, ctl in (("active", active), ("standby", standby)):
        real = ctl.scorer.window

        def window(samples, group=None, means=None, real=real, out=scored[who]):
            out.extend(v for (_, sig, _, _), v in (means or {}).items() if sig == "sm_clock")
            out.extend(s.value for s in samples if s.signal == "sm_clock")
            return real(samples, group, means)

        ctl.scorer.window = window
    seq = 0

    def report(first: float) -> None:
        nonlocal seq
        seq += 1
        r = _tel_report("node1", seq, fake_clock.now(), first, 10)
        assert active.fleet.ingest(r, fake_clock.now()) and standby.fleet.ingest(r, fake_clock.now())

    report(1000)
    fake_clock.advance(10)
    active.cycle()
    standby.stand_by()
    report(2000)
    fake_clock.advance(10)
    active.cycle()
    standby.stand_by()
    assert scored["active"] == [pytest.approx(1004.5), pytest.approx(2004.5)]
    # the active one dies; the standby takes over one report later
    report(3000)
    fake_clock.advance(10)
    standby.cycle()
    assert scored["standby"] == [pytest.approx(3004.5)]
