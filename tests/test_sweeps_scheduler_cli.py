"""`slurmguard sweep status` and the benchmark's arithmetic (no cluster needed)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurmguard.cli import cli
from slurmguard.store import NodeState, SweepKind, Verdict
from slurmguard.sweeps.episode import load_episode
from slurmguard_dev.bench.sweeps import NodeRun, _episode_figures, summarise
from tests.test_sweeps_scheduler import Rig


def test_status_lists_nodes_under_verification(sqlite_store, fake_clock, tmp_path):
    rig = Rig(sqlite_store, fake_clock, tmp_path)
    for n in ("node3", "node4"):
        rig.seed(n)
    rig.drain("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2", state="TIMEOUT", write=False)
    rig.tick()
    url = str(sqlite_store.engine.url)
    res = CliRunner().invoke(cli, ["--db", url, "sweep", "status", "--json"])
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.output)
    assert (row["node"], row["state"]) == ("node2", "quarantined")
    [s] = row["sweeps"]
    assert (s["kind"], s["outcome"], s["reason"]) == ("1node", "fail", "slurmguard: sweep1 timed out")
    rig.tick()
    res = CliRunner().invoke(cli, ["--db", url, "sweep", "status"])
    assert res.exit_code == 0, res.output
    assert "node2: remediation since" in res.output and "triage resweep planned" in res.output
    assert "1node sweep" in res.output and "fail: slurmguard: sweep1 timed out" in res.output


def _run(node, returned, ret, jobs, node_s, held=None, pair=None) -> NodeRun:
    return NodeRun(node, returned, ret, jobs, node_s, held, pair, 2, 1.0, 10, 0.2)


def test_summary_counts_node_hours_of_all_sweeps_per_returned_node():
    runs = [
        _run("node2", True, 20.0, 12.0, 30.0, 8.0, 6.0),
        _run("node3", True, 30.0, 14.0, 36.0, 9.0, 7.0),
        _run("node4", False, 300.0, 10.0, 18.0),
    ]
    s = summarise(runs)
    assert (s["returned"], s["measured"]) == (2, 3)
    assert s["median_return_s"] == 25.0 and s["median_jobs_s"] == 13.0
    assert s["median_overhead_s"] == pytest.approx(12.0)
    # the failed node's sweeps are a cost too: (30 + 36 + 18) node-s over 2 returned nodes
    assert s["node_hours_per_returned"] == pytest.approx(84.0 / 3600 / 2)
    assert s["median_ref_held_s"] == 8.5 and s["median_pair_job_s"] == 6.5


def test_episode_figures_from_the_database(sqlite_store, fake_clock, tmp_path):
    rig = Rig(sqlite_store, fake_clock, tmp_path)
    for n in ("node3", "node4"):
        rig.seed(n)
    t0 = fake_clock.now()
    rig.drain("node2")
    for _ in range(2):
        rig.tick()
    rig.tick(3)  # the job waits in the queue
    rig.run_job("node2")
    rig.tick()
    rig.tick()
    rig.run_job("node2")
    rig.tick()
    rig.tick()
    assert rig.store.get_node("node2").state is NodeState.HEALTHY
    jobs_s, node_s, held, pair_job, n, queue_s = _episode_figures(rig.store, "node2", t0)
    sweeps = rig.store.sweeps(node="node2", since=t0)
    assert [(s.kind, s.verdict) for s in sweeps] == [
        (SweepKind.ONE_NODE, Verdict.PASS),
        (SweepKind.TWO_NODE, Verdict.PASS),
    ]
    r1, r2 = (s.metrics["runtime_s"] for s in sweeps)
    assert n == 2 and jobs_s == pytest.approx(r1 + r2) and node_s == pytest.approx(r1 + 2 * r2)
    assert pair_job == pytest.approx(r2)
    assert held is not None and held >= r2  # the reference is held at least while the job runs
    assert queue_s >= 0


def test_baseline_shows_expiry_and_refresh_sweeps_idle_healthy_nodes(
    sqlite_store, fake_clock, tmp_path, monkeypatch
):
    import time

    from slurmguard.sweeps import cli as sweep_cli

    rig = Rig(sqlite_store, fake_clock, tmp_path)
    now = time.time()  # the CLI reads the system clock
    rig.seed("node3", finished=now - 3600.0)
    rig.seed("node4", finished=now - 8 * 86400.0)  # past baseline_max_age_h (168)
    url = str(sqlite_store.engine.url)
    res = CliRunner().invoke(cli, ["--db", url, "sweep", "baseline", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["kind"]: r for r in json.loads(res.output)}
    assert rows["node"]["fresh_nodes"] == 1 and rows["node"]["expired_nodes"] == 1
    assert rows["node"]["nodes"] == ["node3"]
    assert rows["node"]["expires_in_h"] == pytest.approx(167.0, abs=0.01)
    res = CliRunner().invoke(cli, ["--db", url, "sweep", "baseline"])
    assert "h100 node: 1/3 nodes (too few nodes); newest 1.0 h" in res.output, res.output
    # --refresh: through the scheduler on FakeSlurm; node2 is busy, one free node is left
    # as the 2-node reference
    rig.fake.start_job(["node2"])
    monkeypatch.setattr(sweep_cli, "_scheduler", lambda ctx, dry_run=False: (None, rig.sched))
    res = CliRunner().invoke(cli, ["--db", url, "sweep", "baseline", "--refresh", "--count", "5"])
    assert res.exit_code == 0, res.output
    started = [n for n in ("node1", "node2", "node3", "node4") if _state(rig, n) is NodeState.QUARANTINED]
    assert started == ["node1", "node3"], res.output
    assert "baseline sweep started" in res.output
    ep = load_episode(rig.store, "node1")
    assert ep.rolling and not ep.suspected


def _state(rig, node):
    return rig.store.get_node(node).state
