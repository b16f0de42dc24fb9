"""Leader election for controllers sharing one PostgreSQL database.

Exactly one controller acts: the one holding a session-level advisory lock
(LOCK_KEY) on a connection of its own. PostgreSQL releases the lock when that
session ends: at once when the holder's process dies (its socket closes), and
within `timeout_s` when its host or network goes silent (the session's TCP
keepalives, set here, make the server drop it). A standby tries to take the
lock every `retry_s`, so it takes over within about retry_s of a killed leader
and timeout_s + retry_s of a vanished one.

Fencing: every acquisition appends a `lease` row to the audit log with the next
epoch (one more than the last; written while holding the lock, so epochs never
repeat). Before every Slurm action the executor calls `fence()`: it checks on
the lease's own connection that the lock is still this session's and that no
newer epoch was written, and returns {"lease_epoch": n} for the action's audit
evidence. A leader that lost its session (the database restarted, the network
dropped it) fails that check and stops acting (NotLeader) even before it
notices on its next `hold()`; an old leader coming back finds the lock taken and
a newer epoch, and stays standby.

With SQLite there is one controller per database file; no lease is used.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from slurmguard.slurm.errors import SlurmError
from slurmguard.store import AuditOutcome, Store

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("slurmguard.controller.lease")

LOCK_KEY = 0x53_47_4C_45_41_53_45  # "SGLEASE": the advisory lock every slurmguard controller takes
LEASE_ACTION = "lease"


class NotLeader(SlurmError):
    """This controller does not hold the lease (any more): it must not act."""


def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    """The controller lease on `store`'s PostgreSQL database.

    retry_s: seconds between a standby's attempts (controller.lease_retry_s);
    timeout_s: seconds the server waits on a silent leader's session before it
    releases the lease (controller.lease_timeout_s)."""

    def __init__(self, store: Store, *, timeout_s: float, holder: str | None = None) -> None:
        if store.engine.url.get_backend_name() != "postgresql":
            raise ValueError("a controller lease needs a PostgreSQL database")
        self.store = store
        self.timeout_s = timeout_s
        self.holder = holder or holder_name()
        self.epoch: int | None = None
        self._conn: psycopg.Connection | None = None

    @property
    def held(self) -> bool:
        return self.epoch is not None

    # ------------------------------------------------------------ session
    def _connect(self) -> psycopg.Connection:
        import psycopg

        u = self.store.engine.url
        idle = max(1, int(self.timeout_s / 3))
        conn = psycopg.connect(
            host=u.host,
            port=u.port,
            user=u.username,
            password=u.password,
            dbname=u.database,
            autocommit=True,
            connect_timeout=max(2, int(self.timeout_s)),
            keepalives=1,
            keepalives_idle=idle,
            keepalives_interval=idle,
            keepalives_count=2,
            application_name=f"slurmguard lease {self.holder}"[:63],
        )
        # the server's side of the same bound: it drops a silent leader's session
        # (and with it the lock) after about timeout_s
        conn.execute(f"SET tcp_keepalives_idle = {idle}")
        conn.execute(f"SET tcp_keepalives_interval = {idle}")
        conn.execute("SET tcp_keepalives_count = 2")
        conn.execute(f"SET tcp_user_timeout = {int(self.timeout_s * 1000)}")
        return conn

    def _drop(self, why: str) -> None:
        if self.epoch is not None:
            log.error("lease lost (epoch %d): %s; not acting", self.epoch, why)
        self.epoch = None
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - the session is being thrown away
                pass
        self._conn = None

    def _lock_is_ours(self) -> bool:
        assert self._conn is not None, "called with a session open"
        row = self._conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND pid = pg_backend_pid() AND ((classid::bigint << 32) | objid::bigint) = %s",
            (LOCK_KEY,),
        ).fetchone()
        return bool(row and row[0])

    # ------------------------------------------------------------ API
    def hold(self) -> bool:
        """Take the lease if free, or confirm it is still ours; True while this
        controller may act. Never raises for a database problem (it is a reason
        to stand by, logged once)."""
        try:
            if self._conn is None:
                self._conn = self._connect()
            if self.epoch is not None:
                if not self._lock_is_ours():
                    self._drop("the advisory lock is no longer this session's")
                    return False
                if self._last_epoch() != self.epoch:
                    self._drop("a newer epoch was written")
                    return False
                return True
            row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()
            if not (row and row[0]):
                return False
            self.epoch = self._last_epoch() + 1
            self.store.audit(
                LEASE_ACTION,
                actor="slurmguard",
                reason=f"active controller {self.holder}",
                outcome=AuditOutcome.OK,
                evidence={"lease_epoch": self.epoch, "holder": self.holder},
            )
            log.warning("this controller is now active (lease epoch %d)", self.epoch)
            return True
        except Exception as exc:  # noqa: BLE001 - database trouble: stand by, try again later
            self._drop(f"{type(exc).__name__}: {exc}".splitlines()[0])
            return False

    def fence(self) -> dict:
        """Before an action: {"lease_epoch": n} for its audit row, or NotLeader."""
        if self.epoch is None:
            raise NotLeader("this controller is standby (it does not hold the lease)")
        try:
            ours = self._lock_is_ours() and self._last_epoch() == self.epoch
        except Exception as exc:  # noqa: BLE001 - cannot prove we lead: do not act
            self._drop(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise NotLeader("lease session lost; not acting") from None
        if not ours:
            old = self.epoch
            self._drop("fenced by a newer leader")
            raise NotLeader(f"lease epoch {old} is no longer current; not acting")
        return {"lease_epoch": self.epoch}

    def release(self) -> None:
        """Give the lease up now (clean shutdown): the standby need not wait."""
        if self._conn is not None and self.epoch is not None:
            try:
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))
            except Exception:  # noqa: BLE001 - closing the session releases it too
                pass
        self.epoch = None
        self._drop("released")

    def _last_epoch(self) -> int:
        rows = self.store.audit_entries(action=LEASE_ACTION, limit=1)
        return int(rows[-1].evidence.get("lease_epoch", 0)) if rows else 0
