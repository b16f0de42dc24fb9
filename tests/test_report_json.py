"""`--format json`: the documented, versioned schema, checked with jsonschema."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from slurmguard.config import Policy
from slurmguard.report.jsonout import (
    SCHEMA_VERSION,
    load_schema,
    render_json,
    report_dict,
)
from slurmguard.triage.report import build_report
from slurmguard.triage.report_model import ReportFilters


def _validator():
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("offline", [False, True])
def test_report_json_matches_schema(report_fleet, offline):
    store, slurm, _, fleet = report_fleet
    rep = build_report(store, slurm, Policy(), ReportFilters(offline=offline))
    doc = json.loads(render_json(rep))
    _validator().validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION == "1"
    assert doc["slurm"]["reason_source"] == ("audit" if offline else "slurm")
    nodes = {n["name"]: n for n in doc["nodes"]}
    term = nodes[fleet.first("terminal")]
    assert term["state"] == "terminal" and term["next_action"]["code"] == "replace"
    assert {e["stage"] for e in term["evidence"]} == {"detection", "lifecycle", "response", "sweep", "triage"}
    assert doc["summary"]["states"]["terminal"] == 2
    assert doc["figures"]["false_positive_estimate"] == pytest.approx(1 / 3)


def test_empty_report_matches_schema(sqlite_store):
    rep = build_report(sqlite_store, None, Policy(), ReportFilters())
    doc = report_dict(rep)
    _validator().validate(json.loads(json.dumps(doc)))
    assert doc["nodes"] == [] and doc["slurm"]["reachable"] is False


def test_schema_rejects_what_it_should(report_fleet):
    store, slurm, _, _ = report_fleet
    doc = json.loads(render_json(build_report(store, slurm, Policy(), ReportFilters())))
    v = _validator()
    for mutate in (
        lambda d: d.pop("figures"),
        lambda d: d.__setitem__("schema_version", "2"),
        lambda d: d["nodes"][0].__setitem__("state", "broken"),
        lambda d: d["nodes"][0]["next_action"].__setitem__("code", "reboot_now"),
        lambda d: d["nodes"][0]["evidence"][0].__setitem__("at", "yesterday"),
        lambda d: d["figures"].__setitem__("sweep_pass_rate", 1.5),
    ):
        bad = copy.deepcopy(doc)
        mutate(bad)
        assert not v.is_valid(bad)


def test_every_next_action_code_is_in_the_schema():
    """The codes report_next can return are the schema's enum (a new code needs the schema)."""
    import inspect
    import re

    from slurmguard.triage import report_next

    src = inspect.getsource(report_next)
    codes = set(re.findall(r'NextAction\(\s*"([a-z_]+)"', src))
    enum = set(load_schema()["$defs"]["node"]["properties"]["next_action"]["properties"]["code"]["enum"])
    assert codes and codes <= enum
