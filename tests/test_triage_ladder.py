"""The triage ladder on its own: rung order, Guard's repeat rule, idempotent entry, rungs
that fail, and nodes that are not ours (FakeSlurm, SQLite, FakeClock)."""

from __future__ import annotations

import pytest

from slurmguard.config import TriagePolicy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.runner import CommandError, CommandResult, CommandTimeout
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import ActionStatus, NodeState, TriageRung
from slurmguard.sweeps.episode import load_episode
from slurmguard.sweeps.ladder import TriageLadder

DAY = 86400.0


class Runner:
    def __init__(self, exc: Exception | None = None) -> None:
        self.calls: list[list[str]] = []
        self.exc = exc

    def run(self, argv, *, timeout, check=True, env=None, input=None):
        self.calls.append(list(argv))
        if self.exc is not None:
            raise self.exc
        return CommandResult(tuple(argv), 0, "ok\n", "")


@pytest.fixture
def world(sqlite_store, fake_clock):
    fake = FakeSlurm(clock=fake_clock)
    for n in fake.nodes():
        sqlite_store.get_or_create_node(n.name)
    return fake, sqlite_store, fake_clock


def ladder(world, runner=None, **policy) -> TriageLadder:
    fake, store, clock = world
    deleted: list[str] = []
    lad = TriageLadder(
        TriagePolicy(**policy),
        store,
        ActionExecutor(fake, store),
        clock,
        runner=runner or Runner(),
        delete_quarantine=deleted.append,
    )
    lad.deleted = deleted  # type: ignore[attr-defined]
    return lad


def quarantined(world, node: str = "node2") -> None:
    fake, store, _ = world
    fake.drain(node, "slurmguard: sweep1 gpu0 membw -30% vs class")
    store.transition(node, NodeState.DRAINING, "drained")
    store.transition(node, NodeState.QUARANTINED, "quarantined")


def fail_sweep(world, lad: TriageLadder, node: str = "node2", sweep: int | None = None):
    """A failed sweep round: enter the ladder for a (new) failed sweep."""
    _, store, clock = world
    clock.advance(60)
    ep = load_episode(store, node)
    return lad.enter(
        node,
        ep,
        failed_sweep=sweep if sweep is not None else len(ep.actions) + 1,
        reason="slurmguard: sweep1 gpu0 membw -30% vs class",
    )


def step(world, lad: TriageLadder, node: str = "node2") -> str:
    fake, store, clock = world
    clock.advance(5)
    ep = load_episode(store, node)
    s = lad.decide(node, fake.node(node), ep)
    if s.action == "blocked":
        return "blocked"
    return lad.apply(s, fake.node(node), ep)


def test_rungs_follow_the_policy_order(world):
    lad = ladder(world, ladder=("resweep", "reimage", "terminal"))
    _, store, _ = world
    quarantined(world)
    a = fail_sweep(world, lad)
    assert (a.rung, a.is_entry, a.evidence["entry_count"]) == (TriageRung.RESWEEP, True, 1)
    assert store.get_node("node2").state is NodeState.REMEDIATION
    assert step(world, lad) == "resweep done; sweeping again"
    assert store.get_node("node2").state is NodeState.QUARANTINED
    a = fail_sweep(world, lad)
    assert (a.rung, a.is_entry) == (TriageRung.REIMAGE, False)
    assert step(world, lad) == "reimage skipped (no reimage_command)"
    assert "planned after reimage skipped" in step(world, lad)
    assert load_episode(store, "node2").last_action.rung is TriageRung.TERMINAL
    assert step(world, lad) == "terminal"
    assert store.get_node("node2").state is NodeState.TERMINAL
    assert lad.deleted == ["node2"]  # type: ignore[attr-defined]
    entries = [a.is_entry for a in store.triage_actions("node2")]
    assert entries == [True, False, False]


@pytest.mark.parametrize(
    "earlier_days,limit,expect",
    [
        ((6.9, 3.0), 3, TriageRung.TERMINAL),  # third entry inside 7 days
        ((7.1, 3.0), 3, TriageRung.RESWEEP),  # one of them just outside the window
        ((), 3, TriageRung.RESWEEP),
        ((1.0,), 2, TriageRung.TERMINAL),  # repeat_limit from the policy
    ],
)
def test_repeat_rule(world, earlier_days, limit, expect):
    _, store, clock = world
    for d in earlier_days:
        store.add_triage_action(
            "node2",
            TriageRung.RESWEEP,
            is_entry=True,
            status=ActionStatus.DONE,
            at=clock.now() + 60 - d * DAY,
        )
    lad = ladder(world, repeat_limit=limit)
    quarantined(world)
    a = fail_sweep(world, lad)
    assert a.rung is expect and a.is_entry
    # the report's "what next" applies the same rule to the same rows
    from slurmguard.store import utc
    from slurmguard.triage.report_next import recommend

    nxt = recommend(
        "node2",
        NodeState.REMEDIATION,
        live=None,
        slurm_reachable=True,
        episode_sweeps=(),
        episode_triage=(a,),
        all_triage=store.triage_actions("node2"),
        now=utc(clock.now()),
        policy=lad.policy,
    )
    assert nxt.code == ("replace" if expect is TriageRung.TERMINAL else "rung_running")
    if expect is TriageRung.TERMINAL:
        assert f"triage entry {len(earlier_days) + 1} within 7 days" in a.detail
        assert step(world, lad) == "terminal"
        fake, _, _ = world
        assert "replace node" in fake.node("node2").reason


