"""Typed Slurm errors: each carries the command line and Slurm's own message."""

from __future__ import annotations

from collections.abc import Sequence

from slurmguard.errors import SlurmguardError


class SlurmError(SlurmguardError):
    def __init__(self, message: str, argv: Sequence[str] = (), stderr: str = "") -> None:
        self.argv = list(argv)
        self.stderr = stderr
        super().__init__(message)


class SlurmUnavailable(SlurmError):
    """slurmctld cannot be reached, or a command timed out."""


class SlurmCommandError(SlurmError):
    """A Slurm command ran and failed for another reason."""


class UnknownNode(SlurmError):
    pass


class UnknownJob(SlurmError):
    pass


class NotOurs(SlurmError):
    """Refused: the node's drain/comment was set by someone other than slurmguard."""


class InvalidArgument(SlurmError):
    """A node name, reason or other value is unsafe to put on a command line."""
