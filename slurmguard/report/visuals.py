"""Chart data for the HTML report, computed from the snapshots (no drawing here).

- step time of a node's guarded jobs against the other nodes of the same job, with the
  incidents' change points (onset) and the moments of each action;
- telemetry of the node against its peers' band (min..max of the other nodes of the
  same job in the same window; the stored peer median when no peer rows exist);
- sweep metrics as deviation from the hardware-class baseline: the median, over other
  nodes of the same class and sweep kind, of their newest passing sweep;
- the fleet heatmap: each node's newest step-time slowdown.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from slurmguard.store import AuditOutcome, StepTimeRecord, SweepRecord, Verdict
from slurmguard.triage.report_data import FleetSnapshot, SeriesSnapshot, flat_metrics

# Signals shown first, in this order (Guard 4.1); others follow by name.
SIGNAL_ORDER = ("gpu_temp_c", "sm_clock_mhz", "power_w", "gpu_util", "nic_rate_gbps", "nic_errors")
MAX_SIGNALS = 6
MAX_JOBS = 2
JOB_ACTIONS = frozenset({"comment", "drain", "signal", "requeue"})
ACTION_COLORS = {
    "drain": "#ef6c00",
    "requeue": "#c62828",
    "signal": "#6d4c41",
    "comment": "#f9a825",
    "reservation_create": "#00838f",
    "resume": "#2e7d32",
    "reboot": "#8e24aa",
    "submit": "#546e7a",
    "detected": "#d62728",
}


@dataclass(frozen=True)
class XY:
    xs: tuple[float, ...]
    ys: tuple[float | None, ...]


@dataclass(frozen=True)
class StepChart:
    job_id: str
    node: XY
    peer_median: XY
    band_lo: tuple[float, ...]
    band_hi: tuple[float, ...]
    change_points: tuple[tuple[float, float, str], ...]
    """(time, y, label)"""
    events: tuple[tuple[float, str, str], ...]
    """(time, label, action)"""


@dataclass(frozen=True)
class TelemetryChart:
    signal: str
    unit: str | None
    node: XY
    peer_median: XY
    band_xs: tuple[float, ...]
    band_lo: tuple[float, ...]
    band_hi: tuple[float, ...]
    deviating: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class SweepChart:
    sweep_id: int
    kind: str
    verdict: str
    at: datetime
    hw_class: str | None
    baseline_nodes: int
    deviations: tuple[tuple[str, float], ...]
    """(metric key, value / class median - 1), worst first."""
    failure_reason: str | None


def _ts(t: datetime) -> float:
    return t.timestamp()


class ClassBaselines:
    """Per (hw_class, kind): metric -> median over nodes of their newest passing sweep."""

    def __init__(self, sweeps: Iterable[SweepRecord]) -> None:
        newest: dict[tuple[str | None, str, str], SweepRecord] = {}
        for s in sweeps:
            if s.verdict is Verdict.PASS:
                newest[(s.hw_class, s.kind.value, s.node)] = s  # oldest first: newest wins
        per: dict[tuple[str | None, str], dict[str, dict[str, float]]] = defaultdict(dict)
        for (hw, kind, node), s in newest.items():
            per[(hw, kind)][node] = flat_metrics(s.metrics)
        self._per = per

    def compare(self, s: SweepRecord) -> tuple[int, list[tuple[str, float]]]:
        """(nodes in the baseline, [(metric, deviation)]) excluding the node's own results."""
        others = {n: m for n, m in self._per.get((s.hw_class, s.kind.value), {}).items() if n != s.node}
        mine = flat_metrics(s.metrics)
        devs = []
        for k, v in mine.items():
            vals = [m[k] for m in others.values() if k in m]
            if vals:
                med = statistics.median(vals)
                if med:
                    devs.append((k, v / med - 1.0))
        devs.sort(key=lambda kv: kv[1])
        return len(others), devs


