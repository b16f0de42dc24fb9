"""The agent's loop reports at its interval while its ranks run as before, and
twice as often while one runs slow (agent.daemon.EARLY_REPORT_FRACTION), so
the controller gets the evidence to name a node sooner; its telemetry is
sampled at its own interval either way. The loop is the real `run`, in a
thread, on the system clock; the agent behind it is a stand-in that counts
what the loop asks of it."""

from __future__ import annotations

import threading
import time

from slurmguard.agent.daemon import EARLY_REPORT_FRACTION, run
from slurmguard.clock import SystemClock
from slurmguard.config import parse_policy
from slurmguard.wire import AgentReport, JobReport, RankReport, StepSample

POLICY = parse_policy("""
agent: {sample_interval_s: 0.2, report_interval_s: 0.4, telemetry_source: none}
response: {tiers: {moderate_slowdown: 0.1, severe_slowdown: 0.2}}
""")


class Counted:
    """What `run` calls on an agent, counted; its reports carry one rank whose
    newest iterations are `factor` times its baseline."""

    def __init__(self, factor: float) -> None:
        self.policy, self.clock, self.factor = POLICY, SystemClock(), factor
        self.reports = self.samples = 0
        self.sender = type("S", (), {"queue": [], "sent": 0, "dropped": 0})()
        self.tracker = type("T", (), {"close": lambda self: None})()
        self.source = None

    def sample_telemetry(self) -> None:
        self.samples += 1

    def step(self) -> AgentReport:
        self.reports += 1
        now = time.time()
        steps = [StepSample(end=now - 0.1 * (5 - i), step_s=0.1 * self.factor, comm_s=0.01) for i in range(5)]
        rank = RankReport(rank=0, baseline_step_s=0.1, steps=steps, total_steps=5)
        return AgentReport(
            node="node1", seq=self.reports, sent_at=now, jobs=[JobReport(job_id=7, ranks=[rank])]
        )


def counts(factor: float, seconds: float = 2.0) -> tuple[int, int]:
    agent, stop = Counted(factor), threading.Event()
    t = threading.Thread(target=run, args=(agent, stop), daemon=True)
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join(5)
    assert not t.is_alive()
    return agent.reports, agent.samples


def test_a_node_with_a_slow_rank_reports_sooner():
    healthy, healthy_samples = counts(1.0)
    slow, slow_samples = counts(1.5)
    # 2 s at 0.4 s: about 5 reports (the first at once); slow, at 0.2 s: about 10
    # (margins for a loaded machine: a late loop reports less often in both)
    assert 3 <= healthy <= 7, healthy
    assert slow >= 1.5 * healthy, (slow, healthy, EARLY_REPORT_FRACTION)
    # 9% slower is under the moderate tier: no early reports
    assert counts(1.09)[0] <= 7
    # telemetry keeps its own 0.2 s cadence in both (about 10 in 2 s)
    for n in (healthy_samples, slow_samples):
        assert 5 <= n <= 12, n
