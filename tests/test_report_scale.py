"""A fleet of thousands of nodes renders in every format (bulk queries, no per-node loops)."""

from __future__ import annotations

import io
import json
import re
import time

import pytest
from rich.console import Console

from slurmguard.config import Policy
from slurmguard.report.html import report_html
from slurmguard.report.jsonout import render_json
from slurmguard.report.terminal import render_terminal
from slurmguard.triage.report import build_report
from slurmguard.triage.report_data import FleetSnapshot
from slurmguard.triage.report_model import ReportFilters
from tests.fixtures.report import make_fake_slurm, populate_fleet

N_NODES = 3000


@pytest.mark.slow
def test_thousands_of_nodes_render(sqlite_store, fake_clock, capsys):
    slurm = make_fake_slurm(N_NODES, fake_clock)
    # 10 nodes in 300 have a story: 50 out of service (1.7% of the fleet), 10 admin drains
    fleet = populate_fleet(sqlite_store, slurm, fake_clock, N_NODES, stride=300, series_windows=10)
    t0 = time.perf_counter()
    snap = FleetSnapshot.load(sqlite_store)
    rep = build_report(sqlite_store, slurm, Policy(), ReportFilters(), snapshot=snap)
    t1 = time.perf_counter()
    page = report_html(sqlite_store, rep, snap, Policy())
    t2 = time.perf_counter()
    doc = json.loads(render_json(rep))
    t3 = time.perf_counter()
    out = io.StringIO()
    render_terminal(rep, Console(file=out, width=160))
    t4 = time.perf_counter()
    with capsys.disabled():
        print(
            f"\n{N_NODES} nodes, {len(rep.rows)} rows: snapshot+build {t1 - t0:.2f}s, "
            f"html {t2 - t1:.2f}s ({len(page) // 1024} KiB), json {t3 - t2:.2f}s, "
            f"table {t4 - t3:.2f}s"
        )
    assert rep.summary.total == N_NODES and rep.summary.not_healthy == 50
    assert len(doc["nodes"]) == 50 + 10 + 1  # ours, admin drains, the unregistered spare
    assert len(re.findall(r'class="hm-cell"', page)) == N_NODES
    assert page.count('class="node-detail"') == 60  # incl. the admin-drained, registered nodes
    assert fleet.first("terminal") in out.getvalue()
    # A ceiling far above the few seconds it takes, to catch a per-node query loop or a
    # quadratic join, not to benchmark.
    assert t4 - t0 < 60
