"""Checks of the values the Store writes, shared by every aggregate.

Each returns the value to store, or raises InvalidValue (NodeNotRegistered, NotFound
for a missing row) naming the field and the bad value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from slurmguard.names import NODE_NAME_RULE, is_node_name
from slurmguard.store.errors import InvalidValue, NotFound
from slurmguard.store.types import Timestamp, jsonable, to_utc

DEFAULT_ACTOR = "slurmguard"
"""Who a transition or audit row names when the caller does not say."""

E = TypeVar("E")


def check_name(name: str) -> str:
    if not is_node_name(name):
        raise InvalidValue(f"invalid node name {name!r} ({NODE_NAME_RULE})")
    return name


def check_actor(actor: str) -> str:
    return short(actor, 64, "actor")


def short(value: str, n: int, what: str) -> str:
    """A non-empty string of at most n characters."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue(f"{what} must be a non-empty string")
    if len(value) > n:
        raise InvalidValue(f"{what} '{value[:40]}...' is longer than {n} characters")
    return value


def job(job_id: str | int) -> str:
    """A Slurm job id as stored: a string of at most 64 characters."""
    return short(str(job_id), 64, "job id")


def opt_job(v: str | int | None) -> str | None:
    return None if v is None else job(v)


def number(v: float | None) -> float | None:
    """A float, or None for None and for NaN/inf ("not measured")."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise InvalidValue(f"expected a number, got {v!r}") from None
    # NaN is "not measured": store NULL, which every backend compares sanely.
    return f if math.isfinite(f) else None


def partition_names(parts: Sequence[str]) -> tuple[str, ...]:
    """Partition names from a sequence or one comma-separated string."""
    if isinstance(parts, str):
        parts = [p for p in parts.split(",") if p]
    out = tuple(str(p) for p in parts)
    for p in out:
        short(p, 64, "partition name")
    return out


def arg_list(args: Sequence[str]) -> list[str]:
    if isinstance(args, str):
        raise InvalidValue("argv must be a list of arguments, not one string")
    out = list(args)
    for a in out:
        if not isinstance(a, str):
            raise InvalidValue(f"argv element {a!r} is not a string")
    return out


def json_object(ev: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """A JSON-storable copy of a dict ({} for None)."""
    if ev is None:
        return {}
    if not isinstance(ev, dict):
        raise InvalidValue(f"{what} must be a JSON object (dict), got {type(ev).__name__}")
    out: dict[str, Any] = jsonable(ev, what)
    return out


def member(cls: type[E], value: Any, what: str) -> E:
    """The member of enum `cls` for `value`, naming the allowed values if none."""
    try:
        return cls(value)  # type: ignore[call-arg]
    except ValueError:
        allowed = ", ".join(e.value for e in cls)  # type: ignore[attr-defined]
        raise InvalidValue(f"{what} '{value}' is not one of: {allowed}") from None


def value_of(cls: type[E], what: str) -> Callable[[Any], str]:
    """A parser for Query filters: the stored string of `cls`'s member for a value
    (InvalidValue as in `member`)."""
    return lambda value: member(cls, value, what).value  # type: ignore[attr-defined]


def window(start: Timestamp, end: Timestamp, what: str) -> tuple[datetime, datetime]:
    """(start, end) as UTC datetimes; the end may not come before the start."""
    a, b = to_utc(start, f"{what} window_start"), to_utc(end, f"{what} window_end")
    if b < a:
        raise InvalidValue(f"{what}: window ends ({b.isoformat()}) before it starts ({a.isoformat()})")
    return a, b


def get_row(s: Session, model: type[E], ident: int, what: str) -> E:
    """The row of `model` with primary key `ident`, or NotFound."""
    row = s.get(model, ident)
    if row is None:
        raise NotFound(f"{what} {ident}: no such row")
    return row
