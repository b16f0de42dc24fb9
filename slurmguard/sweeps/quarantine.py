"""Names and Slurm-view checks for the reservations that hold nodes under verification.

* ``slurmguard_quarantine_<node>``: MAINT reservation of the node under test for the
  whole episode. The node is resumed *inside* it, so only jobs submitted with
  ``--reservation`` (the sweeps) can land there.
* ``slurmguard_sweep2_<node>``: short MAINT reservation of the node under test and its
  reference for one 2-node sweep (MAINT reservations may overlap, so the node stays in
  its quarantine reservation meanwhile). The reference is the reservation's other node.
"""

from __future__ import annotations

from collections.abc import Iterable

from slurmguard.slurm.models import NodeInfo, ReservationInfo

QUARANTINE_PREFIX = "slurmguard_quarantine_"
PAIR_PREFIX = "slurmguard_sweep2_"

#: Node flags that make a node unusable as a reference or as a rolling-sweep candidate.
BUSY_FLAGS = frozenset(
    {
        "DRAIN",
        "MAINT",
        "RESERVED",
        "REBOOT",
        "REBOOT_REQUESTED",
        "REBOOT_ISSUED",
        "COMPLETING",
        "POWERING_DOWN",
        "POWERED_DOWN",
        "POWER_DOWN",
        "POWERING_UP",
        "POWER_UP",
        "NOT_RESPONDING",
        "FAIL",
        "PLANNED",
        "INVALID_REG",
        "UNKNOWN",
    }
)
REBOOT_FLAGS = frozenset({"REBOOT", "REBOOT_REQUESTED", "REBOOT_ISSUED"})


def quarantine_name(node: str) -> str:
    return f"{QUARANTINE_PREFIX}{node}"


def pair_name(node: str) -> str:
    return f"{PAIR_PREFIX}{node}"


def node_of(reservation: str) -> str | None:
    """The node a slurmguard reservation is for; None for anyone else's reservation."""
    for prefix in (QUARANTINE_PREFIX, PAIR_PREFIX):
        if reservation.startswith(prefix) and len(reservation) > len(prefix):
            return reservation[len(prefix) :]
    return None


def reserved_nodes(reservations: Iterable[ReservationInfo], now: float) -> set[str]:
    """Nodes inside any reservation that is active now (or has no known window)."""
    out: set[str] = set()
    for r in reservations:
        if r.start_time is not None and r.start_time > now:
            continue
        if r.end_time is not None and r.end_time <= now:
            continue
        out.update(r.nodes)
    return out


def is_idle_in_service(n: NodeInfo) -> bool:
    """Idle and in service, whatever reservation it is in (the re-check after reserving it)."""
    return (
        n.state == "IDLE"
        and not n.jobs
        and not n.drained
        and not n.down
        and not (n.flags & (REBOOT_FLAGS | {"COMPLETING", "NOT_RESPONDING", "FAIL"}))
    )


def is_free(n: NodeInfo) -> bool:
    """Idle, in service, running nothing, no pending reboot or power transition."""
    return n.state == "IDLE" and not n.jobs and not n.drained and not n.down and not (n.flags & BUSY_FLAGS)
