"""The control cycle at scale: what it reads and writes per cycle, what it keeps,
and that every telemetry sample an agent sends is scored exactly once.
(Figures live in `slurmguard bench scale`; these are the correctness rules.)
Fast: FakeSlurm, a real SQLite store, a FakeClock (about 3 s in all)."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import event

from slurmguard.config import parse_policy
from slurmguard.controller.assess import _median_without_self
from slurmguard.controller.fleet import FleetView
from slurmguard.controller.loop import Controller
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store.db import READ_ONLY
from slurmguard.wire import (
    AgentReport,
    JobReport,
    RankReport,
    StepSample,
    StepWindow,
    TelemetryColumns,
    TelemetryRecord,
)

POLICY = parse_policy("""
detection:
  peers: {window_s: 10, consecutive_windows: 2, min_peers: 4}
controller: {keep_steps_per_rank: 16, keep_samples_per_node: 64}
""")


def _report(
    node: str,
    seq: int,
    now: float,
    *,
    tel_from: float = 0.0,
    n_tel: int = 0,
    job: int | None = None,
    steps: int = 40,
) -> AgentReport:
    jobs = []
    if job is not None:
        ss = [StepSample(end=now - steps + i + 1, step_s=1.0, comm_s=0.3) for i in range(steps)]
        jobs = [
            JobReport(
                job_id=job,
                ranks=[
                    RankReport(
                        rank=0,
                        gpu=0,
                        baseline_step_s=1.0,
                        baseline_compute_s=0.7,
                        steps=ss,
                        total_steps=400,
                        last_progress=now,
                    )
                ],
            )
        ]
    # value = timestamp: a sample lost or counted twice moves the window's mean
    tel = [
        TelemetryRecord(signal="sm_clock", value=tel_from + i, unit="MHz", timestamp=tel_from + i, gpu=0)
        for i in range(n_tel)
    ]
    return AgentReport(node=node, seq=seq, sent_at=now, jobs=jobs, telemetry=tel)


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10, 33])
def test_median_without_self_is_the_median_of_the_others(n):
    rng = np.random.default_rng(n)
    for v in (rng.normal(size=n), rng.integers(0, 3, size=n).astype(float)):  # ties too
        want = [float(np.median(np.delete(v, i))) for i in range(n)]
        assert _median_without_self(v).tolist() == pytest.approx(want)


def test_step_window_reads_like_the_list_it_replaces():
    steps = [StepSample(end=100.0 + i, step_s=1.0 + i / 100, comm_s=0.25) for i in range(30)]
    w = StepWindow.of(steps, keep=20)
    assert len(w) == 20 and w[0].end == steps[10].end and w[-1].step_s == steps[-1].step_s
    assert [s.end for s in w[-3:]] == [s.end for s in steps[-3:]]
    assert [s.end for s in w.since(125.0)] == [s.end for s in steps if s.end > 125.0]
    assert len(w.since(None)) == 20 and len(w.since(1e12)) == 0 and not w.since(1e12)


def _scored(ctl: Controller) -> list[tuple]:
    seen: list[tuple] = []
    real = ctl.scorer.window

    def window(samples, group=None, means=None):
        seen.extend((s.node, s.gpu, s.signal, s.value) for s in samples)
        seen.extend((node, gpu, sig, v) for (node, sig, gpu, _), v in (means or {}).items())
        return real(samples, group, means)

    ctl.scorer.window = window
    return seen


def test_every_sample_is_scored_once_also_when_reports_arrive_during_a_cycle(sqlite_store, fake_clock):
    slurm = FakeSlurm(["node1", "node2"], clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    seen = _scored(ctl)
    now = fake_clock.now()
    # three reports of one node between two scorings (10 s reports, a 30 s window):
    # only the latest report's steps matter, but all three reports' samples must be
    # scored: the scorer gets the device's mean over the window, of exactly those 30
    for k in range(3):
        assert ctl.fleet.ingest(_report("node1", k + 1, now, tel_from=1000 + 10 * k, n_tel=10), now)
    fake_clock.advance(10)
    ctl.cycle()
    assert seen == [("node1", 0, "sm_clock", pytest.approx(1014.5))]
    assert ctl.fleet.samples_taken == 30
    # a report arriving while the scorer runs goes to the next window, not lost, not twice
    real = ctl.scorer.window

    def arrives_meanwhile(samples, group=None, means=None):
        ctl.fleet.ingest(_report("node2", 1, fake_clock.now(), tel_from=2000, n_tel=5), fake_clock.now())
        return real(samples, group, means)

    ctl.fleet.ingest(_report("node1", 4, fake_clock.now(), tel_from=1030, n_tel=5), fake_clock.now())
    ctl.scorer.window = arrives_meanwhile
    seen.clear()
    fake_clock.advance(10)
    ctl.cycle()
    assert seen == [("node1", 0, "sm_clock", pytest.approx(1032.0))]
    assert ctl.fleet.samples_taken == 35
    ctl.scorer.window = real
    seen = _scored(ctl)
    fake_clock.advance(10)
    ctl.cycle()
    assert seen == [("node2", 0, "sm_clock", pytest.approx(2002.0))]
    assert ctl.fleet.samples_taken == 40
    # a replayed report (same epoch, seq) adds nothing
    assert not ctl.fleet.ingest(
        _report("node2", 1, fake_clock.now(), tel_from=2000, n_tel=5), fake_clock.now()
    )
    seen.clear()
    fake_clock.advance(10)
    ctl.cycle()
    assert seen == [] and ctl.fleet.samples_taken == 40


def test_what_is_kept_per_rank_and_node_is_bounded_by_the_policy(sqlite_store, fake_clock):
    fleet = FleetView(keep_steps=16, keep_samples=64)
    now = fake_clock.now()
    assert fleet.ingest(_report("node1", 1, now, job=7, steps=100, n_tel=50), now)
    assert fleet.ingest(_report("node1", 2, now, job=7, steps=100, tel_from=50, n_tel=50), now)
    ((_, rank),) = fleet.job_ranks(7, now)[0]
    assert len(rank.steps) == 16 and rank.steps[-1].end == now  # the newest iterations
    # a scored signal's samples are one sum per device, however many arrive
    assert fleet.queued_samples() == 100 and fleet.dropped_samples == 0
    # samples kept as sent (hard failures) are bounded: the oldest go
    xids = [
        TelemetryRecord(signal="xid", value=13, unit="code", timestamp=200.0 + i, gpu=0) for i in range(100)
    ]
    assert fleet.ingest(_report("node1", 3, now).model_copy(update={"telemetry": xids}), now)
    assert fleet.dropped_samples == 36
    # and so are the sums: a flood of made-up devices cannot grow them past the limit
    fake = [
        TelemetryRecord(signal="power", value=600.0, unit="W", timestamp=300.0, gpu=g) for g in range(100)
    ]
    assert fleet.ingest(_report("node1", 4, now).model_copy(update={"telemetry": fake}), now)
    assert fleet.dropped_samples == 36 + 37  # 64 sums: sm_clock gpu0 and 63 power devices
    taken = fleet.take_telemetry()
    assert [s.timestamp for s in taken.samples] == [236.0 + i for i in range(64)]
    assert taken.means[("node1", "sm_clock", 0, None)] == pytest.approx(49.5)
    assert len([k for k in taken.means if k[1] == "power"]) == 63
    assert taken.count == fleet.samples_taken == 100 + 64 + 63
    assert not fleet.take_telemetry() and fleet.queued_samples() == 0


def test_a_departed_nodes_queued_telemetry_goes_with_it_and_the_others_stays_exact(fake_clock):
    """The sums and their means are kept per device signal across nodes: evicting one
    node drops its own (counts too), the rest are scored as sent."""
    fleet = FleetView(keep_samples=64)
    now = fake_clock.now()
    fleet.set_known_nodes({"node1", "node2"})
    assert fleet.ingest(_report("node1", 1, now, n_tel=10), now)
    assert fleet.ingest(_report("node2", 1, now, n_tel=4), now)
    assert fleet.ingest(_report("node2", 2, now, tel_from=4, n_tel=4), now)
    assert fleet.queued_samples() == 18
    assert fleet.set_known_nodes({"node2"}) == ["node1"]
    assert fleet.queued_samples() == 8
    taken = fleet.take_telemetry()
    assert taken.means == {("node2", "sm_clock", 0, None): pytest.approx(3.5)} and taken.count == 8


def test_sums_added_a_list_at_a_time_match_the_samples_over_changing_layouts(fake_clock):
    """A node's usual keys are summed a list at a time, in this window and the next
    ones; reports with other keys (reordered, one device more or less, a key without
    samples, a hard failure beside them, two units of one device signal) are summed key
    by key: every window's means and counts are the plain ones of its samples."""
    rng = np.random.default_rng(3)
    fleet = FleetView(keep_samples=64)
    now = fake_clock.now()
    base = [("sm_clock", "MHz", g, None) for g in range(4)] + [("power", "W", g, None) for g in range(4)]
    layouts = [
        base,
        base[::-1],
        base[:-1],
        base + [("power", "W", 9, None)],
        base + [("xid", "code", 0, None)],
        base + [("power", "mW", 0, None)],
        base + [("gpu_temp", "C", 0, None)],  # listed, never sampled
    ]
    seq = 0
    for window in range(6):
        want: dict[tuple, list[float]] = {}
        raw = 0
        for _ in range(5):
            for node in ("node1", "node2"):
                seq += 1
                keys = list(layouts[0 if rng.random() < 0.75 else rng.integers(len(layouts))])
                sampled = len(keys) - (keys[-1][0] == "gpu_temp")
                k = np.tile(np.arange(sampled, dtype=np.uint32), 2)
                v = rng.uniform(100, 200, len(k)).round(3)
                for i, x in zip(k, v):
                    sig, _, gpu, nic = keys[i]
                    if sig == "xid":
                        raw += 1
                    else:
                        want.setdefault((node, sig, gpu, nic), []).append(float(x))
                tel = TelemetryColumns(keys, k, np.full(len(k), now), v)
                assert fleet.ingest(_report(node, seq, now).model_copy(update={"telemetry": tel}), now)
        taken = fleet.take_telemetry()
        assert taken.means.keys() == want.keys(), window
        for key, xs in want.items():
            assert taken.means[key] == pytest.approx(sum(xs) / len(xs), rel=1e-12), (window, key)
        assert len(taken.samples) == raw
        assert taken.count == sum(map(len, want.values())) + raw
    assert fleet.dropped_samples == 0


