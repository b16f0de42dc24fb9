"""The report's content, from a fleet populated through the Store and the audited executor."""

from __future__ import annotations

from datetime import timedelta

import pytest

from slurmguard.config import Policy
from slurmguard.errors import InputError
from slurmguard.store import NodeState
from slurmguard.triage.report import (
    build_report,
    parse_duration,
    parse_nodes,
    parse_since,
    parse_states,
)
from slurmguard.triage.report_model import ReportFilters

S = NodeState


def _rows(rep):
    return {r.name: r for r in rep.rows}


def test_every_state_is_summarised_and_listed(report_fleet):
    store, slurm, _, fleet = report_fleet
    rep = build_report(store, slurm, Policy(), ReportFilters())
    assert rep.summary.states == {
        "healthy": 10,
        "suspect": 2,
        "draining": 2,
        "quarantined": 2,
        "remediation": 2,
        "terminal": 2,
    }
    assert rep.summary.total == 20 and rep.summary.not_healthy == 10
    # Live from Slurm: draining (2), remediation (2), terminal (2) carry our drain; the two
    # admin-drained nodes plus the unregistered spare are drained by others.
    assert rep.summary.drained_by_slurmguard == 6
    assert rep.summary.drained_by_others == 3 and rep.summary.unregistered == 1
    rows = _rows(rep)
    not_healthy = {
        n for s in ("suspect", "draining", "quarantined", "remediation", "terminal") for n in fleet.stories[s]
    }
    others = set(fleet.stories["others"]) | {fleet.unregistered}
    assert set(rows) == not_healthy | others
    # worst first, drained-by-others last
    order = [r.state for r in rep.rows if r.drained_by != "other"]
    assert (
        order
        == [S.TERMINAL] * 2 + [S.REMEDIATION] * 2 + [S.QUARANTINED] * 2 + [S.DRAINING] * 2 + [S.SUSPECT] * 2
    )
    assert all(r.drained_by == "other" for r in rep.rows[-3:])


def test_next_actions_follow_state_and_history(report_fleet):
    store, slurm, _, fleet = report_fleet
    rows = _rows(build_report(store, slurm, Policy(), ReportFilters()))
    code = {name: rows[name].next_action for name in rows}
    assert code[fleet.first("suspect")].code == "wait_verification"
    draining = fleet.first("draining")
    assert code[draining].code == "wait_job_exit"
    assert str(fleet.jobs[draining]) in code[draining].text
    q = code[fleet.first("quarantined")]
    assert q.code == "sweep_running" and "1node" in q.text and "job " in q.text
    # remediation: resweep done after a failed sweep -> the next rung of the default ladder
    r = code[fleet.first("remediation")]
    assert r.code == "next_rung" and r.text.startswith("next rung: reboot")
    t = code[fleet.first("terminal")]
    assert t.code == "replace" and f"slurmguard node resume {fleet.first('terminal')}" in t.text
    assert code[fleet.first("others")].code == "not_ours"
    assert code[fleet.unregistered].code == "not_ours" and rows[fleet.unregistered].state is None
    assert rows[fleet.first("terminal")].triage_entries == 3


def test_evidence_chain_runs_detection_to_triage(report_fleet):
    store, slurm, _, fleet = report_fleet
    row = _rows(build_report(store, slurm, Policy(), ReportFilters()))[fleet.first("remediation")]
    stages = [e.stage for e in row.evidence]
    first = {s: stages.index(s) for s in ("detection", "response", "sweep", "triage")}
    assert first["detection"] < first["response"] < first["sweep"] < first["triage"]
    assert [e.at for e in row.evidence] == sorted(e.at for e in row.evidence)
    (failed,) = [e for e in row.evidence if e.stage == "sweep"]
    assert failed.ok is False and "gpu3" in failed.text
    assert any(e.text.startswith("signal job") for e in row.evidence)  # checkpoint request
    # The chain is the current episode only: a node back in service has none.
    rep = build_report(store, slurm, Policy(), ReportFilters(nodes=(fleet.first("returned_fp"),)))
    (back,) = rep.rows
    assert back.state is S.HEALTHY and back.evidence == () and back.next_action.code == "none"


def test_reason_is_live_from_slurm(report_fleet):
    store, slurm, _, fleet = report_fleet
    rows = _rows(build_report(store, slurm, Policy(), ReportFilters()))
    d = rows[fleet.first("draining")]
    assert d.reason_source == "slurm" and d.reason == slurm.node(d.name).reason
    assert d.reason.startswith("slurmguard: step time +12%") and d.drained_by == "slurmguard"
    assert rows[fleet.first("others")].reason == "bad DIMM, ticket 4711"
    q = rows[fleet.first("quarantined")]
    assert q.reservations == (f"slurmguard_quarantine_{q.name}",) and q.reason is None
    assert rows[fleet.first("suspect")].comment.startswith("slurmguard: pending verification")


