"""Column types and value conversions that behave the same on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from datetime import UTC, date, datetime
from pathlib import PurePath
from typing import Any

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from slurmguard.store.errors import InvalidValue

# What callers may pass as a time: an aware datetime or Unix epoch seconds
# (what slurmguard.clock.Clock.now() returns).
Timestamp = datetime | float | int


def to_utc(value: Timestamp, what: str = "time") -> datetime:
    """An aware UTC datetime from an aware datetime or epoch seconds.

    Naive datetimes are refused: their zone is a guess, and a guessed zone
    silently shifts detection delays by hours.
    """
    if isinstance(value, bool):
        raise InvalidValue(f"{what}: expected a datetime or epoch seconds, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise InvalidValue(f"{what}: epoch seconds must be finite, got {value!r}")
        return datetime.fromtimestamp(float(value), tz=UTC)
    if isinstance(value, datetime):
        if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
            raise InvalidValue(
                f"{what}: naive datetime {value.isoformat()} (give a timezone or epoch seconds)"
            )
        return value.astimezone(UTC)
    raise InvalidValue(f"{what}: expected a datetime or epoch seconds, got {type(value).__name__}")


class UTCDateTime(TypeDecorator[datetime]):
    """TIMESTAMP WITH TIME ZONE on PostgreSQL, ISO text on SQLite; always aware UTC in Python.

    SQLite has no zone-aware type, so values are stored as naive UTC text
    (which sorts and compares correctly) and given back their UTC zone on load.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        aware = to_utc(value)
        if dialect.name == "sqlite":
            return aware.replace(tzinfo=None)
        return aware

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def jsonable(value: Any, what: str = "value") -> Any:
    """A JSON-ready copy of `value`, so what is read back equals what was stored.

    Accepts what detectors naturally produce: dicts with str keys, lists,
    tuples, sets (sorted), numpy scalars and arrays, datetimes (ISO 8601 UTC),
    enums (their value), paths, dataclasses and pydantic models. JSON has no
    NaN/Infinity, so non-finite floats become null. Anything else raises
    InvalidValue naming the offending key path.
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value, what)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, datetime):
        return to_utc(value, what).isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if isinstance(k, enum.Enum):
                k = k.value
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise InvalidValue(f"{what}: JSON object keys must be strings, got {k!r}")
            out[str(k)] = jsonable(v, f"{what}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{what}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(
            (jsonable(v, what) for v in value),
            key=lambda x: json.dumps(x, sort_keys=True),
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value), what)
    # numpy / pydantic without importing them: duck-typed conversions.
    if hasattr(value, "model_dump") and callable(value.model_dump):
        return jsonable(value.model_dump(mode="json"), what)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalar or array
        return jsonable(value.tolist(), what)
    raise InvalidValue(f"{what}: {type(value).__name__} is not JSON-serialisable")


def dumps(value: Any) -> str:
    """The engine's JSON serializer: strict (no NaN), after jsonable()."""
    return json.dumps(jsonable(value), allow_nan=False, separators=(",", ":"))
