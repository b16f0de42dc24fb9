"""Sweeps: the 1-node and 2-node health-check jobs run on a quarantined node, from
submission to their verdict (a final verdict is a fact; a re-sweep is a new row)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session, aliased

from slurmguard.store.checks import get_row, json_object, member, opt_job, value_of
from slurmguard.store.core import NodeIds, StoreCore
from slurmguard.store.errors import InvalidValue
from slurmguard.store.models import Node, Sweep, SweepKind, Verdict
from slurmguard.store.query import Query
from slurmguard.store.records import SweepRecord, from_row
from slurmguard.store.types import Timestamp, to_utc

_FINAL_VERDICTS = frozenset({Verdict.PASS, Verdict.FAIL, Verdict.ERROR})


class SweepStore(StoreCore):
    """The sweeps table."""

    def add_sweep(
        self,
        node: str,
        kind: SweepKind | str,
        *,
        reference_node: str | None = None,
        hw_class: str | None = None,
        slurm_job_id: str | None = None,
        submitted_at: Timestamp | None = None,
    ) -> SweepRecord:
        """A pending sweep of `node`; 2-node sweeps need a known-good `reference_node`.

        hw_class defaults to the node's class (baselines are per class).
        """
        k = member(SweepKind, kind, "sweep kind")
        if k is SweepKind.TWO_NODE and not reference_node:
            raise InvalidValue(f"2node sweep of {node}: a reference node is required")
        if k is SweepKind.ONE_NODE and reference_node:
            raise InvalidValue(f"1node sweep of {node}: takes no reference node (got {reference_node})")
        if reference_node == node:
            raise InvalidValue(f"2node sweep of {node}: the reference node must be another node")
        with self._tx() as s:
            ids = NodeIds(s)
            node_id = ids[node]
            ref_id = ids[reference_node] if reference_node else None
            row = Sweep(
                slurm_job_id=opt_job(slurm_job_id),
                kind=k.value,
                node_id=node_id,
                reference_node_id=ref_id,
                hw_class=hw_class or ids.hw_class(node),
                created_at=self.now(),
                submitted_at=None if submitted_at is None else to_utc(submitted_at, "submitted_at"),
                started_at=None,
                finished_at=None,
                metrics={},
                verdict=Verdict.PENDING.value,
                failure_reason=None,
            )
            s.add(row)
            s.flush()
            return from_row(SweepRecord, row, node=node, reference_node=reference_node)

    def update_sweep(
        self,
        sweep_id: int,
        *,
        slurm_job_id: str | None = None,
        submitted_at: Timestamp | None = None,
        started_at: Timestamp | None = None,
        finished_at: Timestamp | None = None,
        metrics: dict[str, Any] | None = None,
        verdict: Verdict | str | None = None,
        failure_reason: str | None = None,
    ) -> SweepRecord:
        """Fill in a sweep as it progresses (None = keep).

        A final verdict (pass/fail/error) is a fact: it may be written again
        unchanged (restart safety) but never changed; a re-sweep is a new row.
        fail and error need a failure_reason. finished_at defaults to now when
        a final verdict is set. `metrics` replaces the stored metrics.
        """
        with self._tx() as s:
            row = get_row(s, Sweep, sweep_id, "sweep")
            old = Verdict(row.verdict)
            if verdict is not None:
                new = member(Verdict, verdict, "sweep verdict")
                if old in _FINAL_VERDICTS and new != old:
                    raise InvalidValue(
                        f"sweep {sweep_id}: verdict is already {old.value}; "
                        f"cannot change it to {new.value} (start a new sweep)"
                    )
                reason = failure_reason if failure_reason is not None else row.failure_reason
                if new in (Verdict.FAIL, Verdict.ERROR) and not reason:
                    raise InvalidValue(f"sweep {sweep_id}: verdict {new.value} needs a failure_reason")
                row.verdict = new.value
                if new in _FINAL_VERDICTS and row.finished_at is None and finished_at is None:
                    row.finished_at = self.now()
            if slurm_job_id is not None:
                row.slurm_job_id = opt_job(slurm_job_id)
            for field, ts in (
                ("submitted_at", submitted_at),
                ("started_at", started_at),
                ("finished_at", finished_at),
            ):
                if ts is not None:
                    setattr(row, field, to_utc(ts, field))
            if metrics is not None:
                row.metrics = json_object(metrics, "metrics")
            if failure_reason is not None:
                row.failure_reason = failure_reason
            s.flush()
            return _record(s, row)

    def get_sweep(self, sweep_id: int) -> SweepRecord:
        with self._tx() as s:
            return _record(s, get_row(s, Sweep, sweep_id, "sweep"))

    def sweep_by_job(self, slurm_job_id: str) -> SweepRecord | None:
        """The sweep submitted as Slurm job `slurm_job_id` (the newest, if ids were reused)."""
        q = Query(Sweep, order=(Sweep.id,)).eq(Sweep.slurm_job_id, str(slurm_job_id))
        with self._tx() as s:
            rows = q.rows(s, limit=1)
            return _record(s, rows[0]) if rows else None

    def sweeps(
        self,
        *,
        node: str | None = None,
        hw_class: str | None = None,
        kind: SweepKind | str | None = None,
        verdict: Verdict | str | Iterable[Verdict | str] | None = None,
        since: Timestamp | None = None,
        limit: int | None = None,
    ) -> list[SweepRecord]:
        """Sweeps by creation time, oldest first (the newest `limit` when given).

        e.g. class baselines: sweeps(hw_class="h100", kind="1node", verdict="pass", limit=50).
        """
        ref = aliased(Node)
        q = (
            Query.named(Sweep, order=(Sweep.created_at, Sweep.id))
            .join(
                ref,
                ref.id == Sweep.reference_node_id,
                outer=True,
                columns={"reference_node": ref.name},
            )
            .eq(Node.name, node)
            .eq(Sweep.hw_class, hw_class)
            .eq(Sweep.kind, kind, value_of(SweepKind, "sweep kind"))
            .among(Sweep.verdict, verdict, value_of(Verdict, "sweep verdict"))
            .since(Sweep.created_at, since)
        )
        return self._records(q, SweepRecord, limit)


def _record(s: Session, row: Sweep) -> SweepRecord:
    """The record of `row`, its node names read by id in session `s`."""
    name = s.get_one(Node, row.node_id).name
    ref = s.get_one(Node, row.reference_node_id).name if row.reference_node_id else None
    return from_row(SweepRecord, row, node=name, reference_node=ref)
