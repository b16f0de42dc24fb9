"""The report as JSON for scripts, following triage_report.schema.json (SCHEMA_VERSION).

Compatibility rule: within one schema_version fields are only added, never renamed,
removed or retyped; anything else bumps the version.
"""

from __future__ import annotations

import json
from datetime import datetime
from importlib import resources
from typing import Any

from slurmguard.triage.report_model import NodeRow, Report

SCHEMA_VERSION = "1"
SCHEMA_FILE = "triage_report.schema.json"


def load_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the report, shipped beside this module."""
    return json.loads(resources.files("slurmguard.report").joinpath(SCHEMA_FILE).read_text())


def _t(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def row_dict(r: NodeRow) -> dict[str, Any]:
    return {
        "name": r.name,
        "state": r.state.value if r.state else None,
        "since": _t(r.since),
        "hw_class": r.hw_class,
        "partitions": list(r.partitions),
        "reason": r.reason,
        "reason_source": r.reason_source,
        "comment": r.comment,
        "slurm_state": r.slurm_state,
        "drained_by": r.drained_by,
        "reservations": list(r.reservations),
        "running_jobs": list(r.running_jobs),
        "slowdown": r.slowdown,
        "triage_entries": r.triage_entries,
        "next_action": {"code": r.next_action.code, "text": r.next_action.text},
        "evidence": [
            {"at": _t(e.at), "stage": e.stage, "text": e.text, "ref": e.ref, "ok": e.ok} for e in r.evidence
        ],
    }


def report_dict(report: Report) -> dict[str, Any]:
    f, s, g = report.filters, report.summary, report.figures
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": _t(report.generated_at),
        "filters": {
            "nodes": list(f.nodes),
            "states": [x.value for x in f.states],
            "since": _t(f.since),
            "partition": f.partition,
            "offline": f.offline,
        },
        "slurm": {
            "reachable": report.slurm.reachable,
            "checked": report.slurm.checked,
            "error": report.slurm.error,
            "reason_source": "slurm" if report.slurm.reachable else "audit",
        },
        "partitions": list(report.partitions),
        "summary": {
            "total": s.total,
            "states": dict(s.states),
            "not_healthy": s.not_healthy,
            "drained_by_slurmguard": s.drained_by_slurmguard,
            "drained_by_others": s.drained_by_others,
            "quarantined": s.quarantined,
            "terminal": s.terminal,
            "unregistered": s.unregistered,
        },
        "figures": {
            "incidents": g.incidents,
            "detection_delay_median_s": g.detection_delay_median_s,
            "quarantine_stays": g.quarantine_stays,
            "quarantine_median_s": g.quarantine_median_s,
            "quarantine_ongoing": g.quarantine_ongoing,
            "sweeps_final": g.sweeps_final,
            "sweeps_passed": g.sweeps_passed,
            "sweep_pass_rate": g.sweep_pass_rate,
            "nodes_returned": g.nodes_returned,
            "nodes_replaced": g.nodes_replaced,
            "drains_concluded": g.drains_concluded,
            "drains_cleared": g.drains_cleared,
            "false_positive_estimate": g.false_positive_estimate,
        },
        "nodes": [row_dict(r) for r in report.rows],
    }


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=2, allow_nan=False)
