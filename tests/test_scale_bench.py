"""`slurmguard bench scale` itself: its harness drives the real controller and HTTP
server on a small fleet (about 5 s). The figures are the bench's; this keeps it working."""

from __future__ import annotations

from slurmguard_dev.bench.scale import _run


def test_bench_scale_measures_a_small_fleet_through_its_http_server():
    """The bench's harness on 40 nodes (about 5 s): every report accepted over HTTP."""
    r = _run(None, 40, None, ["--steps", "16", "--cycles", "2", "--http-reports", "40", "--http"])
    assert "error" not in r, r
    assert r["http_ok"] == r["http_reports"] == 40 and r["http_cpu_ms_per_report"] > 0
    assert r["ranks"] > 0 and r["assessed"] > 0 and r["first_cycle_errors"] == []
    assert len(r["cycle_cpu_s"]) == 2
    # database growth per hour of reports: measured between the first and the last cycle
    assert r["db_growth_mb_per_h"] >= 0 and all(n > 0 for n in r["db_rows_per_h"].values())
