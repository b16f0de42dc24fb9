"""What slurmguard knows about nodes, jobs and reservations, backend-independent."""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmguard import REASON_PREFIX

#: Slurm job states after which a job runs no more (squeue may still list it for MinJobAge)
FINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "TIMEOUT",
        "CANCELLED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)


def is_ours(text: str | None) -> bool:
    """True if a reason/comment was written by slurmguard (stable prefix)."""
    return text is not None and text.lstrip().startswith(REASON_PREFIX)


@dataclass(frozen=True)
class NodeInfo:
    """One node. `state` is the base state in upper case (IDLE, ALLOCATED,
    MIXED, DOWN, ...); `flags` the extra flags (DRAIN, MAINT, REBOOT_REQUESTED,
    RESERVED, ...). `reason_time` and `boot_time` are Unix seconds or None."""

    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str | None = None
    reason_user: str | None = None
    reason_time: float | None = None
    comment: str | None = None
    partitions: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    gres: str | None = None
    cpus: int = 0
    jobs: tuple[int, ...] = field(default=())
    boot_time: float | None = None

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.state in ("DRAINED", "DRAINING")

    @property
    def down(self) -> bool:
        return self.state == "DOWN"

    @property
    def drained_by_us(self) -> bool:
        return (self.drained or self.down) and is_ours(self.reason)

    @property
    def drained_by_others(self) -> bool:
        """Out of service with a reason slurmguard did not write."""
        return (self.drained or self.down) and not is_ours(self.reason)

    @property
    def idle(self) -> bool:
        """No job running (IDLE base state), whatever the drain flags."""
        return self.state == "IDLE" and not self.jobs

    @property
    def state_text(self) -> str:
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    user: str
    state: str
    partition: str
    nodes: tuple[str, ...] = ()
    num_nodes: int = 0
    start_time: float | None = None
    time_limit_min: int | None = None
    reservation: str | None = None
    comment: str | None = None
    restarts: int = 0
    batch_host: str | None = None
    eligible_time: float | None = None
    """Unix seconds from which a pending job may start (None: unknown/none)."""
    resumed_at: float | None = None
    """Unix seconds when Slurm last resumed the job after suspending it (`scontrol
    suspend`, gang scheduling, preemption by suspension); None while it runs
    without ever having been suspended, and while it is suspended."""

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def base_state(self) -> str:
        """The state without what Slurm appends ("CANCELLED by 0" -> "CANCELLED"),
        upper case; "" when Slurm gave none."""
        return self.state.split()[0].upper() if self.state.strip() else ""

    @property
    def ended(self) -> bool:
        """In a final state (FINAL_JOB_STATES, judged on base_state)."""
        return self.base_state in FINAL_JOB_STATES


@dataclass(frozen=True)
class ReservationInfo:
    name: str
    nodes: tuple[str, ...]
    flags: frozenset[str]
    users: tuple[str, ...] = ()
    start_time: float | None = None
    end_time: float | None = None
