"""An in-memory SlurmClient with the same ownership rules as the real backend.

For unit tests of the controller, sweeps and triage logic that must not need a
cluster. Integration tests use the real cluster (slurmguard_dev.devcluster).
Semantics follow Slurm: DRAIN is a flag on top of the base state, a node
running jobs keeps ALLOCATED while draining, requeue sends a job back to
PENDING with a restart counted, reservations are MAINT/IGNORE_JOBS.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurmguard.clock import Clock, SystemClock
from slurmguard.slurm import validate
from slurmguard.slurm.errors import NotOurs, SlurmError, SlurmUnavailable, UnknownJob, UnknownNode
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo, is_ours


class FakeSlurm:
    def __init__(
        self,
        nodes: Iterable[str] = ("node1", "node2", "node3", "node4"),
        *,
        partition: str = "debug",
        clock: Clock | None = None,
        features: Sequence[str] = (),
    ) -> None:
        self.clock = clock or SystemClock()
        self._nodes: dict[str, NodeInfo] = {
            n: NodeInfo(name=n, state="IDLE", partitions=(partition,), features=tuple(features), cpus=8)
            for n in nodes
        }
        self._jobs: dict[int, JobInfo] = {}
        self._resv: dict[str, ReservationInfo] = {}
        self._next_job = 1000
        self.available = True
        self.calls: list[tuple[Any, ...]] = []
        self.reboots: list[tuple[str, str, str]] = []
        self.signals: list[tuple[int, str]] = []
        self.scripts: dict[int, str] = {}

    # ------------------------------------------------------------ test helpers
    def _check(self) -> None:
        if not self.available:
            raise SlurmUnavailable("slurmctld unreachable (fake)")

    def admin_drain(self, node: str, reason: str) -> None:
        """Drain as an admin would: a reason without the slurmguard prefix."""
        n = self._get(node)
        self._nodes[node] = replace(n, flags=n.flags | {"DRAIN"}, reason=reason, reason_user="admin")

    def set_admin_comment(self, node: str, text: str) -> None:
        self._nodes[node] = replace(self._get(node), comment=text)

    def start_job(
        self,
        nodes: Sequence[str],
        *,
        name: str = "train",
        user: str = "alice",
        job_id: int | None = None,
        comment: str | None = None,
    ) -> int:
        """Place a RUNNING job on nodes (what the scheduler would do)."""
        self._check()
        jid = job_id or self._new_id()
        restarts = self._jobs[jid].restarts if jid in self._jobs else 0  # a requeued job restarting
        self._jobs[jid] = JobInfo(
            job_id=jid,
            name=name,
            user=user,
            state="RUNNING",
            partition=self._get(nodes[0]).partitions[0],
            nodes=tuple(nodes),
            num_nodes=len(nodes),
            start_time=self.clock.now(),
            restarts=restarts,
            comment=comment,
        )
        self._refresh_alloc()
        return jid

    def finish_job(self, job_id: int, state: str = "COMPLETED") -> None:
        self._jobs[job_id] = replace(self._job(job_id), state=state)
        self._refresh_alloc()

    def suspend_job(self, job_id: int) -> None:
        """`scontrol suspend`: the job keeps its nodes, its processes are stopped."""
        self._jobs[job_id] = replace(self._job(job_id), state="SUSPENDED", resumed_at=None)

    def resume_job(self, job_id: int) -> None:
        """`scontrol resume`: Slurm's suspend_time becomes the resume time."""
        self._jobs[job_id] = replace(self._job(job_id), state="RUNNING", resumed_at=self.clock.now())

    def _new_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _get(self, node: str) -> NodeInfo:
        validate.node_name(node)
        if node not in self._nodes:
            raise UnknownNode(f"unknown node '{node}'")
        return self._nodes[node]

    def _job(self, job_id: int) -> JobInfo:
        if job_id not in self._jobs:
            raise UnknownJob(f"unknown job {job_id}")
        return self._jobs[job_id]

    def _refresh_alloc(self) -> None:
        busy: dict[str, list[int]] = {}
        for j in self._jobs.values():
            if j.state in ("RUNNING", "SUSPENDED"):
                for n in j.nodes:
                    busy.setdefault(n, []).append(j.job_id)
        for name, node in self._nodes.items():
            jobs = tuple(sorted(busy.get(name, ())))
            base = "ALLOCATED" if jobs else ("DOWN" if node.state == "DOWN" else "IDLE")
            self._nodes[name] = replace(node, jobs=jobs, state=base)

    # ------------------------------------------------------------ SlurmClient
    def version(self) -> tuple[int, int, int]:
        return (22, 5, 8)

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        self._check()
        if names is None:
            return list(self._nodes.values())
        return [self._get(n) for n in names]

    def node(self, name: str) -> NodeInfo:
        self._check()
        return self._get(name)

    def fleet(self) -> tuple[list[NodeInfo], list[JobInfo]]:
        return self.nodes(), self.jobs()

    def jobs(self, job_ids: Iterable[int] | None = None) -> list[JobInfo]:
        self._check()
        live = [
            j for j in self._jobs.values() if j.state in ("PENDING", "RUNNING", "SUSPENDED", "COMPLETING")
        ]
        if job_ids is not None:
            ids = set(job_ids)
            live = [j for j in live if j.job_id in ids]
        return live

    def job(self, job_id: int) -> JobInfo:
        self._check()
        return self._job(job_id)

    def set_comment(self, node: str, text: str) -> str:
        self._check()
        n = self._get(node)
        full = validate.reason(text)
        if n.comment and not is_ours(n.comment):
            raise NotOurs(f"node {node} has a comment slurmguard did not write")
        self._nodes[node] = replace(n, comment=full)
        self.calls.append(("comment", node, full))
        return full

    def clear_comment(self, node: str) -> None:
        self._check()
        n = self._get(node)
        if n.comment and not is_ours(n.comment):
            raise NotOurs(f"node {node} has a comment slurmguard did not write")
        self._nodes[node] = replace(n, comment=None)
        self.calls.append(("clear_comment", node))

    def drain(self, node: str, reason: str) -> str:
        self._check()
        n = self._get(node)
        full = validate.reason(reason)
        if n.drained_by_others:
            raise NotOurs(f"node {node} is drained by someone else; slurmguard does not re-reason it")
        self._nodes[node] = replace(
            n, flags=n.flags | {"DRAIN"}, reason=full, reason_user="root", reason_time=self.clock.now()
        )
        self.calls.append(("drain", node, full))
        return full

    def resume(self, node: str) -> None:
        self._check()
        n = self._get(node)
        if not (n.drained or n.down):
            return
        if not is_ours(n.reason):
            raise NotOurs(f"node {node} was taken out by someone else; slurmguard will not resume it")
        self._nodes[node] = replace(
            n,
            flags=n.flags - {"DRAIN"},
            reason=None,
            reason_user=None,
            state="IDLE" if n.state == "DOWN" else n.state,
        )
        self._refresh_alloc()
        self.calls.append(("resume", node))

    def reservations(self) -> list[ReservationInfo]:
        self._check()
        return list(self._resv.values())

    def create_reservation(
        self, name: str, nodes: Sequence[str], *, duration_min: int, users: Sequence[str] = ("root",)
    ) -> None:
        self._check()
        validate.reservation_name(name)
        for n in nodes:
            self._get(n)
        if name in self._resv:
            raise SlurmError(f"reservation {name} already exists")
        now = self.clock.now()
        self._resv[name] = ReservationInfo(
            name=name,
            nodes=tuple(nodes),
            flags=frozenset({"MAINT", "IGNORE_JOBS"}),
            users=tuple(users),
            start_time=now,
            end_time=now + 60 * duration_min,
        )
        self.calls.append(("reservation_create", name, tuple(nodes)))

    def delete_reservation(self, name: str) -> None:
        self._check()
        if self._resv.pop(name, None) is None:
            raise SlurmError(f"reservation {name} not found")
        self.calls.append(("reservation_delete", name))

    def submit(
        self,
        script: str | Path,
        *,
        job_name: str | None = None,
        nodelist: Sequence[str] = (),
        reservation: str | None = None,
        time_limit_min: int | None = None,
        partition: str | None = None,
        output: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> int:
        self._check()
        for n in nodelist:
            self._get(n)
        if reservation is not None and reservation not in self._resv:
            raise SlurmError(f"reservation {reservation} not found")
        jid = self._new_id()
        self._jobs[jid] = JobInfo(
            job_id=jid,
            name=job_name or "sbatch",
            user="root",
            state="PENDING",
            partition=partition or "debug",
            nodes=tuple(nodelist),
            num_nodes=len(nodelist),
            time_limit_min=time_limit_min,
            reservation=reservation,
        )
        self.scripts[jid] = str(script)
        self.calls.append(("submit", jid, tuple(nodelist), reservation))
        return jid

    def requeue(self, job_id: int, *, restart_now: bool = True, settle_s: float = 10.0) -> None:
        self._check()
        j = self._job(job_id)
        self._jobs[job_id] = replace(j, state="PENDING", nodes=(), restarts=j.restarts + 1)
        self._refresh_alloc()
        self.calls.append(("requeue", job_id))

    def release_requeue_hold(self, job_id: int) -> str:
        return self.job(job_id).state

    def signal(self, job_id: int, signal: str, *, batch_only: bool = True) -> None:
        self._check()
        self._job(job_id)
        validate.signal_name(signal)
        self.signals.append((job_id, signal))
        self.calls.append(("signal", job_id, signal))

    def cancel(self, job_id: int) -> None:
        self._check()
        self.finish_job(job_id, "CANCELLED")

    def reboot(self, node: str, reason: str, *, next_state: str = "resume", asap: bool = True) -> str:
        self._check()
        n = self._get(node)
        full = validate.reason(reason)
        if n.drained_by_others:
            raise NotOurs(f"node {node} was taken out by someone else; slurmguard will not reboot it")
        self.reboots.append((node, full, next_state))
        self._nodes[node] = replace(n, flags=n.flags | {"REBOOT_REQUESTED"})
        self.calls.append(("reboot", node, full, next_state))
        return full