@pytest.mark.parametrize("how", ["down", "offline"])
def test_slurm_down_falls_back_to_the_audit_log(report_fleet, how):
    store, slurm, _, fleet = report_fleet
    live = {n.name: n for n in slurm.nodes()}
    if how == "down":
        slurm.available = False
    rep = build_report(store, slurm, Policy(), ReportFilters(offline=how == "offline"))
    assert rep.slurm.reachable is False
    assert rep.slurm.checked is (how == "down")
    assert rep.summary.drained_by_slurmguard is None and rep.summary.drained_by_others is None
    rows = _rows(rep)
    for story in ("draining", "remediation", "terminal"):
        r = rows[fleet.first(story)]
        assert r.reason_source == "audit" and r.reason == live[r.name].reason
    # the quarantined node was resumed after its drain: no standing drain reason
    assert rows[fleet.first("quarantined")].reason is None
    assert rows[fleet.first("suspect")].comment == live[fleet.first("suspect")].comment
    # without Slurm, admin drains are invisible; our own nodes are all still listed
    assert fleet.unregistered not in rows and fleet.first("others") not in rows
    assert rows[fleet.first("draining")].next_action.code == "wait_job_exit"
    assert "Slurm not reachable" in rows[fleet.first("draining")].next_action.text


def test_filters(report_fleet):
    store, slurm, _clock, _fleet = report_fleet
    pol = Policy()
    rep = build_report(store, slurm, pol, ReportFilters(states=(S.QUARANTINED, S.TERMINAL)))
    assert {r.state for r in rep.rows} == {S.QUARANTINED, S.TERMINAL} and len(rep.rows) == 4
    rep = build_report(store, slurm, pol, ReportFilters(states=(S.HEALTHY,)))
    assert len(rep.rows) == 10  # asking for healthy lists healthy nodes
    names = parse_nodes(["gpu[0002-0004]"])
    assert names == ("gpu0002", "gpu0003", "gpu0004")
    rep = build_report(store, slurm, pol, ReportFilters(nodes=names))
    assert [r.name for r in rep.rows] == ["gpu0004", "gpu0003", "gpu0002"]
    # since: only nodes whose current state began at/after it (terminal ones moved last)
    newest = max(r.since for r in build_report(store, slurm, pol, ReportFilters()).rows if r.state)
    rep = build_report(store, slurm, pol, ReportFilters(since=newest))
    assert {r.state for r in rep.rows if r.drained_by != "other"} == {S.TERMINAL}
    assert rep.figures.incidents == 0  # figures count events since then only
    rep = build_report(store, slurm, pol, ReportFilters(partition="gpu"))
    assert rep.summary.total == 20


def test_unknown_node_and_bad_filters_are_clear_errors(report_fleet):
    store, slurm, _clock, _ = report_fleet
    pol = Policy()
    with pytest.raises(InputError, match=r"^node gpu9999: not in the slurmguard database or Slurm$"):
        build_report(store, slurm, pol, ReportFilters(nodes=("gpu9999",)))
    slurm.available = False
    with pytest.raises(InputError, match="only the database was checked"):
        build_report(store, slurm, pol, ReportFilters(nodes=("gpu9999",)))
    with pytest.raises(InputError, match=r"--partition 'nope': no such partition \(gpu\)"):
        build_report(store, slurm, pol, ReportFilters(partition="nope"))
    with pytest.raises(
        InputError,
        match=r"--state 'sick': unknown lifecycle state \(one of: "
        r"healthy, suspect",
    ):
        parse_states(["draining,sick"])
    now = store.now()
    with pytest.raises(InputError, match="--since 'yesterday'"):
        parse_since("yesterday", now)
    with pytest.raises(InputError, match="is in the future"):
        parse_since((now + timedelta(days=1)).isoformat(), now)
    with pytest.raises(InputError, match="--window '0h'"):
        parse_duration("0h")
    with pytest.raises(InputError, match="--node 'gpu\\[3-1\\]'"):
        parse_nodes(["gpu[3-1]"])
    assert parse_since("36h", now) == now - timedelta(hours=36)
    assert parse_since("2023-11-01", now).isoformat() == "2023-11-01T00:00:00+00:00"
    assert parse_states(["draining", "terminal,draining"]) == (S.DRAINING, S.TERMINAL)


def test_empty_database_renders(sqlite_store):
    from slurmguard.slurm.fake import FakeSlurm

    rep = build_report(sqlite_store, FakeSlurm([]), Policy(), ReportFilters())
    assert rep.rows == () and rep.summary.total == 0
    assert rep.figures.sweep_pass_rate is None and rep.figures.false_positive_estimate is None
    assert rep.figures.detection_delay_median_s is None
