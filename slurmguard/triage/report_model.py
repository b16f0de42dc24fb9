"""Typed records of the admin report: what `slurmguard triage report` shows, in any format.

The builder (triage.report) fills them from the database and the Slurm view; the
renderers (slurmguard.report.terminal/html/jsonout) only format them. Times are aware
UTC datetimes, durations are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from slurmguard.store import NodeState

Stage = Literal["detection", "response", "sweep", "triage", "lifecycle"]
ReasonSource = Literal["slurm", "audit"]
Owner = Literal["slurmguard", "other"]

# Worst first: the order rows are listed in.
STATE_ORDER: tuple[NodeState, ...] = (
    NodeState.TERMINAL,
    NodeState.REMEDIATION,
    NodeState.QUARANTINED,
    NodeState.DRAINING,
    NodeState.SUSPECT,
    NodeState.HEALTHY,
)


@dataclass(frozen=True)
class ReportFilters:
    """Which nodes the report lists.

    `partition` also scopes the fleet summary and figures; `nodes`/`states`/`since`
    only select rows. `since` keeps nodes whose current state began at or after it,
    and limits the fleet figures to events at or after it. `window` is how far back
    the HTML charts reach (default 7 days).
    """

    nodes: tuple[str, ...] = ()
    states: tuple[NodeState, ...] = ()
    since: datetime | None = None
    partition: str | None = None
    offline: bool = False
    window: timedelta = timedelta(days=7)


@dataclass(frozen=True)
class EvidenceStep:
    at: datetime
    stage: Stage
    text: str
    ref: str
    """Which row says so: 'incident 3', 'audit 17', 'sweep 5', 'triage 2', 'transition 9'."""
    ok: bool | None = None
    """False for a failure (failed sweep or action), True for a pass, None otherwise."""


@dataclass(frozen=True)
class NextAction:
    code: str
    """Stable identifier for scripts: none, wait_verification, wait_job_exit, quarantine_next,
    sweep_running, sweep_now, return_to_service, rung_running, next_rung, replace, not_ours,
    investigate."""
    text: str


@dataclass(frozen=True)
class SlurmView:
    """The live Slurm picture, or why there is none."""

    reachable: bool
    checked: bool
    """False with --offline: Slurm was not asked."""
    error: str | None = None
    nodes: dict = field(default_factory=dict)
    """name -> slurmguard.slurm.models.NodeInfo"""
    reservations: dict = field(default_factory=dict)
    """node name -> reservation names covering it"""


@dataclass(frozen=True)
class NodeRow:
    name: str
    state: NodeState | None
    """None: Slurm knows the node, the database does not (drained by others)."""
    since: datetime | None
    hw_class: str | None
    partitions: tuple[str, ...]
    reason: str | None
    reason_source: ReasonSource | None
    comment: str | None
    slurm_state: str | None
    drained_by: Owner | None
    reservations: tuple[str, ...]
    running_jobs: tuple[int, ...]
    evidence: tuple[EvidenceStep, ...]
    next_action: NextAction
    triage_entries: int
    """Triage episodes opened within the policy's repeat window (Guard 6)."""
    slowdown: float | None
    """Newest guarded-job step-time slowdown on this node (fraction), if any."""


@dataclass(frozen=True)
class FleetSummary:
    total: int
    states: dict[str, int]
    not_healthy: int
    drained_by_slurmguard: int | None
    """Live count from Slurm; None when Slurm was not reachable."""
    drained_by_others: int | None
    quarantined: int
    terminal: int
    unregistered: int
    """Nodes Slurm shows drained by others that the database does not know."""


@dataclass(frozen=True)
class FleetFigures:
    """Computed from the database (Guard Table 3 reports the false-positive rate)."""

    incidents: int
    detection_delay_median_s: float | None
    quarantine_stays: int
    """Completed stays in quarantine."""
    quarantine_median_s: float | None
    quarantine_ongoing: int
    sweeps_final: int
    sweeps_passed: int
    sweep_pass_rate: float | None
    nodes_returned: int
    """Distinct nodes that went quarantined -> healthy (passed the gate)."""
    nodes_replaced: int
    """Distinct nodes that reached terminal."""
    drains_concluded: int
    """Drain episodes that ended (back to healthy, or terminal)."""
    drains_cleared: int
    """... of which the node came back through a passing sweep with no failed sweep or
    remediation in between: the drain was likely unnecessary."""
    false_positive_estimate: float | None


@dataclass(frozen=True)
class Report:
    generated_at: datetime
    filters: ReportFilters
    slurm: SlurmView
    summary: FleetSummary
    figures: FleetFigures
    rows: tuple[NodeRow, ...]
    partitions: tuple[str, ...]
