"""A controller that stops between two steps of one response (killed, or its lease
lost) leaves the next controller, the standby of a pair or itself restarted,
enough to finish it once: FakeSlurm, a real SQLite store, a FakeClock (about 1 s).
The same on the real cluster with two controllers: tests/test_failover_cluster.py."""

from __future__ import annotations

import pytest

from slurmguard.controller.loop import Controller
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import NodeState, Store
from tests.test_controller_loop import POLICY, feed_job

#: the drain tier first (2 GPU-s), the requeue well after it (20 GPU-s)
APART = POLICY.model_copy(
    update={
        "response": POLICY.response.model_copy(
            update={
                "escalation": POLICY.response.escalation.model_copy(
                    update={"drain_checkpoint_gpu_s": 2.0, "requeue_gpu_s": 20.0}
                )
            }
        )
    }
)


def test_killed_between_the_drain_and_its_lifecycle_record_the_next_controller_records_both(
    sqlite_store, fake_clock, monkeypatch
):
    """The drain's audit row and the node's lifecycle record are one transaction with
    the close of its intent: killed inside it, neither is written, and the next
    controller records both from Slurm's state. Without the lifecycle record the
    sweep scheduler never takes the drained node on."""
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(POLICY, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"])
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)

    def dies(*a, **k):  # inside the drain's record, after `scontrol update State=DRAIN`
        raise SystemExit("killed")

    with monkeypatch.context() as m:
        m.setattr(Store, "transition", dies)
        with pytest.raises(SystemExit):
            ctl.cycle()
    assert slurm.node("node2").drained_by_us and sqlite_store.audit_entries(action="drain") == []
    assert sqlite_store.get_node("node2").state is NodeState.HEALTHY
    nxt = Controller(POLICY, sqlite_store, slurm, fake_clock)
    fake_clock.advance(5)
    feed_job(nxt, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=20, seq=2)
    res = nxt.cycle()
    (drain,) = sqlite_store.audit_entries(action="drain")
    assert ("drain", "node2") not in res.actions and drain.node == "node2" and drain.evidence["recorded_late"]
    assert sqlite_store.get_node("node2").state is NodeState.DRAINING
    assert res.actions == [("requeue", str(job))]


def test_killed_between_the_drain_and_its_checkpoint_signal_the_signal_precedes_the_requeue(
    sqlite_store, fake_clock
):
    """The job asked for a checkpoint signal; its controller drained its node and
    stopped before signalling. By the time the next one runs, the requeue is due:
    the job gets its signal first and a cycle to checkpoint, then the requeue,
    each once, as without the stop."""
    slurm = FakeSlurm(clock=fake_clock)
    ctl = Controller(APART, sqlite_store, slurm, fake_clock)
    job = slurm.start_job(["node1", "node2"], comment="slurmguard:signal")
    feed_job(ctl, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)

    def dies(*a, **k):  # right after the drain, before the checkpoint signal
        raise SystemExit("killed")

    ctl.executor.signal = dies  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        ctl.cycle()
    assert slurm.node("node2").drained_by_us and slurm.signals == []
    nxt = Controller(APART, sqlite_store, slurm, fake_clock)
    fake_clock.advance(30)  # paid: about 9 GPU-s at the drain, 27 now
    feed_job(nxt, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=38, seq=2)
    assert nxt.cycle().actions == [("signal", str(job))]
    assert slurm.signals == [(job, "USR1")] and slurm.job(job).restarts == 0
    fake_clock.advance(5)
    feed_job(nxt, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=42, seq=3)
    assert nxt.cycle().actions == [("requeue", str(job))]
    assert len(sqlite_store.audit_entries(action="signal")) == 1
    assert len(sqlite_store.audit_entries(action="drain")) == 1 and slurm.job(job).restarts == 1
