"""The active controller loses the database while its host lives, on the real
local cluster: two controller daemons reach one real PostgreSQL server, each
through a TCP relay of its own; the test closes the leader's relay (its
connections reset, new ones refused). The standby takes the lease within two
cycles and acts (a node whose simulated telemetry deviates gets its
pending-verification comment, once, under the new epoch); the old leader,
alive and seeing the same reports, takes no action; given its database back it
stays standby (its epoch is gone). A relay cannot drop packets silently (the
kernel still answers for its sockets), so a leader whose network goes quiet is
left to the server's TCP keepalives (controller.lease_timeout_s), tested with
FakeSlurm in tests/test_failover_pg.py. About 26 s (load average 3-5, 2 cores).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from sqlalchemy.engine import make_url

from slurmguard.controller.lease import LEASE_ACTION
from slurmguard.store import Store, db
from slurmguard_dev.devcluster import ClusterSpec, DevCluster
from slurmguard_dev.devcluster.guard import Guard
from tests.fixtures.guard import wait_for
from tests.test_failover_cluster import SLURM_ACTIONS, _health, _leader, _metric, _roles_say

pytestmark = [pytest.mark.slurm, pytest.mark.postgres, pytest.mark.slow]

CYCLE_S = 2.0
RETRY_S = 0.5
POLICY = {
    "controller": {"cycle_interval_s": CYCLE_S, "lease_retry_s": RETRY_S},
    "sweeps": {"peer_sweeps": False},
}


class Relay:
    """A TCP relay on 127.0.0.1 to (host, port) that can be cut (every connection
    closed, new ones refused) and restored on the same port."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self.port = ls.getsockname()[1]
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._socks = []


@pytest.fixture
def relayed_pair(fresh_postgres_url, tmp_path):
    db.upgrade(fresh_postgres_url)
    u = make_url(fresh_postgres_url)
    relays = [Relay(u.host or "127.0.0.1", u.port or 5432) for _ in range(2)]
    urls = [u.set(port=r.port).render_as_string(hide_password=False) for r in relays]
    cluster = DevCluster(ClusterSpec(state_dir=tmp_path / "cluster", nodes=4))
    cluster.up()
    try:
        guard = Guard(
            cluster,
            overrides=POLICY,
            database_url=fresh_postgres_url,
            controllers=2,
            controller_database_urls=urls,
        )
        guard.start(fresh=True)
        with Store.open(fresh_postgres_url) as store:
            yield guard, store, relays
    finally:
        cluster.down()
        for r in relays:
            r.cut()


def test_a_leader_cut_from_the_database_is_replaced_within_two_cycles_and_cannot_act(relayed_pair):
    g, store, relays = relayed_pair
    wait_for(lambda: _leader(g, store) is not None, 60, "a controller to lead")
    old = _leader(g, store)
    assert old is not None
    new = 1 - old
    wait_for(lambda: _roles_say(g, old, 1), 30, "healthz/metrics: one active, one standby")

    relays[old].cut()
    cut_at = time.time()
    (lease,) = wait_for(
        lambda: [r for r in store.audit_entries(action=LEASE_ACTION) if r.evidence["lease_epoch"] == 2],
        30,
        "the standby to take over",
    )
    took = lease.at.timestamp() - cut_at
    print(f"controller {new} took over {took:.2f}s after controller {old} lost the database")
    assert took <= 2 * CYCLE_S, f"the standby took {took:.1f}s (two cycles: {2 * CYCLE_S:g}s)"
    assert _leader(g, store) == new
    # the old leader, alive and without its database, knows it is not active
    wait_for(lambda: _health(g, old).startswith("standby"), 15, "the old leader's /healthz: standby")
    assert _metric(g, old, "slurmguard_controller_active") == 0.0

    # something to act on, seen by both (every agent reports to each): only the new leader acts
    hot = g.cluster.node_names[-1]
    g.set_sim_profiles({hot: "thermal_throttle"})
    (comment,) = wait_for(
        lambda: store.audit_entries(action="comment", node=hot), 60, "the pending-verification comment"
    )
    assert comment.evidence["lease_epoch"] == 2
    relays[old].restore()  # the database back: the old leader stays standby
    time.sleep(6 * RETRY_S + CYCLE_S)
    assert _roles_say(g, new, 2)
    assert [r.evidence["lease_epoch"] for r in store.audit_entries(action=LEASE_ACTION)] == [1, 2]
    for e in store.audit_entries(action=SLURM_ACTIONS):
        assert e.evidence["lease_epoch"] == 2 and not e.evidence.get("recorded_late"), e
    assert store.open_intents() == []
    log = g.cluster.service_log(g.controller_service(old)).read_text(errors="replace")
    assert "lease lost (epoch 1)" in log and "action comment" not in log, "the cut-off leader acted"
    assert len(store.audit_entries(action="comment", node=hot)) == 1