def test_a_cycle_reads_slurm_once_and_registers_new_nodes_in_one_transaction(sqlite_store, fake_clock):
    names = [f"n{i:04d}" for i in range(300)]
    slurm = FakeSlurm(names, clock=fake_clock)
    calls = {"fleet": 0, "nodes": 0, "jobs": 0}

    def counted(name):
        def call(*a, **k):
            calls[name] += 1
            if name == "fleet":  # FakeSlurm.fleet reads through its own methods: not counted
                return FakeSlurm.nodes(slurm), FakeSlurm.jobs(slurm)
            return getattr(FakeSlurm, name)(slurm, *a, **k)

        return call

    for name in calls:
        setattr(slurm, name, counted(name))
    commits = []
    # write transactions only: the cycle's reads take no write lock (db.reading)
    event.listen(
        sqlite_store.engine,
        "commit",
        lambda conn: commits.append(1) if not conn.get_execution_options().get(READ_ONLY) else None,
    )
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock, metrics=ControllerMetrics())
    ctl.cycle()
    assert calls == {"fleet": 1, "nodes": 0, "jobs": 0}
    assert len(sqlite_store.list_nodes()) == 300
    writes = len(commits)
    assert writes == 1, f"{writes} write transactions in a first cycle of 300 nodes"
    ctl.cycle()
    assert calls["fleet"] == 2 and calls["nodes"] == calls["jobs"] == 0


