"""Two controllers on one real PostgreSQL database: exactly one holds the lease,
a standby takes over when the leader process is SIGKILLed, and a leader that
lost its session is fenced (it cannot act, its actions carry the epoch).
About 15 s (a private PostgreSQL server, two short-lived processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from slurmguard.controller.lease import LEASE_ACTION, Lease, NotLeader
from slurmguard.respond.actions import ActionExecutor
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import IncidentStatus, Store, db
from tests.fixtures.common import REPO_ROOT, wait_for

pytestmark = pytest.mark.postgres

RETRY_S = 0.5

# one controller's leadership loop, as the daemon runs it: act (here: write a
# line with the epoch fence() returned) only while hold() says so
WORKER = """
import sys, time
from slurmguard.store import Store
from slurmguard.controller.lease import Lease, NotLeader
url, out, retry = sys.argv[1], sys.argv[2], float(sys.argv[3])
lease = Lease(Store.open(url), timeout_s=4)
with open(out, "a", buffering=1) as f:
    while True:
        if lease.hold():
            try:
                ev = lease.fence()
            except NotLeader:
                continue
            f.write(f"{time.time():.3f} {ev['lease_epoch']}\\n")
            time.sleep(0.05)
        else:
            open(out + ".standby", "w").close()  # started, connected, standing by
            time.sleep(retry)
