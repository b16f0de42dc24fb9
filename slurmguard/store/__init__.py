"""Storage: SQLAlchemy models, Alembic migrations (sql/migrations) and the typed Store API."""

from slurmguard.store.errors import (
    DatabaseUnavailable,
    IllegalTransition,
    InvalidValue,
    MigrationsMissing,
    NodeNotRegistered,
    NotFound,
    SchemaNotCurrent,
    StaleState,
    StoreError,
)
from slurmguard.store.lifecycle import ALLOWED, NodeState
from slurmguard.store.models import (
    ActionStatus,
    AuditOutcome,
    IncidentStatus,
    IncidentTier,
    SweepKind,
    TriageRung,
    Verdict,
)
from slurmguard.store.records import (
    AuditRecord,
    IncidentRecord,
    IntentRecord,
    NodeRecord,
    StepTimeRecord,
    SweepRecord,
    TelemetrySummaryRecord,
    TransitionRecord,
    TriageActionRecord,
)
from slurmguard.store.repository import Store, utc

__all__ = [
    "ALLOWED",
    "ActionStatus",
    "AuditOutcome",
    "AuditRecord",
    "DatabaseUnavailable",
    "IllegalTransition",
    "IncidentRecord",
    "IncidentStatus",
    "IncidentTier",
    "IntentRecord",
    "InvalidValue",
    "MigrationsMissing",
    "NodeRecord",
    "NodeState",
    "NotFound",
    "SchemaNotCurrent",
    "StaleState",
    "StepTimeRecord",
    "Store",
    "StoreError",
    "SweepKind",
    "SweepRecord",
    "TelemetrySummaryRecord",
    "TransitionRecord",
    "TriageActionRecord",
    "TriageRung",
    "NodeNotRegistered",
    "Verdict",
    "utc",
]
