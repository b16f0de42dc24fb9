"""A controller killed between a Slurm action and its audit row: the action is
written ahead (an intent), and the next controller records it exactly once,
under the lease epoch it was taken with, from what Slurm shows (or closes it
as not taken, and the decision is taken again). Every action kind the
ActionExecutor takes, then the controller's own drain, checkpoint signal and
requeue and the sweep scheduler's submit, killed right after the Slurm call.
FakeSlurm; SQLite and a real PostgreSQL (`store` runs each test on both);
about 10 s with both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from slurmguard.controller.loop import Controller
from slurmguard.respond.actions import ActionExecutor, Unsettled, incident_effect
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import AuditOutcome, IncidentStatus, NodeState, Store
from tests.test_controller_loop import POLICY, feed_job


class Killed(BaseException):
    """The controller process dies (nothing in it may catch this)."""


def _kill_after(slurm: FakeSlurm, method: str, *, before: bool = False) -> Callable[[], None]:
    """Make slurm.<method> take effect, then kill the caller (before=True: kill it
    before Slurm is reached); returns the undo."""
    real = getattr(slurm, method)

    def killed(*a: Any, **kw: Any) -> Any:
        if not before:
            real(*a, **kw)
        raise Killed(method)

    setattr(slurm, method, killed)
    return lambda: setattr(slurm, method, real)


def _executor(slurm: FakeSlurm, store: Store, epoch: int) -> ActionExecutor:
    return ActionExecutor(slurm, store, fence=lambda: {"lease_epoch": epoch})


def _prepare(slurm: FakeSlurm) -> dict[str, int]:
    slurm.drain("node3", "slurmguard: to resume")
    slurm.set_comment("node4", "slurmguard: pending verification: x")
    slurm.create_reservation("sg_old", ["node4"], duration_min=10)
    return {"job": slurm.start_job(["node1", "node2"])}


#: action -> (the FakeSlurm method it calls, the executor call)
ACTIONS: dict[str, tuple[str, Callable[[ActionExecutor, dict[str, int]], Any]]] = {
    "drain": ("drain", lambda ex, ids: ex.drain("node2", "step +30%")),
    "resume": ("resume", lambda ex, ids: ex.resume("node3")),
    "comment": ("set_comment", lambda ex, ids: ex.comment("node1", "pending verification: sm clock")),
    "clear_comment": ("clear_comment", lambda ex, ids: ex.clear_comment("node4")),
    "requeue": ("requeue", lambda ex, ids: ex.requeue(ids["job"], "restart on healthy nodes")),
    "cancel": ("cancel", lambda ex, ids: ex.cancel(ids["job"], "sweep not started")),
    "signal": ("signal", lambda ex, ids: ex.signal(ids["job"], "USR1", "checkpoint")),
    "reservation_create": (
        "create_reservation",
        lambda ex, ids: ex.create_reservation("sg_quarantine_node2", ["node2"], 30),
    ),
    "reservation_delete": ("delete_reservation", lambda ex, ids: ex.delete_reservation("sg_old")),
    "submit": (
        "submit",
        lambda ex, ids: ex.submit(
            "#!/bin/sh\n", node="node2", reason="sweep1", job_name="sg_sweep7", nodelist=["node2"]
        ),
    ),
    "reboot": ("reboot", lambda ex, ids: ex.reboot("node3", "triage reboot")),
}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_killed_after_the_slurm_call_the_next_leader_records_it_once_under_its_epoch(
    store, fake_clock, action
):
    slurm = FakeSlurm(clock=fake_clock)
    ids = _prepare(slurm)
    method, call = ACTIONS[action]
    undo = _kill_after(slurm, method)
    with pytest.raises(Killed):
        call(_executor(slurm, store, 1), ids)
    undo()
    assert store.audit_entries(action=action) == []  # the audit row was lost with the process
    (intent,) = store.open_intents()
    fake_clock.advance(3)
    nodes, jobs = slurm.fleet()
    nxt = _executor(slurm, store, 2)
    assert nxt.reconcile({n.name: n for n in nodes}, {j.job_id: j for j in jobs}) == [
        f"{action} {intent.node or f'job {intent.job_id}'}: recorded late"
    ]
    (row,) = store.audit_entries(action=action)
    assert row.outcome is AuditOutcome.OK and row.at == intent.at
    assert row.evidence["lease_epoch"] == 1 and row.evidence["recorded_by_epoch"] == 2
    assert row.evidence["recorded_late"] and row.evidence.get("unverified", False) is (action == "signal")
    assert store.open_intents() == []
    assert nxt.reconcile({n.name: n for n in nodes}, {j.job_id: j for j in jobs}) == []
    # the old leader, fenced but alive, finishes its call after all: no second row
    assert store.close_intent(intent, outcome=AuditOutcome.OK) is None
    assert len(store.audit_entries(action=action)) == 1


@pytest.mark.parametrize("action", sorted(set(ACTIONS) - {"signal"}))
def test_killed_before_slurm_acted_the_action_is_closed_as_not_taken(store, fake_clock, action):
    """Nothing is redone by the reconciling itself: the decision that asked for the
    action is taken again from Slurm's state (which shows it was not)."""
    slurm = FakeSlurm(clock=fake_clock)
    ids = _prepare(slurm)
    method, call = ACTIONS[action]
    undo = _kill_after(slurm, method, before=True)
    with pytest.raises(Killed):
        call(_executor(slurm, store, 1), ids)
    undo()
    before = list(slurm.calls)
    nodes, jobs = slurm.fleet()
    view = {n.name: n for n in nodes}, {j.job_id: j for j in jobs}
    nxt = _executor(slurm, store, 2)
    # (its controller, fenced but perhaps alive, may still have the command on its way)
    fake_clock.advance(nxt.unsettled_s - 1)
    (intent,) = store.open_intents()
    assert nxt.reconcile(*view) == []
    with pytest.raises(Unsettled):
        call(nxt, ids)  # nothing on that node or job until it is settled
    fake_clock.advance(2)
    assert nxt.reconcile(*view) == [f"{action} {intent.node or f'job {intent.job_id}'}: not taken"]
    (row,) = store.audit_entries(action=action)
    assert row.outcome is AuditOutcome.ERROR and row.error.startswith("not taken")
    assert row.evidence["lease_epoch"] == 1 and store.open_intents() == []
    assert slurm.calls == before


