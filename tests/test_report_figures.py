"""Fleet figures with known answers, from a history written through the Store API."""

from __future__ import annotations

import pytest

from slurmguard.store import NodeState
from slurmguard.triage.report_data import FleetSnapshot
from slurmguard.triage.report_figures import fleet_figures

S = NodeState
H = 3600.0


@pytest.fixture
def history(store, fake_clock):
    """Five nodes, timeline in hours from the clock's start (runs on SQLite and PostgreSQL).

    a: drained 1h, quarantined 2h, 1node pass, healthy 3h     -> a drain cleared by a sweep
    b: drained 1h, quarantined 2h, fail, remediation 4h, quarantined 5h, pass, healthy 6h
    c: drained 1h, quarantined 2h, fail, remediation 3h, terminal 4h
    d: drained 1h, quarantined 2h, still there (ongoing stay)
    e: suspect 1h, cleared to healthy 2h (never drained)
    """
    t0 = fake_clock.now()
    for n in "abcde":
        store.get_or_create_node(n, hw_class="h100", partitions=["gpu"])

    def at(hours: float) -> None:
        fake_clock.advance(t0 + hours * H - fake_clock.now())

    sweeps = {}
    at(1)
    for n, delay in zip("abcd", (60, 120, 600, 300)):
        store.add_incident(f"j{n}", nodes=[n], tier="drain", onset_at=fake_clock.now() - delay)
        store.transition(n, S.DRAINING, "drain tier")
    store.transition("e", S.SUSPECT, "verify tier")
    at(2)
    for n in "abcd":
        store.transition(n, S.QUARANTINED, "idle")
    store.transition("e", S.HEALTHY, "verified healthy")
    at(2.5)
    for n, v in zip("abc", ("pass", "fail", "fail")):
        sweeps[n] = store.add_sweep(n, "1node", slurm_job_id=f"s{n}")
        store.update_sweep(
            sweeps[n].id,
            verdict=v,
            metrics={"gemm/gpu0": 1.0},
            failure_reason=None if v == "pass" else "gemm low",
        )
    at(3)
    store.transition("a", S.HEALTHY, "sweeps passed")
    store.transition("c", S.REMEDIATION, "sweep failed")
    at(4)
    store.transition("b", S.REMEDIATION, "sweep failed")
    store.transition("c", S.TERMINAL, "replace")
    at(5)
    store.transition("b", S.QUARANTINED, "rebooted")
    at(5.5)
    sw = store.add_sweep("b", "1node")
    store.update_sweep(sw.id, verdict="pass")
    at(6)
    store.transition("b", S.HEALTHY, "sweeps passed")
    return store, t0


def test_fleet_figures_known_answers(history):
    store, _ = history
    f = fleet_figures(FleetSnapshot.load(store), "abcde")
    assert f.incidents == 4
    assert f.detection_delay_median_s == pytest.approx(210.0)  # median of 60, 120, 300, 600
    # stays: a 1h, b 2h then 1h, c 1h; d still in quarantine
    assert f.quarantine_stays == 4 and f.quarantine_median_s == pytest.approx(H)
    assert f.quarantine_ongoing == 1
    assert (f.sweeps_final, f.sweeps_passed, f.sweep_pass_rate) == (4, 2, 0.5)
    assert (f.nodes_returned, f.nodes_replaced) == (2, 1)
    # a, b, c concluded; only a came back without a failed sweep or remediation
    assert (f.drains_concluded, f.drains_cleared) == (3, 1)
    assert f.false_positive_estimate == pytest.approx(1 / 3)


def test_fleet_figures_since_and_scope(history):
    from datetime import UTC, datetime

    store, t0 = history
    snap = FleetSnapshot.load(store)
    f = fleet_figures(snap, "abcde", since=datetime.fromtimestamp(t0 + 3.5 * H, UTC))
    # after 3.5h: b's second stay (5h-6h) is the only one that started; b returned, c replaced
    assert f.incidents == 0 and f.detection_delay_median_s is None
    assert f.quarantine_stays == 1 and f.quarantine_median_s == pytest.approx(H)
    assert (f.sweeps_final, f.sweeps_passed) == (1, 1)
    assert (f.nodes_returned, f.nodes_replaced) == (1, 1)
    assert (f.drains_concluded, f.drains_cleared) == (2, 0)
    f = fleet_figures(snap, ["a"])
    assert (f.incidents, f.drains_concluded, f.drains_cleared, f.nodes_returned) == (1, 1, 1, 1)
    assert f.false_positive_estimate == 1.0
