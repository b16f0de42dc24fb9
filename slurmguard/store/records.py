"""Typed, immutable records the Store returns (and takes, for batch inserts).

They carry no database session, so callers can keep them after the
transaction ends. Times are aware UTC datetimes; use `utc()` to build one from
Clock.now() epoch seconds. `from_row` builds one from an ORM row.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

from slurmguard.store.lifecycle import NodeState
from slurmguard.store.models import (
    ActionStatus,
    AuditOutcome,
    IncidentStatus,
    IncidentTier,
    SweepKind,
    TriageRung,
    Verdict,
)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    id: int
    name: str
    hw_class: str | None
    state: NodeState
    state_since: datetime
    partitions: tuple[str, ...]
    last_seen: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    id: int
    node: str
    at: datetime
    from_state: NodeState | None
    """None on the row that registered the node."""
    to_state: NodeState
    cause: str
    evidence: dict[str, Any]
    actor: str
    forced: bool


@dataclass(frozen=True, slots=True)
class IncidentRecord:
    id: int
    job_id: str
    kind: str
    nodes: tuple[str, ...]
    tier: IncidentTier
    slowdown: float | None
    onset_at: datetime
    detected_at: datetime
    action_at: datetime | None
    detection_delay_s: float
    status: IncidentStatus
    outcome: str | None
    evidence: dict[str, Any]
    created_at: datetime
    updated_at: datetime

    @property
    def action_delay_s(self) -> float | None:
        """Seconds from detection to the action, None before any action."""
        return None if self.action_at is None else (self.action_at - self.detected_at).total_seconds()


@dataclass(frozen=True, slots=True)
class TelemetrySummaryRecord:
    """One signal of one node over one window, compared with the job's peers."""

    node: str
    signal: str
    window_start: datetime
    window_end: datetime
    value: float | None
    unit: str | None = None
    peer_median: float | None = None
    robust_z: float | None = None
    deviating: bool = False
    job_id: str | None = None
    id: int | None = None
    """None until stored."""


@dataclass(frozen=True, slots=True)
class StepTimeRecord:
    """Mean training step time of one rank (or node, rank=None) over one window, seconds."""

    job_id: str
    step: str
    node: str
    rank: int | None
    window_start: datetime
    window_end: datetime
    iterations: int
    mean_step_s: float
    baseline_step_s: float | None = None
    slowdown: float | None = None
    """Fraction; computed as mean/baseline - 1 when left None and a baseline is given."""
    id: int | None = None


@dataclass(frozen=True, slots=True)
class SweepRecord:
    id: int
    slurm_job_id: str | None
    kind: SweepKind
    node: str
    reference_node: str | None
    hw_class: str | None
    created_at: datetime
    submitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    metrics: dict[str, Any]
    verdict: Verdict
    failure_reason: str | None


@dataclass(frozen=True, slots=True)
class TriageActionRecord:
    id: int
    node: str
    rung: TriageRung
    at: datetime
    is_entry: bool
    status: ActionStatus
    finished_at: datetime | None
    detail: str | None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    id: int
    at: datetime
    actor: str
    action: str
    node: str | None
    job_id: str | None
    reason: str | None
    argv: tuple[str, ...] | None
    outcome: AuditOutcome
    error: str | None
    evidence: dict[str, Any]


@dataclass(frozen=True, slots=True)
class IntentRecord:
    """A Slurm action about to be taken (store.audit.AuditLog.open_intent)."""

    id: int
    at: datetime
    actor: str
    action: str
    node: str | None
    job_id: str | None
    reason: str | None
    argv: tuple[str, ...] | None
    evidence: dict[str, Any]
    effects: tuple[Any, ...]
    closed_at: datetime | None
    audit_id: int | None


R = TypeVar("R")


def from_row(cls: type[R], row: object, **given: Any) -> R:
    """The record `cls` holding `row`'s attributes of the same names; `given` supplies
    the fields the row lacks (a joined node name) or overrides one.

    Values take the field's type: enum fields get the enum member, bool fields a bool,
    tuple fields a tuple (an empty one for NULL unless the field is optional), dict
    fields a copy, so a record shares nothing with the session's rows."""
    return cls(
        **{
            name: given[name] if name in given else conv(getattr(row, name))
            for name, conv in _converters(cls)
        }
    )


_CONVERTERS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def _converters(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """(field name, converter) of each field of record class `cls`, worked out once."""
    if cls not in _CONVERTERS:
        hints = typing.get_type_hints(cls)
        _CONVERTERS[cls] = tuple((f.name, _converter(hints[f.name])) for f in fields(cls))
    return _CONVERTERS[cls]


def _converter(hint: Any) -> Callable[[Any], Any]:
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    origin = typing.get_origin(base) or base
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        make: Callable[[Any], Any] = origin
    elif origin is bool:
        make = bool
    elif origin is tuple:
        make = tuple
        if not optional:
            return lambda v: () if v is None else tuple(v)
    elif origin is dict:
        make = dict
    else:
        return _as_is
    return (lambda v: None if v is None else make(v)) if optional else make


def _as_is(v: Any) -> Any:
    return v