"""


def _lines(path: Path) -> list[tuple[float, int]]:
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        t, e = ln.split()
        out.append((float(t), int(e)))
    return out


@pytest.fixture
def pg(fresh_postgres_url):
    db.upgrade(fresh_postgres_url)
    return fresh_postgres_url


def _start(script: Path, url: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen(
        [sys.executable, str(script), url, str(out), str(RETRY_S)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def test_one_leader_and_the_standby_takes_over_when_the_leader_is_killed(pg, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    a_out, b_out, c_out = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    procs = []
    try:
        a = _start(script, pg, a_out)
        procs.append(a)
        wait_for(lambda: _lines(a_out), 30, "controller A to lead", 0.1)
        b = _start(script, pg, b_out)
        procs.append(b)
        # (a process start can take seconds on a loaded machine: wait for it to stand by)
        wait_for(lambda: Path(f"{b_out}.standby").exists(), 60, "controller B to stand by", 0.1)
        time.sleep(3 * RETRY_S)
        assert _lines(b_out) == [], "two controllers active at once"
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        killed_at = time.time()
        wait_for(lambda: _lines(b_out), 10, "controller B to take over", 0.05)
        took = _lines(b_out)[0][0] - killed_at
        assert took <= RETRY_S + 1.5, f"standby took {took:.2f}s to take over"
        a_last, b_first = _lines(a_out)[-1], _lines(b_out)[0]
        assert a_last[0] < b_first[0]  # never both
        assert b_first[1] == a_last[1] + 1  # the new leader's epoch fences the old one
        # the old leader comes back: it stands by
        c = _start(script, pg, c_out)
        procs.append(c)
        wait_for(lambda: Path(f"{c_out}.standby").exists(), 60, "controller C to stand by", 0.1)
        time.sleep(3 * RETRY_S)
        assert _lines(c_out) == []
        assert {e for _, e in _lines(b_out)} == {b_first[1]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_leader_that_lost_its_session_is_fenced(pg, fake_clock):
    s1, s2 = Store.open(pg, fake_clock), Store.open(pg, fake_clock)
    try:
        one, two = Lease(s1, timeout_s=4, holder="one"), Lease(s2, timeout_s=4, holder="two")
        assert one.hold() and not two.hold()
        slurm = FakeSlurm(clock=fake_clock)
        ex = ActionExecutor(slurm, s1, fence=one.fence)
        ex.drain("node1", "step +30%")
        (row,) = s1.audit_entries(action="drain")
        assert row.evidence["lease_epoch"] == one.epoch
        # one's session is cut (a database restart or network loss): two takes the lease
        u = make_url(pg)
        with psycopg.connect(
            host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=True
        ) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'slurmguard lease one'"
            )
        wait_for(two.hold, 10, "the standby to take the lease", 0.1)
        assert two.epoch == 2
        with pytest.raises(NotLeader):
            ex.drain("node2", "step +30%")
        assert not slurm.node("node2").drained
        assert not one.hold()  # it reconnects, finds the lock taken: standby
        with pytest.raises(NotLeader):
            ex.requeue(1, "restart")
        epochs = [e.evidence["lease_epoch"] for e in s2.audit_entries(action=LEASE_ACTION)]
        assert epochs == [1, 2]
        two.release()
        assert one.hold() and one.epoch == 3
    finally:
        s1.close()
        s2.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthz(port: int) -> str:
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return json.loads(r.read())["detail"]
    except OSError:  # not listening yet
        return ""


def _metric(port: int, name: str) -> float | None:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def test_two_controller_daemons_one_active_the_other_takes_over(pg):
    import threading

    from slurmguard.clock import SystemClock
    from slurmguard.config import parse_policy
    from slurmguard.controller.daemon import DaemonOptions, run

    policy = parse_policy("controller: {lease_retry_s: 0.3, cycle_interval_s: 0.2}")
    slurm = FakeSlurm()
    daemons = []
    for _ in range(2):
        port, stop = _free_port(), threading.Event()
        opts = DaemonOptions(host="127.0.0.1", port=port, secret=b"s" * 32, interval_s=0.2, sweeps=False)
        t = threading.Thread(
            target=run,
            args=(policy, Store.open(pg), slurm, opts),
            kwargs={"clock": SystemClock(), "stop": stop},
            daemon=True,
        )
        t.start()
        daemons.append((port, stop, t))
        if len(daemons) == 1:
            wait_for(
                lambda port=port, t=t: "active" in _healthz(port) or not t.is_alive(),
                30,
                "the first daemon to lead",
                0.1,
            )
            assert t.is_alive(), "the first daemon ended"
    (pa, stop_a, ta), (pb, _, _) = daemons
    try:
        wait_for(lambda: "standby" in _healthz(pb), 30, "the second daemon to stand by", 0.1)
        assert "active (lease epoch 1)" in _healthz(pa)
        assert _metric(pa, "slurmguard_controller_active") == 1.0
        assert _metric(pa, "slurmguard_lease_epoch") == 1.0
        assert _metric(pb, "slurmguard_controller_active") == 0.0
        assert _metric(pb, "slurmguard_lease_epoch") == 0.0
        stop_a.set()  # a clean stop gives the lease up
        ta.join(30)
        wait_for(lambda: "active (lease epoch 2)" in _healthz(pb), 10, "the standby to take over", 0.1)
        wait_for(
            lambda: (
                _metric(pb, "slurmguard_controller_active") == 1.0
                and _metric(pb, "slurmguard_lease_epoch") == 2.0
            ),
            10,
            "the new leader's /metrics",
            0.1,
        )
    finally:
        for _, stop, t in daemons:
            stop.set()
            t.join(30)


def test_a_requeue_its_leader_died_in_is_recorded_and_its_hold_lifted_by_the_new_leader(pg, fake_clock):
    """A requeue takes seconds (the command waits for Slurm's post-requeue hold to
    lift it): a leader killed inside it leaves the job requeued in Slurm, held for
    minutes, and no audit row. The new leader records it under the old epoch and
    lifts the hold; it requeues nothing again."""
    from slurmguard.controller.loop import REQUEUE_SETTLE_S, Controller
    from tests.test_controller_loop import POLICY, feed_job

    s1, s2 = Store.open(pg, fake_clock), Store.open(pg, fake_clock)
    try:
        slurm = FakeSlurm(clock=fake_clock)
        one, two = Lease(s1, timeout_s=4, holder="one"), Lease(s2, timeout_s=4, holder="two")
        a, b = Controller(POLICY, s1, slurm, fake_clock), Controller(POLICY, s2, slurm, fake_clock)
        a.executor.fence, b.executor.fence = one.fence, two.fence
        assert one.hold() and not two.hold()
        job = slurm.start_job(["node1", "node2"])
        feed_job(a, fake_clock, job, {"node1": 1.0, "node2": 1.3}, slow_iters=15, seq=1)
        real_requeue = slurm.requeue

        def requeue_then_die(*args, **kw):  # Slurm requeued; killed while waiting for the hold
            real_requeue(*args, **kw)
            raise SystemExit("killed")

        slurm.requeue = requeue_then_die
        with pytest.raises(SystemExit):
            a.cycle()
        slurm.requeue = real_requeue
        one._drop("killed")  # noqa: SLF001 - its process died: the session closes
        assert slurm.job(job).state == "PENDING" and s2.audit_entries(action="requeue") == []
        wait_for(two.hold, 10, "the standby to take the lease", 0.1)
        lifted: list[int] = []
        slurm.release_requeue_hold = lambda j: lifted.append(j) or slurm.job(j).state  # type: ignore[method-assign]
        fake_clock.advance(2)
        b.cycle()
        (row,) = s2.audit_entries(action="requeue")
        assert row.job_id == str(job) and row.evidence["lease_epoch"] == 1 and row.evidence["recorded_late"]
        assert lifted == [job] and slurm.job(job).restarts == 1
        (inc,) = s2.incidents(job_id=str(job))
        assert inc.status == IncidentStatus.MITIGATED and inc.evidence["requeued_at"] is not None
        fake_clock.advance(2)
        b.cycle()  # still held (Slurm's hold appears once the old run has ended): lifted again
        assert lifted == [job, job]
        fake_clock.advance(REQUEUE_SETTLE_S)
        b.cycle()
        assert lifted == [job, job] and len(s2.audit_entries(action="requeue")) == 1
    finally:
        s1.close()
        s2.close()
