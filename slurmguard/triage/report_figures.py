"""Fleet figures computed from the database: how well detection, sweeps and triage work.

- detection delay: incidents' detected_at - onset_at, median;
- time in quarantine: completed stays (entering quarantined -> the next transition);
- sweep pass rate: pass / (pass + fail + error) over finished sweeps;
- nodes returned (quarantined -> healthy) vs. replaced (-> terminal), distinct nodes;
- false-positive estimate: of the drain episodes that ended, the share where the node came
  back through a passing sweep with no failed sweep and no remediation in between. This is
  the quantity Guard Table 3 reports as the false-positive rate (12.4% there).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from datetime import datetime

from slurmguard.store import NodeState, Verdict
from slurmguard.triage.report_data import FleetSnapshot
from slurmguard.triage.report_model import FleetFigures

_FINAL = (Verdict.PASS, Verdict.FAIL, Verdict.ERROR)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fleet_figures(
    snap: FleetSnapshot, scope: Iterable[str], *, since: datetime | None = None
) -> FleetFigures:
    """Figures over the nodes in `scope`, counting events at or after `since` (None: all)."""
    names = set(scope)

    def after(t: datetime | None) -> bool:
        return t is not None and (since is None or t >= since)

    incidents = [i for i in snap.incidents if after(i.detected_at) and any(n in names for n in i.nodes)]
    delays = [i.detection_delay_s for i in incidents]

    stays: list[float] = []
    ongoing = 0
    returned: set[str] = set()
    replaced: set[str] = set()
    concluded = cleared = 0
    for name in names:
        trs = snap.transitions.get(name, ())
        sweeps = snap.sweeps_by_node.get(name, ())
        q_start: datetime | None = None
        ep_start: datetime | None = None
        ep_remediated = False
        for t in trs:
            if q_start is not None:
                if after(q_start):
                    stays.append((t.at - q_start).total_seconds())
                q_start = None
            if t.to_state is NodeState.QUARANTINED:
                q_start = t.at
            if t.to_state is NodeState.TERMINAL and after(t.at):
                replaced.add(name)
            if t.from_state is NodeState.QUARANTINED and t.to_state is NodeState.HEALTHY and after(t.at):
                returned.add(name)
            # Drain episodes: from the first drain after healthy to healthy/terminal.
            if t.to_state is NodeState.DRAINING and ep_start is None:
                ep_start, ep_remediated = t.at, False
            elif t.to_state is NodeState.REMEDIATION:
                ep_remediated = True
            elif t.to_state in (NodeState.HEALTHY, NodeState.TERMINAL) and ep_start is not None:
                if after(t.at):
                    concluded += 1
                    ep = [s for s in sweeps if ep_start <= s.created_at <= t.at and s.verdict in _FINAL]
                    if (
                        t.to_state is NodeState.HEALTHY
                        and t.from_state is NodeState.QUARANTINED
                        and not ep_remediated
                        and any(s.verdict is Verdict.PASS for s in ep)
                        and not any(s.verdict is not Verdict.PASS for s in ep)
                    ):
                        cleared += 1
                ep_start = None
        if q_start is not None and after(q_start):
            ongoing += 1

    finals = [
        s
        for n in names
        for s in snap.sweeps_by_node.get(n, ())
        if s.verdict in _FINAL and after(s.finished_at or s.created_at)
    ]
    passed = sum(1 for s in finals if s.verdict is Verdict.PASS)
    return FleetFigures(
        incidents=len(incidents),
        detection_delay_median_s=_median(delays),
        quarantine_stays=len(stays),
        quarantine_median_s=_median(stays),
        quarantine_ongoing=ongoing,
        sweeps_final=len(finals),
        sweeps_passed=passed,
        sweep_pass_rate=passed / len(finals) if finals else None,
        nodes_returned=len(returned),
        nodes_replaced=len(replaced),
        drains_concluded=concluded,
        drains_cleared=cleared,
        false_positive_estimate=cleared / concluded if concluded else None,
    )