def test_a_signal_whose_leader_died_is_never_sent_twice(store, fake_clock):
    """Slurm keeps no trace of a signal: one whose leader died before its audit row is
    recorded as sent (unverified) rather than sent again."""
    slurm = FakeSlurm(clock=fake_clock)
    job = slurm.start_job(["node1", "node2"])
    undo = _kill_after(slurm, "signal", before=True)
    with pytest.raises(Killed):
        _executor(slurm, store, 1).signal(job, "USR1", "checkpoint")
    undo()
    nodes, jobs = slurm.fleet()
    _executor(slurm, store, 2).reconcile({n.name: n for n in nodes}, {j.job_id: j for j in jobs})
    (row,) = store.audit_entries(action="signal")
    assert row.outcome is AuditOutcome.OK and row.evidence["unverified"]


# ---------------------------------------------------------------- the controller's own actions
def test_drain_killed_before_its_audit_row_is_recorded_once_and_the_requeue_follows(store, fake_clock):
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, store, slurm, fake_clock)
    ctl.executor.fence = lambda: {"lease_epoch": 1}
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    undo = _kill_after(slurm, "drain")
    with pytest.raises(Killed):
        ctl.cycle()
    undo()
    assert slurm.node("node2").drained_by_us and store.audit_entries(action="drain") == []
    nxt = Controller(POLICY, store, slurm, fake_clock)
    nxt.executor.fence = lambda: {"lease_epoch": 2}
    fake_clock.advance(5)
    feed_job(nxt, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=20, seq=2)
    assert nxt.cycle().actions == [("requeue", str(job))]
    (drain,) = store.audit_entries(action="drain")
    (requeue,) = store.audit_entries(action="requeue")
    assert drain.node == "node2" and drain.evidence["lease_epoch"] == 1 and drain.evidence["recorded_late"]
    assert requeue.evidence["lease_epoch"] == 2 and not requeue.evidence.get("recorded_late")
    assert drain.evidence["incident"] == requeue.evidence["incident"]
    assert store.get_node("node2").state is NodeState.DRAINING
    assert [c[0] for c in slurm.calls].count("drain") == 1 and slurm.job(job).restarts == 1


