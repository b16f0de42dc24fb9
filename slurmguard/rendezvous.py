"""How the ranks of a job find each other: the one rendezvous every
slurmguard job uses (sweeps, example workloads, the dev-cluster jobs, the
hook's scenario job).

torch's usual ``MASTER_PORT`` rendezvous needs a port chosen before rank 0
starts, and nothing holds it in between: on a node shared by other jobs (or
on the dev cluster, where every node is this host) the port can be taken
between submission, or the batch script, and rank 0 binding it. Rank 0 then
fails ``init_process_group`` and its peers wait for it until their timeout.

Here rank 0 never needs a chosen port to be free for its store:

- rank 0 starts the TCPStore on port 0 (the kernel picks a free port as it
  binds: no window in which another process can take it);
- rank 0 publishes that port through a *beacon*: a small listener on the
  first free port of a fixed sequence of candidates derived from the job
  (``candidates()``), answering every connection with one line
  ``slurmguard-rdzv <id> <store port>``;
- the other ranks walk the same candidates (connection refused: next; no
  answer within PROBE_S: next; an answer with another id: another job's
  beacon, next) until they read their own id, then join the store.

The id (``rdzv_id()``) names one rendezvous: the Slurm job, step and restart
count, the cluster and the srun that launched the step, so a requeued job,
another step, or the same job id on another cluster sharing the host never
joins a foreign store. The
candidates lie below Linux's default ephemeral range (32768-60999), where
the kernel never hands out a port on its own; MASTER_PORT, when set, is
tried first. The beacon closes once the process group is up (or after the
rendezvous timeout).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

#: candidate beacon ports: PORT_LOW + offset, offset in [0, PORT_SPAN)
PORT_LOW = 20000
PORT_SPAN = 12000
#: beacon ports rank 0 tries before giving up (each taken one: the next)
CANDIDATES = 16
#: seconds a peer waits for a beacon's answer before trying the next port
PROBE_S = 2.0
#: seconds between a peer's passes over the candidates while rank 0 starts
RETRY_S = 0.2
_STRIDE = 2477  # prime, so successive candidates spread over the span
_BANNER = "slurmguard-rdzv"


class RendezvousError(RuntimeError):
    """The ranks could not meet: which rank, which id, which ports, how long."""


def rdzv_id(env: Mapping[str, str] | None = None) -> str:
    """The identity of this rendezvous: SLURMGUARD_RDZV_ID when set, else the
    Slurm job, step, restart count, cluster and launching srun, else (no
    Slurm) MASTER_ADDR:MASTER_PORT."""
    e = os.environ if env is None else env
    if e.get("SLURMGUARD_RDZV_ID"):
        return e["SLURMGUARD_RDZV_ID"]
    if e.get("SLURM_JOB_ID"):
        ident = "slurm-{}.{}.{}".format(
            e["SLURM_JOB_ID"], e.get("SLURM_STEP_ID", "0"), e.get("SLURM_RESTART_COUNT", "0")
        )
        # job ids repeat across clusters (every dev cluster starts at 1, several
        # share one host): the cluster, and the srun that launched the step (its
        # host and the port it holds while the step lives), make the id unique
        if e.get("SLURM_CLUSTER_NAME"):
            ident += "-" + e["SLURM_CLUSTER_NAME"]
        if e.get("SLURM_SRUN_COMM_HOST") and e.get("SLURM_SRUN_COMM_PORT"):
            ident += "@{}:{}".format(e["SLURM_SRUN_COMM_HOST"], e["SLURM_SRUN_COMM_PORT"])
        return "".join(c for c in ident if not c.isspace())
    return "local-{}:{}".format(e.get("MASTER_ADDR", "127.0.0.1"), e.get("MASTER_PORT", "0"))


def candidates(ident: str, env: Mapping[str, str] | None = None) -> list[int]:
    """Beacon ports in the order rank 0 tries them and peers probe them:
    MASTER_PORT first when set, then ports derived from the id."""
    e = os.environ if env is None else env
    offset = int.from_bytes(hashlib.sha256(ident.encode()).digest()[:4], "big") % PORT_SPAN
    ports = [PORT_LOW + (offset + k * _STRIDE) % PORT_SPAN for k in range(CANDIDATES)]
    first = e.get("MASTER_PORT", "").strip()
    if first.isdigit() and 0 < int(first) < 65536:
        ports = [int(first)] + [p for p in ports if p != int(first)][: CANDIDATES - 1]
    return ports


class _Beacon:
    """Rank 0's answer to peers looking for its store (a daemon thread)."""

    def __init__(self, ident: str, store_port: int, ports: list[int], deadline: float) -> None:
        self.line = f"{_BANNER} {ident} {store_port}\n".encode()
        self.deadline = deadline
        self.sock: socket.socket | None = None
        tried = []
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("", port))
                s.listen(64)
            except OSError as exc:
                s.close()
                tried.append(f"{port} ({exc.strerror})")
                continue
            self.sock, self.port = s, port
            break
        if self.sock is None:
            raise RendezvousError(
                f"rendezvous {ident}: rank 0 found no free beacon port: " + ", ".join(tried)
            )
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slurmguard-rdzv", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self.sock
        if sock is None:  # no port was free: nothing to serve
            return
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            try:
                conn, _ = sock.accept()
            except OSError:  # timeout: look at the stop flag again
                continue
            try:
                conn.settimeout(PROBE_S)
                conn.sendall(self.line)
            except OSError:
                pass
            finally:
                conn.close()
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _ask(addr: str, port: int, ident: str) -> int | None:
    """The store port rank 0's beacon on `port` announces for `ident`, or None."""
    try:
        with socket.create_connection((addr, port), timeout=PROBE_S) as s:
            s.settimeout(PROBE_S)
            data = b""
            while not data.endswith(b"\n") and len(data) < 512:
                chunk = s.recv(512)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    parts = data.decode(errors="replace").split()
    if len(parts) == 3 and parts[0] == _BANNER and parts[1] == ident and parts[2].isdigit():
        return int(parts[2])
    return None