def test_entering_twice_for_the_same_failed_sweep_records_one_rung(world):
    lad = ladder(world)
    _, store, _ = world
    quarantined(world)
    a1 = fail_sweep(world, lad, sweep=7)
    a2 = lad.enter("node2", load_episode(store, "node2"), failed_sweep=7, reason="again")
    assert a1.id == a2.id and len(store.triage_actions("node2")) == 1
    assert [t.to_state.value for t in store.node_history("node2")].count("remediation") == 1


def test_reimage_runs_the_site_command_with_the_node_name(world):
    runner = Runner()
    lad = ladder(world, runner, ladder=("reimage", "terminal"), reimage_command=("/opt/site/reimage", "-y"))
    _, store, _ = world
    quarantined(world)
    fail_sweep(world, lad)
    assert step(world, lad) == "reimage done; sweeping again"
    assert runner.calls == [["/opt/site/reimage", "-y", "node2"]]
    a = store.triage_actions("node2")[-1]
    assert a.status is ActionStatus.DONE and a.evidence["argv"] == ["/opt/site/reimage", "-y", "node2"]
    assert [e.action for e in store.audit_entries(node="node2")][-1] == "reimage"


@pytest.mark.parametrize(
    "exc,expect",
    [
        (
            CommandError(["/opt/site/reimage"], "/opt/site/reimage: exit 4", returncode=4, stderr="no IPMI"),
            "reimage command failed: /opt/site/reimage: exit 4",
        ),
        (
            CommandTimeout(["/opt/site/reimage"], "/opt/site/reimage: timed out after 30s", timed_out=True),
            "timed out after 30s",
        ),
    ],
)
def test_a_failing_reimage_command_fails_the_rung_and_the_ladder_moves_on(world, exc, expect):
    lad = ladder(
        world,
        Runner(exc),
        ladder=("reimage", "terminal"),
        reimage_command=("/opt/site/reimage",),
        reimage_timeout_s=30,
    )
    _, store, _ = world
    quarantined(world)
    fail_sweep(world, lad)
    assert expect in step(world, lad)
    a = store.triage_actions("node2")[-1]
    assert a.status is ActionStatus.FAILED and expect in a.detail
    assert store.get_node("node2").state is NodeState.REMEDIATION
    step(world, lad)
    assert store.triage_actions("node2")[-1].rung is TriageRung.TERMINAL


def test_reimage_interrupted_by_a_restart_is_not_run_twice(world):
    runner = Runner()
    lad = ladder(world, runner, ladder=("reimage", "terminal"), reimage_command=("/opt/site/reimage",))
    _, store, _ = world
    quarantined(world)
    a = fail_sweep(world, lad)
    store.update_triage_action(a.id, status=ActionStatus.RUNNING)  # the old controller died here
    assert "outcome unknown" in step(world, lad)
    assert runner.calls == []


def test_planned_rung_on_a_node_someone_else_took_out_waits(world):
    fake, store, _ = world
    lad = ladder(world)
    quarantined(world)
    fail_sweep(world, lad)
    fake.resume("node2")
    fake.admin_drain("node2", "PSU replaced, burn-in pending")
    for _ in range(3):
        assert step(world, lad) == "blocked"
    assert store.triage_actions("node2")[-1].status is ActionStatus.PLANNED
    assert fake.node("node2").reason == "PSU replaced, burn-in pending" and fake.reboots == []


def test_terminal_leaves_someone_elses_drain_alone(world):
    fake, store, clock = world
    for d in (1.0, 2.0):
        store.add_triage_action(
            "node2", TriageRung.RESWEEP, is_entry=True, status=ActionStatus.DONE, at=clock.now() - d * DAY
        )
    lad = ladder(world)
    quarantined(world)
    fail_sweep(world, lad)
    fake.resume("node2")
    fake.admin_drain("node2", "vendor RMA 1234")
    assert step(world, lad) == "terminal"
    assert fake.node("node2").reason == "vendor RMA 1234"
    assert "left as drained by someone else" in store.triage_actions("node2")[-1].detail
