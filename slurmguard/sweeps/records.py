"""How a judged sweep is kept in the database, and what the scheduler reads back from it.

The store's sweep row has a coarse verdict (pending/pass/fail/error) and a free `metrics`
document. The scheduler writes one `StoredOutcome` per judged sweep into `metrics`:

* ``outcome``: the sweep verdict's Outcome value (pass, bootstrap, fail, inconclusive,
  insufficient_baseline) or ``not_run`` (never submitted / never started);
* ``reason`` / ``detail``: the Slurm reason text and the long explanation;
* ``job_state``, ``runtime_s`` (seconds the job held its nodes), ``node_count``;
* ``basis`` / ``basis_nodes`` / ``reference_text``: which reference judged the metrics
  (class baseline, same-window peers, policy floor, or none) and the nodes behind it;
* ``failures``: the failing metric checks (at most 16);
* ``result``: the whole parsed result document (schema slurmguard.sweep), so class
  baselines and reference trust are rebuilt from the database after a restart.

Store verdict mapping: pass/bootstrap -> pass; a node-blaming fail of a measured result
-> fail; everything else (crash, timeout, no result, inconclusive, no baseline, not run)
-> error, which the gate also treats as "not passed".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slurmguard.store import SweepKind, SweepRecord
from slurmguard.store import Verdict as StoreVerdict
from slurmguard.sweeps.result import ResultError, SweepResult, parse_result
from slurmguard.sweeps.verdict import MetricCheck, Outcome, PastSweep, SweepJudgment

NOT_RUN = "not_run"
"""Outcome of a sweep that was never submitted or never started (no evidence either way)."""
KILLED = "killed"
"""Outcome of a sweep job Slurm cancelled or preempted before it wrote a result: recorded,
and submitted again (`SweepPolicy.killed_retries`); no evidence about the node."""
NO_EVIDENCE = (NOT_RUN, KILLED)

KIND_OF = {SweepKind.ONE_NODE: "node", SweepKind.TWO_NODE: "pair"}
"""Store sweep kind -> result/template kind."""


def store_verdict(v: SweepJudgment) -> StoreVerdict:
    if v.outcome.returns_node:
        return StoreVerdict.PASS
    if v.outcome is Outcome.FAIL and v.result is not None and not v.result.errors:
        return StoreVerdict.FAIL
    return StoreVerdict.ERROR


def _check_doc(c: MetricCheck) -> dict[str, Any]:
    return {
        "key": c.key,
        "label": c.label,
        "value": c.value,
        "reference": c.reference,
        "count": c.count,
        "basis": c.basis,
        "deviation": c.deviation,
    }


def outcome_metrics(
    v: SweepJudgment, *, job_state: str, runtime_s: float | None, node_count: int, result_path: str
) -> dict[str, Any]:
    """The `metrics` document of a judged sweep (see module docstring)."""
    return {
        "outcome": v.outcome.value,
        "reason": v.reason,
        "detail": v.detail[:2000],
        "job_state": job_state,
        "runtime_s": runtime_s,
        "node_count": node_count,
        "result_path": result_path,
        "basis": v.basis,
        "basis_nodes": list(v.basis_nodes),
        "reference_text": v.basis_text,
        "failures": [_check_doc(c) for c in v.failures[:16]],
        "result": v.result.to_dict() if v.result is not None else None,
    }


def not_run_metrics(
    reason: str,
    detail: str,
    *,
    node_count: int,
    outcome: str = NOT_RUN,
    job_state: str | None = None,
    runtime_s: float = 0.0,
) -> dict[str, Any]:
    return {
        "outcome": outcome,
        "reason": reason,
        "detail": detail[:2000],
        "job_state": job_state,
        "runtime_s": runtime_s,
        "node_count": node_count,
        "failures": [],
        "result": None,
    }


def outcome_of(rec: SweepRecord) -> str | None:
    """The stored outcome of a judged sweep; None while it is pending."""
    if rec.verdict is StoreVerdict.PENDING:
        return None
    out = rec.metrics.get("outcome") if isinstance(rec.metrics, dict) else None
    if isinstance(out, str):
        return out
    # rows written by something else than the scheduler: only the coarse verdict is known
    return {StoreVerdict.PASS: Outcome.PASS.value, StoreVerdict.FAIL: Outcome.FAIL.value}.get(
        rec.verdict, Outcome.FAIL.value
    )


def passed(rec: SweepRecord) -> bool:
    o = outcome_of(rec)
    return o in (Outcome.PASS.value, Outcome.BOOTSTRAP.value)


class ResultCache:
    """Parsed results by sweep id. A judged sweep's result never changes, and the
    scheduler reads the same history every tick (baselines, reference trust)."""

    def __init__(self, max_entries: int = 20000) -> None:
        self._parsed: dict[int, SweepResult | None] = {}
        self.max_entries = max_entries

    def get(self, rec: SweepRecord) -> SweepResult | None:
        if rec.verdict is StoreVerdict.PENDING:
            return None
        if rec.id not in self._parsed:
            if len(self._parsed) >= self.max_entries:
                self._parsed.clear()
            self._parsed[rec.id] = _parse_stored(rec)
        return self._parsed[rec.id]


def _parse_stored(rec: SweepRecord) -> SweepResult | None:
    doc = rec.metrics.get("result") if isinstance(rec.metrics, dict) else None
    if not isinstance(doc, dict):
        return None
    try:
        return parse_result(doc, f"sweep {rec.id}")
    except ResultError:
        return None


def result_of(rec: SweepRecord, cache: ResultCache | None = None) -> SweepResult | None:
    """The parsed result stored with a judged sweep (None if absent or unreadable)."""
    return cache.get(rec) if cache is not None else _parse_stored(rec)


def healthy_results(
    records: Iterable[SweepRecord], *, exclude_nodes: Iterable[str] = (), cache: ResultCache | None = None
) -> list[SweepResult]:
    """Results that may form a class baseline.

    Per node and kind only the latest judged sweep counts, and only when it passed: a node
    whose newest sweep failed no longer vouches for its class with an older pass.
    """
    excluded = set(exclude_nodes)
    latest: dict[tuple[str, SweepKind], SweepRecord] = {}
    for r in records:
        if r.verdict is StoreVerdict.PENDING or r.node in excluded:
            continue
        if outcome_of(r) in NO_EVIDENCE:
            continue
        key = (r.node, r.kind)
        if key not in latest or r.id > latest[key].id:
            latest[key] = r
    out = []
    for r in latest.values():
        if passed(r):
            res = result_of(r, cache)
            if res is not None:
                out.append(res)
    return out


def past_sweeps(records: Iterable[SweepRecord], cache: ResultCache | None = None) -> list[PastSweep]:
    """Judged sweeps with a result, for reference trust (verdict.reference_status)."""
    out = []
    for r in records:
        o = outcome_of(r)
        if o is None or o in NO_EVIDENCE:
            continue
        res = result_of(r, cache)
        if res is None:
            continue
        try:
            out.append(PastSweep(res, Outcome(o)))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class SweepCost:
    """Node-seconds a sweep held: runtime x nodes (0 for sweeps that never ran)."""

    sweep_id: int
    node_seconds: float


def sweep_cost(rec: SweepRecord) -> SweepCost:
    m = rec.metrics if isinstance(rec.metrics, dict) else {}
    runtime = m.get("runtime_s")
    nodes = m.get("node_count") or (2 if rec.kind is SweepKind.TWO_NODE else 1)
    if not isinstance(runtime, (int, float)):
        if rec.started_at is not None and rec.finished_at is not None:
            runtime = (rec.finished_at - rec.started_at).total_seconds()
        else:
            runtime = 0.0
    return SweepCost(rec.id, max(0.0, float(runtime)) * int(nodes))


def sweep_reference_text(metrics: object) -> str:
    """' [judged vs same-window peers (node1,node4)]': which reference a sweep verdict used
    (class baseline, same-window peers, policy floor), '' for sweeps judged before it was kept."""
    if not isinstance(metrics, dict) or not metrics.get("reference_text") or metrics.get("basis") == "none":
        return ""
    again = f", judged again from sweep {metrics['rejudge_of']}" if metrics.get("rejudge_of") else ""
    return f" [judged vs {metrics['reference_text']}{again}]"
