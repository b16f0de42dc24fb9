"""The SlurmClient protocol: every Slurm operation slurmguard performs.

Ownership is part of the contract, not of the callers: every reason and
comment written starts with `slurmguard:`, and operations on a node drained
(or commented) by someone else raise NotOurs instead of touching it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo


class SlurmClient(Protocol):
    def version(self) -> tuple[int, int, int]: ...

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        """All nodes (or the named ones), with the jobs running on each."""
        ...

    def fleet(self) -> tuple[list[NodeInfo], list[JobInfo]]:
        """The whole fleet in one call: every node (with its running jobs) and
        every queued job, from one node read and one job read (sinfo + squeue,
        or GET /nodes + GET /jobs): what a control cycle needs."""
        ...

    def node(self, name: str) -> NodeInfo:
        """One node; UnknownNode if Slurm does not know it."""
        ...

    def jobs(self, job_ids: Iterable[int] | None = None) -> list[JobInfo]:
        """Jobs still in the queue (pending, running, completing)."""
        ...

    def job(self, job_id: int) -> JobInfo:
        """One job, also shortly after it ended; UnknownJob if gone."""
        ...

    def set_comment(self, node: str, text: str) -> str:
        """Set the node Comment (prefixed); NotOurs over someone else's. Returns it."""
        ...

    def clear_comment(self, node: str) -> None:
        """Clear our comment; someone else's comment is left alone (NotOurs)."""
        ...

    def drain(self, node: str, reason: str) -> str:
        """Drain with a prefixed reason; NotOurs if drained by someone else. Returns it."""
        ...

    def resume(self, node: str) -> None:
        """Resume a node we drained; NotOurs if someone else drained it."""
        ...

    def reservations(self) -> list[ReservationInfo]: ...

    def create_reservation(
        self, name: str, nodes: Sequence[str], *, duration_min: int, users: Sequence[str] = ("root",)
    ) -> None:
        """A maintenance reservation starting now (MAINT, IGNORE_JOBS)."""
        ...

    def delete_reservation(self, name: str) -> None: ...

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
        """sbatch a script (path, or text starting with #!); returns the job id."""
        ...

    def requeue(self, job_id: int, *, restart_now: bool = True, settle_s: float = 10.0) -> None:
        """Requeue; restart_now lifts Slurm's post-requeue begin-time hold (bounded wait)."""
        ...

    def release_requeue_hold(self, job_id: int) -> str:
        """Make a requeued job held by a future begin time eligible now; returns its state."""
        ...

    def signal(self, job_id: int, signal: str, *, batch_only: bool = True) -> None: ...

    def cancel(self, job_id: int) -> None: ...

    def reboot(self, node: str, reason: str, *, next_state: str = "resume", asap: bool = True) -> str:
        """`scontrol reboot`; NotOurs if drained by someone else. Returns the reason."""
        ...
