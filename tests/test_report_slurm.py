"""The report next to a real Slurm: live reasons, admin drains marked, reservations shown."""

from __future__ import annotations

import pytest

from slurmguard.config import Policy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.slurm.commands import CommandSlurmClient
from slurmguard.store import NodeState
from slurmguard.triage.report import build_report
from slurmguard.triage.report_model import ReportFilters

pytestmark = pytest.mark.slurm


def test_live_reasons_from_the_cluster(clean_cluster, sqlite_store):
    client = CommandSlurmClient(env=clean_cluster.env, timeout_s=20)
    ex = ActionExecutor(client, sqlite_store)
    for n in clean_cluster.node_names:
        sqlite_store.get_or_create_node(n, partitions=[clean_cluster.partition])
    ours, theirs, swept = clean_cluster.node_names[:3]
    ex.drain(ours, "step time +14% in job 77")
    sqlite_store.transition(ours, NodeState.DRAINING, "drain tier")
    clean_cluster.run(["scontrol", "update", f"NodeName={theirs}", "State=DRAIN", "Reason=RMA ticket 99"])
    resv = f"slurmguard_quarantine_{swept}"
    ex.create_reservation(resv, [swept], 60)
    sqlite_store.transition(swept, NodeState.QUARANTINED, "rolling sweep")

    rep = build_report(sqlite_store, client, Policy(), ReportFilters())
    rows = {r.name: r for r in rep.rows}
    assert rep.slurm.reachable and rep.summary.drained_by_slurmguard == 1
    assert rep.summary.drained_by_others == 1
    assert rows[ours].reason == "slurmguard: step time +14% in job 77"
    assert rows[ours].reason_source == "slurm" and rows[ours].drained_by == "slurmguard"
    assert "DRAIN" in rows[ours].slurm_state
    assert rows[ours].next_action.code == "quarantine_next"  # idle: nothing to wait for
    assert rows[theirs].reason == "RMA ticket 99" and rows[theirs].drained_by == "other"
    assert rows[theirs].next_action.code == "not_ours"
    assert rows[swept].reservations == (resv,)
    assert rows[swept].next_action.code == "sweep_now"
