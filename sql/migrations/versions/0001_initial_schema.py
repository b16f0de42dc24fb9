"""initial schema: nodes and lifecycle transitions, incidents, summaries, sweeps, triage, audit log

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Frozen copy of the schema at this revision: it deliberately imports nothing
from slurmguard, so later model changes cannot rewrite history. Constraint
names are wrapped in op.f() ("final") because env.py's target metadata carries
a naming convention that would otherwise be applied on top of them. Later changes
go into new revisions (`alembic -c sql/alembic.ini revision --autogenerate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = ("healthy", "suspect", "draining", "quarantined", "remediation", "terminal")


def _in(column: str, values: Sequence[str], nullable: bool = False) -> str:
    cond = f"{column} IN ({', '.join(repr(v) for v in values)})"
    return f"{column} IS NULL OR {cond}" if nullable else cond


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _big_id() -> sa.Column:
    # BIGINT ids on PostgreSQL; SQLite only autoincrements INTEGER primary keys.
    return sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False)


def _node_fk(table: str, column: str = "node_id", ondelete: str = "CASCADE") -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [column],
        ["nodes.id"],
        name=op.f(f"fk_{table}_{column}_nodes"),
        ondelete=ondelete,
    )


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("hw_class", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        _ts("state_since"),
        sa.Column("partitions", sa.JSON(), nullable=False),
        _ts("last_seen", nullable=True),
        _ts("created_at"),
        sa.CheckConstraint(_in("state", STATES), name=op.f("ck_nodes_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_index("ix_nodes_state", "nodes", ["state"])

    op.create_table(
        "node_transitions",
        _big_id(),
        sa.Column("node_id", sa.Integer(), nullable=False),
        _ts("at"),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("cause", sa.String(256), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.CheckConstraint(
            _in("from_state", STATES, nullable=True),
            name=op.f("ck_node_transitions_from_state"),
        ),
        sa.CheckConstraint(_in("to_state", STATES), name=op.f("ck_node_transitions_to_state")),
        _node_fk("node_transitions"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_transitions")),
    )
    op.create_index("ix_node_transitions_node_at", "node_transitions", ["node_id", "at"])

    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("slowdown", sa.Float(), nullable=True),
        _ts("onset_at"),
        _ts("detected_at"),
        _ts("action_at", nullable=True),
        sa.Column("detection_delay_s", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.CheckConstraint(
            _in("tier", ("none", "verify", "drain", "requeue")),
            name=op.f("ck_incidents_tier"),
        ),
        sa.CheckConstraint(
            _in(
                "status",
                ("open", "mitigated", "resolved", "false_positive", "suppressed"),
            ),
            name=op.f("ck_incidents_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
    )
    op.create_index("ix_incidents_job_id", "incidents", ["job_id"])
    op.create_index("ix_incidents_detected_at", "incidents", ["detected_at"])
    op.create_index("ix_incidents_status", "incidents", ["status"])

    op.create_table(
        "telemetry_summaries",
        _big_id(),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        _ts("window_start"),
        _ts("window_end"),
        sa.Column("signal", sa.String(64), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(16), nullable=True),
        sa.Column("peer_median", sa.Float(), nullable=True),
        sa.Column("robust_z", sa.Float(), nullable=True),
        sa.Column("deviating", sa.Boolean(), nullable=False),
        _node_fk("telemetry_summaries"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_summaries")),
    )
    op.create_index(
        "ix_telemetry_summaries_node_signal_end",
        "telemetry_summaries",
        ["node_id", "signal", "window_end"],
    )
    op.create_index("ix_telemetry_summaries_window_end", "telemetry_summaries", ["window_end"])

    op.create_table(
        "step_time_summaries",
        _big_id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("step", sa.String(32), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        _ts("window_start"),
        _ts("window_end"),
        sa.Column("iterations", sa.Integer(), nullable=False),
        sa.Column("mean_step_s", sa.Float(), nullable=False),
        sa.Column("baseline_step_s", sa.Float(), nullable=True),
        sa.Column("slowdown", sa.Float(), nullable=True),
        _node_fk("step_time_summaries"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_time_summaries")),
    )
    op.create_index(
        "ix_step_time_summaries_job_end",
        "step_time_summaries",
        ["job_id", "window_end"],
    )
    op.create_index(
        "ix_step_time_summaries_node_end",
        "step_time_summaries",
        ["node_id", "window_end"],
    )

    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slurm_job_id", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("reference_node_id", sa.Integer(), nullable=True),
        sa.Column("hw_class", sa.String(64), nullable=True),
        _ts("created_at"),
        _ts("submitted_at", nullable=True),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("verdict", sa.String(8), nullable=False),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.CheckConstraint(_in("kind", ("1node", "2node")), name=op.f("ck_sweeps_kind")),
        sa.CheckConstraint(
            _in("verdict", ("pending", "pass", "fail", "error")),
            name=op.f("ck_sweeps_verdict"),
        ),
        _node_fk("sweeps"),
        _node_fk("sweeps", "reference_node_id", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    op.create_index("ix_sweeps_node_created", "sweeps", ["node_id", "created_at"])
    op.create_index("ix_sweeps_class_kind_verdict", "sweeps", ["hw_class", "kind", "verdict"])
    op.create_index("ix_sweeps_slurm_job_id", "sweeps", ["slurm_job_id"])

    op.create_table(
        "triage_actions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("rung", sa.String(16), nullable=False),
        _ts("at"),
        sa.Column("is_entry", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("finished_at", nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            _in("rung", ("resweep", "reboot", "reimage", "terminal")),
            name=op.f("ck_triage_actions_rung"),
        ),
        sa.CheckConstraint(
            _in("status", ("planned", "running", "done", "failed", "skipped")),
            name=op.f("ck_triage_actions_status"),
        ),
        _node_fk("triage_actions"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_triage_actions")),
    )
    op.create_index("ix_triage_actions_node_at", "triage_actions", ["node_id", "at"])

    op.create_table(
        "audit_log",
        _big_id(),
        _ts("at"),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("node", sa.String(128), nullable=True),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("argv", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("outcome", sa.String(8), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.CheckConstraint(
            _in("outcome", ("ok", "error", "dry_run")),
            name=op.f("ck_audit_log_outcome"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_node_at", "audit_log", ["node", "at"])
    op.create_index("ix_audit_log_action_at", "audit_log", ["action", "at"])


def downgrade() -> None:
    # Children before the nodes table they reference; indexes go with their tables.
    for table in (
        "audit_log",
        "triage_actions",
        "sweeps",
        "step_time_summaries",
        "telemetry_summaries",
        "incidents",
        "node_transitions",
        "nodes",
    ):
        op.drop_table(table)
