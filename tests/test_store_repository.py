"""The Store API on SQLite and on a real PostgreSQL (the `store` fixture runs both)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pytest

from slurmguard.store import (
    ActionStatus,
    AuditOutcome,
    IllegalTransition,
    IncidentStatus,
    IncidentTier,
    InvalidValue,
    NodeNotRegistered,
    NodeState,
    NotFound,
    StaleState,
    StepTimeRecord,
    SweepKind,
    TelemetrySummaryRecord,
    TriageRung,
    Verdict,
    utc,
)

T0 = 1_700_000_000.0  # FakeClock's default start
T0_DT = datetime.fromtimestamp(T0, UTC)


# ---------------------------------------------------------------- nodes and lifecycle
def test_new_node_is_healthy_with_a_registration_row(store):
    n = store.get_or_create_node("gpu001", hw_class="h100x8", partitions=["train", "debug"])
    assert (n.name, n.hw_class, n.state, n.partitions) == (
        "gpu001",
        "h100x8",
        NodeState.HEALTHY,
        ("train", "debug"),
    )
    assert n.state_since == T0_DT and n.state_since.tzinfo is not None
    hist = store.node_history("gpu001")
    assert [(h.from_state, h.to_state, h.cause) for h in hist] == [(None, NodeState.HEALTHY, "registered")]


def test_get_or_create_is_idempotent_and_updates_slurm_facts(store, fake_clock):
    a = store.get_or_create_node("gpu001", hw_class="h100x8")
    fake_clock.advance(60)
    b = store.get_or_create_node("gpu001", partitions=["train"])
    assert b.id == a.id and b.hw_class == "h100x8" and b.partitions == ("train",)
    assert b.created_at == T0_DT  # not re-registered
    assert len(store.node_history("gpu001")) == 1
    assert len(store.list_nodes()) == 1


def test_transitions_record_time_from_to_cause_evidence(store, fake_clock):
    store.get_or_create_node("gpu007")
    fake_clock.advance(30)
    ev = {"job": "4242", "slowdown": 0.12, "signals": ["sm_clock_mhz", "gpu_temp_c"]}
    t1 = store.transition("gpu007", NodeState.SUSPECT, "peer telemetry deviation", ev)
    fake_clock.advance(90)
    t2 = store.transition(
        "gpu007",
        "draining",
        "moderate slowdown 12%",
        {"tier": "drain"},
        actor="controller",
    )
    assert (t1.from_state, t1.to_state, t1.at) == (
        NodeState.HEALTHY,
        NodeState.SUSPECT,
        T0_DT + timedelta(seconds=30),
    )
    assert (t2.from_state, t2.to_state, t2.actor) == (
        NodeState.SUSPECT,
        NodeState.DRAINING,
        "controller",
    )
    node = store.get_node("gpu007")
    assert node.state == NodeState.DRAINING and node.state_since == T0_DT + timedelta(seconds=120)
    hist = store.node_history("gpu007")
    assert [h.to_state for h in hist] == [
        NodeState.HEALTHY,
        NodeState.SUSPECT,
        NodeState.DRAINING,
    ]
    assert hist[1].evidence == ev and hist[1].cause == "peer telemetry deviation"
    assert store.node_history("gpu007", since=T0 + 60) == [hist[2]]
    assert [t.node for t in store.transitions(to_state="draining")] == ["gpu007"]


def test_full_lifecycle_path_through_quarantine_and_remediation(store):
    store.get_or_create_node("n1")
    for state in ("draining", "quarantined", "remediation", "quarantined", "healthy"):
        store.transition("n1", state, f"to {state}")
    assert store.get_node("n1").state == NodeState.HEALTHY


@pytest.mark.parametrize(
    "path, bad",
    [
        ((), "remediation"),  # healthy -> remediation skips the sweep
        (("draining", "quarantined", "terminal"), "healthy"),  # terminal is terminal
        (("draining",), "healthy"),  # no return without passing a sweep
        (("suspect",), "remediation"),
    ],
)
def test_illegal_transition_raises_and_changes_nothing(store, fake_clock, path, bad):
    store.get_or_create_node("n1")
    for state in path:
        store.transition("n1", state, "setup")
    before = store.get_node("n1")
    n_hist = len(store.node_history("n1"))
    with pytest.raises(
        IllegalTransition,
        match=rf"node n1: illegal transition {before.state.value} -> {bad}",
    ):
        store.transition("n1", bad, "should fail")
    assert store.get_node("n1") == before
    assert len(store.node_history("n1")) == n_hist


def test_terminal_needs_admin_override_which_is_recorded(store):
    store.get_or_create_node("n1")
    for state in ("draining", "terminal"):
        store.transition("n1", state, "replace")
    with pytest.raises(IllegalTransition, match="admin override"):
        store.transition("n1", "healthy", "replaced chassis")
    t = store.transition(
        "n1",
        "quarantined",
        "replaced chassis, sweep it",
        force=True,
        actor="admin:alice",
    )
    assert t.forced and t.actor == "admin:alice" and t.from_state == NodeState.TERMINAL
    assert not store.node_history("n1")[1].forced


def test_same_state_and_unknown_state_and_unknown_node(store):
    store.get_or_create_node("n1")
    with pytest.raises(IllegalTransition, match="already healthy"):
        store.transition("n1", "healthy", "noop", force=True)
    with pytest.raises(IllegalTransition, match="unknown node state 'broken'"):
        store.transition("n1", "broken", "x")
    with pytest.raises(NodeNotRegistered, match="node nope: not registered"):
        store.transition("nope", "suspect", "x")


def test_expect_from_detects_a_node_moved_by_someone_else(store):
    store.get_or_create_node("n1")
    store.transition("n1", "suspect", "first")
    with pytest.raises(StaleState, match="expected state healthy, found suspect"):
        store.transition("n1", "draining", "stale decision", expect_from="healthy")
    assert store.transition("n1", "draining", "fresh", expect_from="suspect").to_state == NodeState.DRAINING


def test_list_nodes_filters(store):
    store.get_or_create_node("a1", hw_class="h100", partitions=["train"])
    store.get_or_create_node("a2", hw_class="h100", partitions=["debug"])
    store.get_or_create_node("b1", hw_class="a100", partitions=["train"])
    store.transition("a2", "draining", "x")
    store.transition("b1", "suspect", "x")
    assert [n.name for n in store.list_nodes(state="draining")] == ["a2"]
    assert [n.name for n in store.list_nodes(state=["draining", NodeState.SUSPECT])] == ["a2", "b1"]
    assert [n.name for n in store.list_nodes(hw_class="h100")] == ["a1", "a2"]
    assert [n.name for n in store.list_nodes(partition="train")] == ["a1", "b1"]


def test_mark_seen(store, fake_clock):
    store.get_or_create_node("a1")
    fake_clock.advance(5)
    assert store.mark_seen(["a1", "ghost"]) == 1
    assert store.get_node("a1").last_seen == T0_DT + timedelta(seconds=5)


def test_bad_node_names_are_refused(store):
    for bad in ("", "a b", "x;rm -rf /", "-n", "n" * 129):
        with pytest.raises(InvalidValue, match="invalid node name"):
            store.get_or_create_node(bad)


def test_atomic_rolls_back_all_calls_together(store):
    store.get_or_create_node("n1")
    with pytest.raises(IllegalTransition), store.atomic() as tx:
        tx.audit("drain", node="n1", reason="slurmguard: slow", argv=["scontrol", "update"])
        tx.transition("n1", "draining", "drain")
        tx.transition("n1", "healthy", "illegal: rolls back the drain and the audit row")
    assert store.get_node("n1").state == NodeState.HEALTHY
    assert store.audit_entries() == []
    with store.atomic() as tx:
        tx.audit("drain", node="n1")
        tx.transition("n1", "draining", "drain")
    assert store.get_node("n1").state == NodeState.DRAINING and len(store.audit_entries()) == 1


# ---------------------------------------------------------------- audit log and JSON
def test_audit_rows_round_trip(store, fake_clock):
    argv = [
        "scontrol",
        "update",
        "NodeName=gpu001",
        "State=DRAIN",
        "Reason=slurmguard: slow 12%",
    ]
    a = store.audit(
        "drain",
        node="gpu001",
        job_id=4242,
        reason="slurmguard: slow 12%",
        argv=argv,
        evidence={"slowdown": 0.12},
    )
    fake_clock.advance(10)
    store.audit(
        "requeue",
        node=None,
        job_id="4242",
        outcome="dry_run",
        argv=["scontrol", "requeue", "4242"],
    )
    fake_clock.advance(10)
    store.audit(
        "resume",
        node="gpu001",
        outcome=AuditOutcome.ERROR,
        error="scontrol: timed out after 15s",
    )
    rows = store.audit_entries()
    assert [r.action for r in rows] == ["drain", "requeue", "resume"]
    assert rows[0] == a and a.argv == tuple(argv) and a.job_id == "4242" and a.at == T0_DT
    assert rows[1].outcome == AuditOutcome.DRY_RUN and rows[1].node is None
    assert rows[2].error.startswith("scontrol: timed out") and rows[2].argv is None
    assert [r.action for r in store.audit_entries(node="gpu001")] == ["drain", "resume"]
    assert [r.action for r in store.audit_entries(action=["drain", "requeue"], since=T0 + 5)] == ["requeue"]
    assert [r.action for r in store.audit_entries(outcome="ok")] == ["drain"]
    assert [r.action for r in store.audit_entries(limit=2)] == ["requeue", "resume"]
    assert [r.action for r in store.audit_entries(until=T0 + 10)] == ["drain"]


def test_audit_validation(store):
    with pytest.raises(InvalidValue, match="lower_snake_case"):
        store.audit("Drain Node")
    with pytest.raises(InvalidValue, match="needs the error text"):
        store.audit("drain", outcome="error")
    with pytest.raises(InvalidValue, match="not one of: ok, error, dry_run"):
        store.audit("drain", outcome="maybe")
    with pytest.raises(InvalidValue, match="not one string"):
        store.audit("drain", argv="scontrol update")


def test_json_evidence_round_trips_nested_and_numpy_values(store):
    store.get_or_create_node("n1")
    ev = {
        "nested": {"list": [1, 2.5, None, True, "x"], "empty": {}},
        "np_float": np.float32(0.5),
        "np_int": np.int64(7),
        "array": np.array([1.0, 2.0]),
        "nan": float("nan"),
        "when": datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        "set": {"b", "a"},
        "tuple": (1, 2),
        "unicode": "µs ✓",
    }
    t = store.transition("n1", "suspect", "json", ev)
    got = store.node_history("n1")[-1].evidence
    expect = {
        "nested": {"list": [1, 2.5, None, True, "x"], "empty": {}},
        "np_float": 0.5,
        "np_int": 7,
        "array": [1.0, 2.0],
        "nan": None,
        "when": "2024-01-02T03:04:05+00:00",
        "set": ["a", "b"],
        "tuple": [1, 2],
        "unicode": "µs ✓",
    }
    assert got == expect and t.evidence == expect
    assert type(got["np_int"]) is int


def test_non_json_evidence_is_a_clear_error(store):
    store.get_or_create_node("n1")
    with pytest.raises(InvalidValue, match=r"evidence\.bad: object is not JSON-serialisable"):
        store.transition("n1", "suspect", "x", {"bad": object()})
    with pytest.raises(InvalidValue, match="naive datetime"):
        store.transition("n1", "suspect", "x", {"t": datetime(2024, 1, 1)})
    assert store.get_node("n1").state == NodeState.HEALTHY


def test_timestamps_are_utc_whatever_zone_they_come_in(store):
    store.get_or_create_node("n1")
    cet = timezone(timedelta(hours=1))
    t = store.transition("n1", "suspect", "x", at=datetime(2024, 6, 1, 12, 0, tzinfo=cet))
    back = store.node_history("n1")[-1].at
    assert back == datetime(2024, 6, 1, 11, 0, tzinfo=UTC) == t.at and back.utcoffset() == timedelta(0)
    with pytest.raises(InvalidValue, match="naive datetime"):
        store.transition("n1", "draining", "x", at=datetime(2024, 6, 1, 12, 0))


# ---------------------------------------------------------------- incidents and summaries
def test_incident_detection_delay_and_updates(store, fake_clock):
    fake_clock.advance(45)
    inc = store.add_incident(
        "4242",
        nodes=["gpu003"],
        tier="drain",
        onset_at=T0,
        slowdown=0.14,
        evidence={"signal": "step_time"},
    )
    assert inc.detection_delay_s == 45.0 and inc.status == IncidentStatus.OPEN
    assert inc.tier == IncidentTier.DRAIN and inc.nodes == ("gpu003",) and inc.action_delay_s is None
    fake_clock.advance(5)
    up = store.update_incident(
        inc.id,
        status="mitigated",
        action_at=T0 + 50,
        outcome="drained",
        evidence={"audit_id": 3},
    )
    assert up.action_delay_s == 5.0 and up.evidence == {
        "signal": "step_time",
        "audit_id": 3,
    }
    assert up.updated_at == T0_DT + timedelta(seconds=50) and up.created_at == inc.created_at
    assert store.get_incident(inc.id) == up
    store.add_incident("5555", nodes=["gpu009"], tier="verify", onset_at=T0 + 40)
    assert [i.job_id for i in store.incidents(node="gpu003")] == ["4242"]
    assert [i.job_id for i in store.incidents(status="open")] == ["5555"]
    assert [i.job_id for i in store.incidents(limit=1)] == ["5555"]
    with pytest.raises(InvalidValue, match="before onset_at"):
        store.add_incident("1", nodes=[], tier="none", onset_at=T0 + 3600)
    with pytest.raises(InvalidValue, match="incident tier 'huge'"):
        store.add_incident("1", nodes=[], tier="huge", onset_at=T0)
    with pytest.raises(NotFound, match="incident 999"):
        store.update_incident(999, status="resolved")


def test_telemetry_and_step_time_summaries(store):
    store.get_or_create_node("g1")
    store.get_or_create_node("g2")
    rows = [
        TelemetrySummaryRecord(
            node=n,
            signal="sm_clock_mhz",
            window_start=utc(T0 + 30 * k),
            window_end=utc(T0 + 30 * (k + 1)),
            value=v,
            unit="MHz",
            peer_median=1980.0,
            robust_z=z,
            deviating=abs(z) > 3.5,
            job_id="77",
        )
        for k, (n, v, z) in enumerate([("g1", 1980.0, 0.0), ("g2", 1410.0, -9.1), ("g2", float("nan"), 0.0)])
    ]
    assert store.add_telemetry_summaries(rows) == 3
    got = store.telemetry_summaries("g2")
    assert [(r.value, r.deviating) for r in got] == [(1410.0, True), (None, False)]
    assert got[0].window_end == utc(T0 + 60) and got[0].id is not None
    assert len(store.telemetry_summaries(signal="sm_clock_mhz", since=T0 + 60)) == 2
    with pytest.raises(NodeNotRegistered, match="ghost"):
        store.add_telemetry_summaries(
            [
                TelemetrySummaryRecord(
                    node="ghost",
                    signal="x",
                    window_start=utc(T0),
                    window_end=utc(T0),
                    value=1.0,
                )
            ]
        )
    steps = [
        StepTimeRecord(
            job_id="77",
            step="0",
            node="g2",
            rank=r,
            window_start=utc(T0),
            window_end=utc(T0 + 60),
            iterations=30,
            mean_step_s=m,
            baseline_step_s=1.0,
        )
        for r, m in ((8, 1.0), (9, 1.25))
    ]
    assert store.add_step_time_summaries(steps) == 2
    got = store.step_time_summaries(job_id="77")
    assert [r.rank for r in got] == [8, 9]
    assert got[0].slowdown == 0.0 and math.isclose(got[1].slowdown, 0.25)
    with pytest.raises(InvalidValue, match="window ends"):
        store.add_step_time_summaries(
            [
                StepTimeRecord(
                    job_id="1",
                    step="0",
                    node="g1",
                    rank=0,
                    window_start=utc(T0 + 1),
                    window_end=utc(T0),
                    iterations=1,
                    mean_step_s=1.0,
                )
            ]
        )
    assert store.prune_summaries(T0 + 61) == 4
    assert [r.value for r in store.telemetry_summaries()] == [None]


# ---------------------------------------------------------------- sweeps and triage
def test_sweep_lifecycle_and_verdict_rules(store, fake_clock):
    store.get_or_create_node("bad1", hw_class="h100x8")
    store.get_or_create_node("ref1", hw_class="h100x8")
    s1 = store.add_sweep("bad1", "1node")
    assert (s1.verdict, s1.hw_class, s1.reference_node, s1.slurm_job_id) == (
        Verdict.PENDING,
        "h100x8",
        None,
        None,
    )
    s2 = store.add_sweep(
        "bad1",
        SweepKind.TWO_NODE,
        reference_node="ref1",
        slurm_job_id="901",
        submitted_at=T0,
    )
    assert s2.reference_node == "ref1" and store.sweep_by_job("901") == s2
    fake_clock.advance(600)
    metrics = {"gemm_tflops": {"bfloat16": [612.5, 610.1]}, "membw_gbs": 2900.0}
    done = store.update_sweep(s1.id, slurm_job_id="900", started_at=T0 + 10, metrics=metrics, verdict="pass")
    assert done.verdict == Verdict.PASS and done.metrics == metrics
    assert done.finished_at == T0_DT + timedelta(seconds=600)
    assert store.update_sweep(s1.id, verdict="pass").verdict == Verdict.PASS  # restart-safe repeat
    with pytest.raises(InvalidValue, match="already pass; cannot change it to fail"):
        store.update_sweep(s1.id, verdict="fail", failure_reason="x")
    with pytest.raises(InvalidValue, match="needs a failure_reason"):
        store.update_sweep(s2.id, verdict="fail")
    store.update_sweep(s2.id, verdict="error", failure_reason="sweep job timed out after 30 min")
    assert [s.id for s in store.sweeps(hw_class="h100x8", kind="1node", verdict="pass")] == [s1.id]
    assert [s.id for s in store.sweeps(node="bad1", verdict=["fail", "error"])] == [s2.id]
    assert store.get_sweep(s2.id).failure_reason.startswith("sweep job timed out")
    with pytest.raises(InvalidValue, match="reference node is required"):
        store.add_sweep("bad1", "2node")
    with pytest.raises(InvalidValue, match="must be another node"):
        store.add_sweep("bad1", "2node", reference_node="bad1")
    with pytest.raises(InvalidValue, match="sweep kind '3node'"):
        store.add_sweep("bad1", "3node")


def test_triage_actions_and_recent_entries(store, fake_clock):
    store.get_or_create_node("n1")
    day = 86400.0
    first = store.add_triage_action("n1", "resweep", is_entry=True, evidence={"sweep": 1})
    fake_clock.advance(3600)
    store.add_triage_action("n1", TriageRung.REBOOT)  # escalation inside the same episode
    fake_clock.advance(3 * day)
    store.add_triage_action("n1", "resweep", is_entry=True)
    fake_clock.advance(5 * day)
    store.add_triage_action("n1", "resweep", is_entry=True)
    since = fake_clock.now() - 7 * day
    entries = store.recent_triage_entries("n1", since)
    assert len(entries) == 2  # the first entry is older than seven days
    assert len(store.recent_triage_entries("n1", T0)) == 3
    assert len(store.triage_actions("n1")) == 4
    done = store.update_triage_action(first.id, status="done", detail="passed", evidence={"exit": 0})
    assert done.status == ActionStatus.DONE and done.finished_at == utc(fake_clock.now())
    assert done.evidence == {"sweep": 1, "exit": 0}
    assert [a.id for a in store.triage_actions(status="done")] == [first.id]
    with pytest.raises(InvalidValue, match="triage rung 'pray'"):
        store.add_triage_action("n1", "pray")
    with pytest.raises(NodeNotRegistered):
        store.add_triage_action("ghost", "reboot")


def test_concurrent_writers_cannot_both_move_a_node(store, migrated_db_url, fake_clock):
    """A decision based on a state another writer is changing fails instead of overwriting it."""
    import threading
    import time

    from slurmguard.store import Store

    store.get_or_create_node("n1")
    other = Store.open(migrated_db_url, fake_clock)
    outcome: list[BaseException | None] = []

    def writer_b() -> None:
        try:
            other.transition("n1", "draining", "B", expect_from="healthy")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome.append(exc)

    try:
        with store.atomic() as tx:
            tx.transition("n1", "suspect", "A")
            b = threading.Thread(target=writer_b)
            b.start()
            time.sleep(0.3)
            assert b.is_alive()  # B waits for A's lock (PostgreSQL row lock, SQLite write lock)
        b.join(20)
    finally:
        other.close()
    assert len(outcome) == 1 and isinstance(outcome[0], StaleState), outcome
    assert [h.cause for h in store.node_history("n1")] == ["registered", "A"]
    assert store.get_node("n1").state == NodeState.SUSPECT


def test_registering_a_fleet_writes_every_node_and_its_first_transition(store):
    """register_nodes inserts in bulk (a controller's first cycle registers the
    whole fleet): each new node healthy with its 'registered' row, known ones
    only get Slurm's partitions, and nothing is registered twice."""
    fleet = {f"gpu{i:04d}": ["train"] for i in range(600)}
    store.register_nodes({"gpu0007": ["debug"]})
    assert store.register_nodes(fleet) == 599
    assert store.register_nodes(fleet) == 0
    nodes = store.list_nodes()
    assert len(nodes) == 600 and {n.state for n in nodes} == {NodeState.HEALTHY}
    assert {tuple(n.partitions) for n in nodes} == {("train",)}
    for name in ("gpu0000", "gpu0007", "gpu0599"):
        (first,) = store.node_history(name)
        assert (first.from_state, first.to_state, first.cause) == (None, NodeState.HEALTHY, "registered")