def step_charts(node: str, snap: FleetSnapshot, series: SeriesSnapshot) -> list[StepChart]:
    rows = series.step_times.get(node, [])
    jobs: dict[str, datetime] = {}
    for r in rows:
        jobs[r.job_id] = max(jobs.get(r.job_id, r.window_end), r.window_end)
    # Jobs with an incident on this node first, then the newest.
    inc_jobs = {i.job_id for i in snap.incidents_by_node.get(node, ())}
    order = sorted(jobs, key=lambda j: (j not in inc_jobs, -jobs[j].timestamp()))[:MAX_JOBS]
    out = []
    for job in order:
        all_rows = series.step_times_by_job.get(job, [])
        mine: dict[float, list[float]] = defaultdict(list)
        peers: dict[float, list[float]] = defaultdict(list)
        for r in all_rows:
            (mine if r.node == node else peers)[_ts(r.window_end)].append(r.mean_step_s)
        xs = tuple(sorted(mine))
        node_xy = XY(xs, tuple(statistics.mean(mine[x]) for x in xs))
        pxs = tuple(sorted(peers))
        med = XY(pxs, tuple(statistics.median(peers[x]) for x in pxs))
        if not pxs:
            # Peers not loaded (a job too large for a band): the job's baseline instead.
            base = {
                _ts(r.window_end): r.baseline_step_s for r in all_rows if r.node == node and r.baseline_step_s
            }
            med = XY(tuple(sorted(base)), tuple(base[x] for x in sorted(base)))
        lo = tuple(min(peers[x]) for x in pxs)
        hi = tuple(max(peers[x]) for x in pxs)
        cps, events = [], []
        y_at = dict(zip(node_xy.xs, node_xy.ys))

        def y_near(t: float, y_at: dict = y_at) -> float:
            if not y_at:
                return 0.0
            return y_at[min(y_at, key=lambda k: abs(k - t))] or 0.0

        span_end = max(xs + pxs) if (xs or pxs) else 0.0
        span_start = min(xs + pxs) if (xs or pxs) else 0.0
        # Actions on the job itself (detection, comment, drain, checkpoint signal, requeue)
        # happen within about one series length of its end; later ones (sweeps) belong to
        # the sweep charts.
        horizon = span_end + (span_end - span_start)
        for i in snap.incidents_by_node.get(node, ()):
            if i.job_id != job:
                continue
            points = [_ts(i.onset_at)]
            for cp in i.evidence.get("change_points", ()) or ():
                t = _parse_time(cp)
                if t is not None:
                    points.append(t)
            for t in sorted(set(points)):
                cps.append((t, y_near(t), f"change point (incident {i.id})"))
            events.append((_ts(i.detected_at), f"detected: incident {i.id}, tier {i.tier.value}", "detected"))
        acts = [a for a in snap.audit.get(node, ()) if a.outcome is not AuditOutcome.ERROR]
        acts += [a for a in snap.audit_by_job.get(job, ()) if a.node is None]
        for a in acts:
            t = _ts(a.at)
            if a.action in JOB_ACTIONS and span_start <= t <= horizon:
                events.append((t, f"{a.action}: {a.reason or ''}".strip(": "), a.action))
        out.append(StepChart(job, node_xy, med, lo, hi, tuple(cps), tuple(sorted(events))))
    return out


def _parse_time(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            return datetime.fromisoformat(v).timestamp()
        except ValueError:
            return None
    return None


def telemetry_charts(node: str, series: SeriesSnapshot) -> list[TelemetryChart]:
    rows = series.telemetry.get(node, [])
    if not rows:
        return []
    newest_job: dict[str, tuple[datetime, str | None]] = {}
    for r in rows:
        cur = newest_job.get(r.signal)
        if cur is None or r.window_end >= cur[0]:
            newest_job[r.signal] = (r.window_end, r.job_id)
    signals = sorted(
        newest_job, key=lambda s: (SIGNAL_ORDER.index(s) if s in SIGNAL_ORDER else len(SIGNAL_ORDER), s)
    )[:MAX_SIGNALS]
    out = []
    for sig in signals:
        job = newest_job[sig][1]
        mine = sorted((r for r in rows if r.signal == sig and r.job_id == job), key=lambda r: r.window_end)
        peer_vals: dict[float, list[float]] = defaultdict(list)
        if job is not None:
            for r in series.telemetry_by_job.get(job, ()):
                if r.signal == sig and r.node != node and r.value is not None:
                    peer_vals[_ts(r.window_end)].append(r.value)
        xs = tuple(_ts(r.window_end) for r in mine)
        bxs = tuple(sorted(peer_vals))
        out.append(
            TelemetryChart(
                signal=sig,
                unit=next((r.unit for r in mine if r.unit), None),
                node=XY(xs, tuple(r.value for r in mine)),
                peer_median=XY(xs, tuple(r.peer_median for r in mine)),
                band_xs=bxs,
                band_lo=tuple(min(peer_vals[x]) for x in bxs),
                band_hi=tuple(max(peer_vals[x]) for x in bxs),
                deviating=tuple(
                    (_ts(r.window_end), r.value) for r in mine if r.deviating and r.value is not None
                ),
            )
        )
    return out


def sweep_charts(
    node: str, snap: FleetSnapshot, baselines: ClassBaselines, limit: int = 3
) -> list[SweepChart]:
    finals = [s for s in snap.sweeps_by_node.get(node, ()) if s.verdict is not Verdict.PENDING]
    out = []
    for s in finals[-limit:][::-1]:
        n, devs = baselines.compare(s)
        out.append(
            SweepChart(
                s.id,
                s.kind.value,
                s.verdict.value,
                s.finished_at or s.created_at,
                s.hw_class,
                n,
                tuple(devs),
                s.failure_reason,
            )
        )
    return out


def fleet_slowdowns(series: SeriesSnapshot) -> dict[str, float]:
    """Node -> slowdown (fraction) of its newest step-time window (max over jobs ending then)."""
    if series.newest_slowdown:
        return dict(series.newest_slowdown)
    out: dict[str, float] = {}
    for node, rows in series.step_times.items():
        newest = max(r.window_end for r in rows)
        vals = [v for v in (_slow(r) for r in rows if r.window_end == newest) if v is not None]
        if vals:
            out[node] = max(vals)
    return out


def _slow(r: StepTimeRecord) -> float | None:
    if r.slowdown is not None:
        return r.slowdown
    if r.baseline_step_s:
        return r.mean_step_s / r.baseline_step_s - 1.0
    return None
