"""Per-window summaries the controller keeps for reports and replays: telemetry
signals compared with the job's peers, and step times per rank. High-volume and
pruned by age (prune_summaries)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from sqlalchemy import CursorResult, delete

from slurmguard.store.checks import job, number, opt_job, short, window
from slurmguard.store.core import NodeIds, StoreCore
from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import Base, Node, StepTimeSummary, TelemetrySummary
from slurmguard.store.query import Query
from slurmguard.store.records import StepTimeRecord, TelemetrySummaryRecord
from slurmguard.store.types import Timestamp, to_utc

W = TypeVar("W", TelemetrySummaryRecord, StepTimeRecord)


class SummaryStore(StoreCore):
    """The telemetry_summaries and step_time_summaries tables."""

    def add_telemetry_summaries(self, rows: Iterable[TelemetrySummaryRecord]) -> int:
        """Store peer-compared telemetry windows; nodes must be registered. Returns the count."""
        return self._add_windows(rows, _telemetry_row)

    def telemetry_summaries(
        self,
        node: str | None = None,
        *,
        signal: str | None = None,
        job_id: str | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[TelemetrySummaryRecord]:
        """Windows by end time, oldest first (the newest `limit` when given); `since`
        compares window_end."""
        q = (
            Query.named(
                TelemetrySummary,
                order=(TelemetrySummary.window_end, TelemetrySummary.id),
            )
            .eq(Node.name, node)
            .eq(TelemetrySummary.signal, signal)
            .eq(TelemetrySummary.job_id, job_id, str)
            .since(TelemetrySummary.window_end, since)
        )
        return self._records(q, TelemetrySummaryRecord, limit)

    def add_step_time_summaries(self, rows: Iterable[StepTimeRecord]) -> int:
        """Store per-rank step-time windows (seconds); slowdown (a fraction) is
        mean/baseline - 1 when absent and a positive baseline is given. Nodes must be
        registered. Returns the count."""
        return self._add_windows(rows, _step_time_row)

    def step_time_summaries(
        self,
        *,
        job_id: str | None = None,
        node: str | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[StepTimeRecord]:
        """Windows by end time, oldest first (the newest `limit` when given); `since`
        compares window_end."""
        q = (
            Query.named(StepTimeSummary, order=(StepTimeSummary.window_end, StepTimeSummary.id))
            .eq(StepTimeSummary.job_id, job_id, str)
            .eq(Node.name, node)
            .since(StepTimeSummary.window_end, since)
        )
        return self._records(q, StepTimeRecord, limit)

    def prune_summaries(self, before: Timestamp) -> int:
        """Delete telemetry and step-time windows that ended before `before`; returns rows deleted."""
        cutoff = to_utc(before, "before")
        with self._tx() as s:
            # DML returns a CursorResult (with rowcount); Session.execute is typed for SELECT
            n = cast(
                CursorResult[Any],
                s.execute(delete(TelemetrySummary).where(TelemetrySummary.window_end < cutoff)),
            ).rowcount
            n += cast(
                CursorResult[Any],
                s.execute(delete(StepTimeSummary).where(StepTimeSummary.window_end < cutoff)),
            ).rowcount
            return int(n or 0)

    def _add_windows(self, rows: Iterable[W], build: Callable[[W, NodeIds], Base]) -> int:
        """Insert build(record, node ids) for every record, in one transaction."""
        with self._tx() as s:
            ids = NodeIds(s)
            objs = [build(r, ids) for r in rows]
            s.add_all(objs)
            s.flush()
            return len(objs)


def _telemetry_row(r: TelemetrySummaryRecord, ids: NodeIds) -> TelemetrySummary:
    start, end = window(r.window_start, r.window_end, f"telemetry {r.node}/{r.signal}")
    return TelemetrySummary(
        node_id=ids[r.node],
        job_id=opt_job(r.job_id),
        window_start=start,
        window_end=end,
        signal=short(r.signal, 64, "telemetry signal"),
        value=number(r.value),
        unit=r.unit,
        peer_median=number(r.peer_median),
        robust_z=number(r.robust_z),
        deviating=bool(r.deviating),
    )


def _step_time_row(r: StepTimeRecord, ids: NodeIds) -> StepTimeSummary:
    what = f"step time of job {r.job_id} rank {r.rank}"
    start, end = window(r.window_start, r.window_end, what)
    mean = number(r.mean_step_s)
    if mean is None or mean <= 0:
        raise InvalidValue(f"{what}: mean_step_s must be a positive number, got {r.mean_step_s!r}")
    if r.iterations < 0:
        raise InvalidValue(f"{what}: iterations must be >= 0, got {r.iterations}")
    base = number(r.baseline_step_s)
    slow = number(r.slowdown)
    if slow is None and base is not None and base > 0:
        slow = mean / base - 1.0
    return StepTimeSummary(
        job_id=job(r.job_id),
        step=short(str(r.step), 32, "job step"),
        node_id=ids[r.node],
        rank=r.rank,
        window_start=start,
        window_end=end,
        iterations=int(r.iterations),
        mean_step_s=mean,
        baseline_step_s=base,
        slowdown=slow,
    )