class Rendezvous:
    """The store of one rendezvous; on rank 0, with its beacon (close() it
    once every rank has joined; it closes itself after the timeout)."""

    def __init__(self, store: Any, beacon: _Beacon | None) -> None:
        self.store = store
        self._beacon = beacon

    def close(self) -> None:
        if self._beacon is not None:
            self._beacon.close()
            self._beacon = None


def connect(
    rank: int,
    *,
    world: int | None = None,
    addr: str | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Rendezvous:
    """Rank 0 starts the store and its beacon; the others find it and join.

    addr: rank 0's address as the peers reach it (default MASTER_ADDR, else
    127.0.0.1). timeout_s: how long the peers look for rank 0 (s), also the
    store's timeout. Raises RendezvousError when rank 0 cannot publish its
    store or a peer finds none in time.
    """
    import torch.distributed as dist

    e = os.environ if env is None else env
    addr = addr or e.get("MASTER_ADDR") or "127.0.0.1"
    ident = rdzv_id(e)
    ports = candidates(ident, e)
    timeout = datetime.timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        store = dist.TCPStore(addr, 0, world, True, timeout=timeout, wait_for_workers=False)
        return Rendezvous(store, _Beacon(ident, store.port, ports, deadline))
    while True:
        for port in ports:
            store_port = _ask(addr, port, ident)
            if store_port is not None:
                return Rendezvous(dist.TCPStore(addr, store_port, world, False, timeout=timeout), None)
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rendezvous {ident}: rank {rank} found no beacon of rank 0 at {addr} on ports "
                f"{ports[0]}..(+{len(ports) - 1}) within {timeout_s:g} s"
            )
        time.sleep(RETRY_S)


def init_process_group(
    backend: str, rank: int, world: int, *, timeout_s: float = 120.0, env: Mapping[str, str] | None = None
) -> None:
    """torch.distributed.init_process_group over connect()'s store; the
    beacon is closed once every rank is in the group."""
    import torch.distributed as dist

    rdzv = connect(rank, world=world, timeout_s=timeout_s, env=env)
    try:
        dist.init_process_group(
            backend,
            store=rdzv.store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    finally:
        rdzv.close()