# ---------------------------------------------------------------- the listings' filters
def test_listings_filter_and_keep_the_newest_limit_oldest_first(store, fake_clock):
    """Every listing goes through one filter builder (store/query.py): None means any,
    filters combine, one string is one value, rows come oldest first and `limit` keeps
    the newest of them, a negative limit or an unknown enum value is refused by name."""
    store.register_nodes({"a1": ["train"], "a2": ["train", "debug"], "b1": ["debug"]})
    store.get_or_create_node("a1", hw_class="h100")
    store.get_or_create_node("a2", hw_class="h100")
    for k, (node, to) in enumerate([("a1", "suspect"), ("a2", "draining"), ("a1", "draining")]):
        fake_clock.advance(10)
        store.transition(node, to, f"t{k}")
    assert [n.name for n in store.list_nodes(["healthy", "draining"], hw_class="h100")] == ["a1", "a2"]
    assert [n.name for n in store.list_nodes(partition="debug")] == ["a2", "b1"]
    assert [n.name for n in store.list_nodes("draining")] == [
        "a1",
        "a2",
    ]  # a str is one state
    assert [t.cause for t in store.transitions(to_state="draining")] == ["t1", "t2"]
    assert [t.cause for t in store.transitions(since=T0 + 20, limit=1)] == ["t2"]
    assert [t.node for t in store.transitions(limit=2)] == ["a2", "a1"]

    sw = [
        store.add_sweep("a1", "1node"),
        store.add_sweep("a2", "2node", reference_node="b1"),
        store.add_sweep("b1", "1node", hw_class="a100"),
    ]
    store.update_sweep(sw[0].id, verdict="fail", failure_reason="bw")
    assert [s.id for s in store.sweeps(hw_class="h100", kind="1node")] == [sw[0].id]
    assert [s.id for s in store.sweeps(verdict=["pending", "fail"], limit=2)] == [
        sw[1].id,
        sw[2].id,
    ]
    assert [(s.node, s.reference_node) for s in store.sweeps(node="a2")] == [("a2", "b1")]
    assert store.sweeps(verdict="pass") == []

    first = store.add_triage_action("a1", "resweep", is_entry=True)
    store.add_triage_action("a2", "reboot")
    store.update_triage_action(first.id, status="done")
    assert [t.node for t in store.triage_actions(status="done")] == ["a1"]
    assert [t.rung for t in store.triage_actions("a2")] == [TriageRung.REBOOT]

    store.audit("drain", node="a1", at=T0 + 1)
    store.audit("drain", node="a2", at=T0 + 2, outcome="dry_run")
    store.audit("resume", node="a1", at=T0 + 3)
    assert [e.node for e in store.audit_entries(action="drain", until=T0 + 2)] == ["a1"]
    assert [e.action for e in store.audit_entries(node="a1", limit=1)] == ["resume"]
    assert [e.node for e in store.audit_entries(outcome=AuditOutcome.DRY_RUN)] == ["a2"]

    store.add_incident("7", nodes=["a1", "a2"], tier="drain", onset_at=T0)
    store.add_incident("8", nodes=["a1"], tier="verify", onset_at=T0)
    store.add_incident("9", nodes=["b1"], tier="verify", onset_at=T0)
    assert [i.job_id for i in store.incidents(node="a1", limit=1)] == ["8"]
    assert [i.job_id for i in store.incidents(job_id=7)] == ["7"]  # ids compare as text

    with pytest.raises(InvalidValue, match="limit must be >= 0"):
        store.sweeps(limit=-1)
    with pytest.raises(InvalidValue, match="sweep verdict 'maybe' is not one of"):
        store.sweeps(verdict=["pass", "maybe"])
    with pytest.raises(InvalidValue, match="triage status 'later'"):
        store.triage_actions(status="later")
    with pytest.raises(IllegalTransition, match="unknown node state 'sleepy'"):
        store.list_nodes("sleepy")
