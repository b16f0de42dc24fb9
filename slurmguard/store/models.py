"""SQLAlchemy 2 models of slurmguard's database.

The migrations under sql/migrations are the source of truth for the schema;
these models must match them (tests/test_store_schema.py runs Alembic's
autogenerate comparison on SQLite and PostgreSQL and expects no difference).
Change a model -> add a migration in the same commit.

Enum-like columns are short strings with named CHECK constraints rather than
native enums: PostgreSQL enum types are awkward to migrate and SQLite has none.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from slurmguard.store.lifecycle import NodeState
from slurmguard.store.types import UTCDateTime

# Deterministic constraint names, identical on both backends, so later
# migrations can drop/alter constraints by name.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Big ids for the high-volume tables; SQLite only autoincrements INTEGER keys.
BigId = BigInteger().with_variant(Integer(), "sqlite")

NAME_LEN = 128
JOB_LEN = 64


class SweepKind(StrEnum):
    ONE_NODE = "1node"
    TWO_NODE = "2node"


class Verdict(StrEnum):
    PENDING = "pending"
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    """The sweep crashed or timed out; treated as a failure by the gate."""


class TriageRung(StrEnum):
    RESWEEP = "resweep"
    REBOOT = "reboot"
    REIMAGE = "reimage"
    TERMINAL = "terminal"


class ActionStatus(StrEnum):
    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"


class AuditOutcome(StrEnum):
    OK = "ok"
    ERROR = "error"
    DRY_RUN = "dry_run"


class IncidentTier(StrEnum):
    NONE = "none"
    """Detected but no action (below threshold, breaker open)."""
    VERIFY = "verify"
    """No observable impact: node marked pending verification."""
    DRAIN = "drain"
    """Moderate sustained slowdown: drain, checkpoint, free at next exit."""
    REQUEUE = "requeue"
    """Severe slowdown or stall: drain and requeue the job now."""


class IncidentStatus(StrEnum):
    OPEN = "open"
    MITIGATED = "mitigated"
    RESOLVED = "resolved"
    FALSE_POSITIVE = "false_positive"
    SUPPRESSED = "suppressed"
    """An action was due but safety (breaker, rate limit, dry run) held it back."""


def _in(column: str, enum: type[StrEnum], *, nullable: bool = False) -> str:
    values = ", ".join(f"'{e.value}'" for e in enum)
    cond = f"{column} IN ({values})"
    return f"{column} IS NULL OR {cond}" if nullable else cond


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        CheckConstraint(_in("state", NodeState), name="state"),
        Index("ix_nodes_state", "state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    hw_class: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    state_since: Mapped[datetime]
    partitions: Mapped[list[Any]]
    """Slurm partitions the node belongs to (list of names)."""
    last_seen: Mapped[datetime | None]
    """Last agent report or Slurm sighting."""
    created_at: Mapped[datetime]

    transitions: Mapped[list[NodeTransition]] = relationship(
        back_populates="node",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="NodeTransition.id",
    )


class NodeTransition(Base):
    __tablename__ = "node_transitions"
    __table_args__ = (
        CheckConstraint(_in("from_state", NodeState, nullable=True), name="from_state"),
        CheckConstraint(_in("to_state", NodeState), name="to_state"),
        Index("ix_node_transitions_node_at", "node_id", "at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    at: Mapped[datetime]
    from_state: Mapped[str | None] = mapped_column(String(16))
    """None for the row that registers a new node."""
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(String(256))
    evidence: Mapped[dict[str, Any]]
    actor: Mapped[str] = mapped_column(String(64))
    forced: Mapped[bool] = mapped_column(Boolean)
    """True when an admin override allowed an otherwise illegal transition."""

    node: Mapped[Node] = relationship(back_populates="transitions")


class Incident(Base):
    __tablename__ = "incidents"
    __table_args__ = (
        CheckConstraint(_in("tier", IncidentTier), name="tier"),
        CheckConstraint(_in("status", IncidentStatus), name="status"),
        Index("ix_incidents_job_id", "job_id"),
        Index("ix_incidents_detected_at", "detected_at"),
        Index("ix_incidents_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(String(JOB_LEN))
    kind: Mapped[str] = mapped_column(String(32))
    """What was seen: 'slowdown', 'stall', 'telemetry', ... (free text, short)."""
    nodes: Mapped[list[Any]]
    """Names of the nodes the cause was localised to."""
    tier: Mapped[str] = mapped_column(String(16))
    slowdown: Mapped[float | None] = mapped_column(Float)
    """Step-time slowdown as a fraction (0.12 = 12 % slower than baseline)."""
    onset_at: Mapped[datetime]
    detected_at: Mapped[datetime]
    action_at: Mapped[datetime | None]
    detection_delay_s: Mapped[float] = mapped_column(Float)
    """detected_at - onset_at, seconds."""
    status: Mapped[str] = mapped_column(String(16))
    outcome: Mapped[str | None] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class TelemetrySummary(Base):
    __tablename__ = "telemetry_summaries"
    __table_args__ = (
        Index("ix_telemetry_summaries_node_signal_end", "node_id", "signal", "window_end"),
        Index("ix_telemetry_summaries_window_end", "window_end"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(JOB_LEN))
    window_start: Mapped[datetime]
    window_end: Mapped[datetime]
    signal: Mapped[str] = mapped_column(String(64))
    """e.g. gpu_temp_c, sm_clock_mhz, power_w, nic_errors."""
    value: Mapped[float | None] = mapped_column(Float)
    unit: Mapped[str | None] = mapped_column(String(16))
    peer_median: Mapped[float | None] = mapped_column(Float)
    robust_z: Mapped[float | None] = mapped_column(Float)
    """(value - peer median) / (1.4826 * peer MAD)."""
    deviating: Mapped[bool] = mapped_column(Boolean)


class StepTimeSummary(Base):
    __tablename__ = "step_time_summaries"
    __table_args__ = (
        Index("ix_step_time_summaries_job_end", "job_id", "window_end"),
        Index("ix_step_time_summaries_node_end", "node_id", "window_end"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[str] = mapped_column(String(JOB_LEN))
    step: Mapped[str] = mapped_column(String(32))
    """Slurm step id ('0', 'batch', ...)."""
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rank: Mapped[int | None] = mapped_column(Integer)
    """Global rank, or None for a per-node aggregate."""
    window_start: Mapped[datetime]
    window_end: Mapped[datetime]
    iterations: Mapped[int] = mapped_column(Integer)
    mean_step_s: Mapped[float] = mapped_column(Float)
    baseline_step_s: Mapped[float | None] = mapped_column(Float)
    slowdown: Mapped[float | None] = mapped_column(Float)
    """mean_step_s / baseline_step_s - 1 (fraction)."""


class Sweep(Base):
    __tablename__ = "sweeps"
    __table_args__ = (
        CheckConstraint(_in("kind", SweepKind), name="kind"),
        CheckConstraint(_in("verdict", Verdict), name="verdict"),
        Index("ix_sweeps_node_created", "node_id", "created_at"),
        Index("ix_sweeps_class_kind_verdict", "hw_class", "kind", "verdict"),
        Index("ix_sweeps_slurm_job_id", "slurm_job_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    slurm_job_id: Mapped[str | None] = mapped_column(String(JOB_LEN))
    """None until sbatch has accepted the sweep job."""
    kind: Mapped[str] = mapped_column(String(8))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    """The node under test."""
    reference_node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    """Known-good partner of a 2-node sweep."""
    hw_class: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime]
    submitted_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    metrics: Mapped[dict[str, Any]]
    verdict: Mapped[str] = mapped_column(String(8))
    failure_reason: Mapped[str | None] = mapped_column(Text)

    node: Mapped[Node] = relationship(foreign_keys=[node_id])
    reference_node: Mapped[Node | None] = relationship(foreign_keys=[reference_node_id])


class TriageAction(Base):
    __tablename__ = "triage_actions"
    __table_args__ = (
        CheckConstraint(_in("rung", TriageRung), name="rung"),
        CheckConstraint(_in("status", ActionStatus), name="status"),
        Index("ix_triage_actions_node_at", "node_id", "at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rung: Mapped[str] = mapped_column(String(16))
    at: Mapped[datetime]
    is_entry: Mapped[bool] = mapped_column(Boolean)
    """True for the first action of a triage episode (what Guard 6 counts)."""
    status: Mapped[str] = mapped_column(String(16))
    finished_at: Mapped[datetime | None]
    detail: Mapped[str | None] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]]

    node: Mapped[Node] = relationship()


class _SlurmAction:
    """The columns an audit row and an action intent share: one Slurm action."""

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32))
    """drain, resume, comment, requeue, reservation_create, reboot, sbatch, ..."""
    # A name, not a foreign key: the audit log is append-only history and must
    # outlive node rows (and name things that never were nodes in the table).
    node: Mapped[str | None] = mapped_column(String(NAME_LEN))
    job_id: Mapped[str | None] = mapped_column(String(JOB_LEN))
    reason: Mapped[str | None] = mapped_column(Text)
    argv: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True))
    """The exact command line run (or that would have run, for dry_run)."""
    evidence: Mapped[dict[str, Any]]
    """For an intent: the audit evidence, lease_epoch included, and what reconciling needs."""


class AuditEntry(_SlurmAction, Base):
    __tablename__ = "audit_log"
    __table_args__ = (
        CheckConstraint(_in("outcome", AuditOutcome), name="outcome"),
        Index("ix_audit_log_at", "at"),
        Index("ix_audit_log_node_at", "node", "at"),
        Index("ix_audit_log_action_at", "action", "at"),
    )

    outcome: Mapped[str] = mapped_column(String(8))
    error: Mapped[str | None] = mapped_column(Text)


class ActionIntent(_SlurmAction, Base):
    """Write-ahead record of one Slurm action (respond.actions.ActionExecutor): written
    before the Slurm call, closed with the action's audit row (in one transaction)
    after it. One left open belongs to a controller that stopped in between; the
    next one reconciles it against Slurm's state and closes it, so every action
    ends with exactly one audit row."""

    __tablename__ = "action_intents"
    __table_args__ = (Index("ix_action_intents_closed_at", "closed_at"),)

    # at: when the action was about to be taken (the late audit row's time)
    effects: Mapped[list[Any]] = mapped_column(JSON)
    """Store changes that go with the action (respond.actions.apply_effects)."""
    closed_at: Mapped[datetime | None]
    audit_id: Mapped[int | None] = mapped_column(BigInteger)
    """The audit row that closed it (None: closed without one, for a dry run)."""