def test_requeue_killed_before_its_audit_row_closes_the_incident_once(store, fake_clock):
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, store, slurm, fake_clock)
    ctl.executor.fence = lambda: {"lease_epoch": 1}
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
    undo = _kill_after(slurm, "requeue")
    with pytest.raises(Killed):
        ctl.cycle()
    undo()
    killed_at = fake_clock.now()
    assert slurm.job(job).restarts == 1 and store.audit_entries(action="requeue") == []
    nxt = Controller(POLICY, store, slurm, fake_clock)
    nxt.executor.fence = lambda: {"lease_epoch": 2}
    lifted: list[int] = []
    slurm.release_requeue_hold = lambda j: lifted.append(j) or slurm.job(j).state  # type: ignore[method-assign]
    fake_clock.advance(5)
    assert nxt.cycle().actions == []
    (row,) = store.audit_entries(action="requeue")
    assert (
        row.evidence["lease_epoch"] == 1
        and row.evidence["recorded_late"]
        and row.evidence["restarts_before"] == 0
    )
    (inc,) = store.incidents(job_id=str(job))
    assert inc.status is IncidentStatus.MITIGATED and inc.evidence["requeued_at"] == pytest.approx(killed_at)
    assert lifted == [job]  # its post-requeue hold, lifted while the job waits
    fake_clock.advance(5)
    nxt.cycle()
    assert len(store.audit_entries(action="requeue")) == 1 and slurm.job(job).restarts == 1


def test_checkpoint_signal_killed_before_its_audit_row_is_not_sent_again(store, fake_clock):
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"], comment="slurmguard:signal")
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=10, seq=1)
    ctl.cycle()
    fake_clock.advance(30)
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=40, seq=2)
    undo = _kill_after(slurm, "signal")
    with pytest.raises(Killed):
        ctl.cycle()
    undo()
    assert slurm.signals == [(job, "USR1")] and store.audit_entries(action="signal") == []
    nxt = Controller(POLICY, store, slurm, fake_clock)
    fake_clock.advance(5)
    feed_job(nxt, fake_clock, job, {"node1": 1.0, "node2": 1.12}, slow_iters=45, seq=3)
    assert nxt.cycle().actions == []
    assert slurm.signals == [(job, "USR1")]
    (row,) = store.audit_entries(action="signal")
    assert row.evidence["recorded_late"] and row.evidence["incident"]
    (inc,) = store.incidents(job_id=str(job))
    assert inc.status is IncidentStatus.MITIGATED and "checkpoint" in (inc.outcome or "")


def test_an_effect_that_cannot_be_applied_does_not_keep_the_action_unrecorded(store, fake_clock):
    """Its incident gone: the audit row is written all the same, saying so, live and late."""
    slurm = FakeSlurm(clock=fake_clock)
    job = slurm.start_job(["node1", "node2"])
    gone = [incident_effect(424242, status="mitigated", outcome="requeued", stamp=["requeued_at"])]
    _executor(slurm, store, 1).signal(job, "USR1", "checkpoint", effects=gone)
    undo = _kill_after(slurm, "requeue")
    with pytest.raises(Killed):
        _executor(slurm, store, 1).requeue(job, "restart", effects=gone)
    undo()
    nodes, jobs = slurm.fleet()
    _executor(slurm, store, 2).reconcile({n.name: n for n in nodes}, {j.job_id: j for j in jobs})
    for action in ("signal", "requeue"):
        (row,) = store.audit_entries(action=action)
        assert row.outcome is AuditOutcome.OK and "424242" in row.evidence["effects_failed"]
    assert store.open_intents() == []


@pytest.mark.parametrize("final", ["REVOKED", "SPECIAL_EXIT", "DEADLINE", "CANCELLED by 0"])
def test_a_cancel_whose_job_reached_any_final_state_reads_as_done(store, fake_clock, final):
    """A cancel killed after its call, whose job Slurm then shows in a final
    state other than CANCELLED (a federation's REVOKED, a held SPECIAL_EXIT, a
    DEADLINE, or CANCELLED with its 'by UID'): there is nothing left for it to
    do, and it is recorded as taken, not closed as not taken and sent again."""
    slurm = FakeSlurm(clock=fake_clock)
    ids = _prepare(slurm)
    undo = _kill_after(slurm, "cancel")
    with pytest.raises(Killed):
        ACTIONS["cancel"][1](_executor(slurm, store, 1), ids)
    undo()
    slurm.finish_job(ids["job"], state=final)
    fake_clock.advance(3)
    nodes, jobs = slurm.fleet()
    nxt = _executor(slurm, store, 2)
    assert nxt.reconcile({n.name: n for n in nodes}, {j.job_id: j for j in jobs}) == [
        f"cancel job {ids['job']}: recorded late"
    ]
    (row,) = store.audit_entries(action="cancel")
    assert row.outcome is AuditOutcome.OK