def test_departed_nodes_are_evicted_with_their_metric_series(sqlite_store, fake_clock):
    slurm = FakeSlurm(["node1", "node2"], clock=fake_clock)
    metrics = ControllerMetrics()
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock, metrics=metrics)
    ctl.cycle()
    now = fake_clock.now()
    for node in ("node1", "node2"):
        r = _report(node, 1, now, n_tel=3).model_copy(update={"ring_errors": {"corrupt_records": 2}})
        assert ctl.fleet.ingest(r, now)
    ctl.cycle()
    text = metrics.render().decode()
    assert 'node="node2"' in text
    del slurm._nodes["node2"]  # noqa: SLF001 - the node left the cluster
    ctl.cycle()
    text = metrics.render().decode()
    assert 'node="node2"' not in text and 'node="node1"' in text
    assert ctl.fleet.nodes_reporting(fake_clock.now()) == {"node1"}
    assert not ctl.fleet.ingest(_report("node2", 2, now), now)  # and it cannot come back unasked


def test_a_window_of_summed_means_scores_like_the_samples_it_stands_for():
    """The controller hands the peer scorer per-device means (summed at ingest): the
    deviations and flags are those of scoring every sample."""
    from slurmguard.detect.peers import PeerScorer
    from slurmguard.telemetry.base import sample

    rng = np.random.default_rng(3)
    fleet = FleetView(keep_samples=4096)
    windows = []
    for w in range(3):
        samples = []
        for node in ("n1", "n2"):
            for k in range(6):  # six samples a device per window, as with 5 s sampling
                for g in range(8):
                    hot = node == "n2" and g == 5
                    samples += [
                        sample(node, "gpu_temp", (78 if hot else 60) + rng.normal(0, 1), k, gpu=g),
                        sample(node, "sm_clock", (1380 if hot else 1980) - abs(rng.normal(0, 5)), k, gpu=g),
                        sample(node, "power", 650 + rng.normal(0, 6), k, gpu=g),
                    ]
        samples.append(sample("n1", "xid", 79, 3.0, gpu=2))  # a hard failure, kept as sent
        recs = [
            TelemetryRecord(signal=s.signal, value=s.value, unit=s.unit, timestamp=s.timestamp, gpu=s.gpu)
            for s in samples
        ]
        for node in ("n1", "n2"):
            r = AgentReport(
                node=node,
                seq=w + 1,
                sent_at=0.0,
                telemetry=[t for t, s in zip(recs, samples) if s.node == node],
            )
            assert fleet.ingest(r, 0.0)
        windows.append((samples, fleet.take_telemetry()))
    direct, summed = PeerScorer(), PeerScorer()
    for samples, taken in windows:
        assert taken.count == len(samples) and [s.signal for s in taken.samples] == ["xid"]
        want = direct.deviations(samples)
        got = summed.deviations(taken.samples, means=taken.means)
        assert {k: [(d.signal, round(d.z, 9)) for d in v] for k, v in got.items()} == {
            k: [(d.signal, round(d.z, 9)) for d in v] for k, v in want.items()
        }
        # (the same up to the order of additions in the means)
        flags = [(f.node, f.device, f.hard, f.reasons, f.windows) for f in direct.window(samples)]
        assert flags == [
            (f.node, f.device, f.hard, f.reasons, f.windows)
            for f in summed.window(taken.samples, means=taken.means)
        ]
    assert ("n2", "gpu5", False) in [f[:3] for f in flags] and ("n1", "gpu2", True) in [f[:3] for f in flags]


