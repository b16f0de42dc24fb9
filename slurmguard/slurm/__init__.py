"""Slurm access behind a protocol: the command-line backend and a fake."""

from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.errors import (
    InvalidArgument,
    NotOurs,
    SlurmCommandError,
    SlurmError,
    SlurmUnavailable,
    UnknownJob,
    UnknownNode,
)
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo

__all__ = [
    "SlurmClient",
    "NodeInfo",
    "JobInfo",
    "ReservationInfo",
    "SlurmError",
    "SlurmUnavailable",
    "SlurmCommandError",
    "UnknownNode",
    "UnknownJob",
    "NotOurs",
    "InvalidArgument",
]
