"""action intents: the write-ahead record of each Slurm action (closed by its audit row)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25

A controller writes an intent before each Slurm call and closes it with the
audit row after; one left open (its controller stopped in between) is
reconciled by the next controller against Slurm's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "action_intents",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("node", sa.String(128), nullable=True),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("argv", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("effects", sa.JSON(), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("audit_id", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_action_intents")),
    )
    op.create_index("ix_action_intents_closed_at", "action_intents", ["closed_at"])


def downgrade() -> None:
    op.drop_table("action_intents")