def test_the_cycle_runs_with_the_collector_paused_and_gives_it_back(sqlite_store, fake_clock):
    import gc

    slurm = FakeSlurm(["node1"], clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    seen = []
    real = slurm.fleet

    def fleet():
        seen.append(gc.isenabled())
        return real()

    slurm.fleet = fleet
    assert gc.isenabled()
    ctl.cycle()
    assert seen == [False] and gc.isenabled()

    def broken():
        raise RuntimeError("boom")

    slurm.fleet = broken
    with pytest.raises(RuntimeError):
        ctl.cycle()
    assert gc.isenabled()  # also after a cycle that failed
    gc.disable()
    try:
        slurm.fleet = fleet
        ctl.cycle()
        assert not gc.isenabled()  # not switched on where the caller had it off
    finally:
        gc.enable()


def test_the_controllers_collector_settings_still_free_garbage_in_cycles():
    """tune_gc (the controller command's start-up) makes collections rarer, not absent:
    objects that only reference each other are freed within its generation-0 threshold,
    so memory stays bounded (in a process of its own: the settings are process-wide)."""
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from slurmguard.controller.daemon import GC_THRESHOLDS, tune_gc\n"
        "tune_gc()\n"
        "assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0\n"
        "class Node:\n"
        "    pass\n"
        "base = len(gc.get_objects())\n"
        "most = 0\n"
        "for i in range(150_000):\n"
        "    a, b = Node(), Node()\n"
        "    a.other, b.other = b, a  # a cycle: reference counting never frees it\n"
        "    if i % 1000 == 0:\n"
        "        most = max(most, len(gc.get_objects()) - base)\n"
        "print(most)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    # 300,000 objects made (and their dictionaries); never more than about one young
    # generation of them alive
    assert int(p.stdout) <= 2 * 50_000, p.stdout
