"""Running external commands: shell=False, resolved paths, timeouts, counted failures.

Everything slurmguard runs (scontrol, sbatch, sinfo, nvidia-smi, site hooks)
goes through a CommandRunner so that a hung or failing command is a typed event
with the command line and stderr, never a hang of the daemon.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from slurmguard.errors import SlurmguardError


class CommandError(SlurmguardError):
    """A command failed (non-zero exit), could not start, or timed out."""

    def __init__(
        self,
        argv: Sequence[str],
        message: str,
        *,
        returncode: int | None = None,
        stderr: str = "",
        timed_out: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.timed_out = timed_out
        super().__init__(message)


class CommandNotFound(CommandError):
    pass


class CommandTimeout(CommandError):
    pass


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult: ...


def resolve(program: str, search_path: str | None = None) -> str:
    """Absolute path of a program, or CommandNotFound naming it."""
    if os.path.isabs(program):
        if os.access(program, os.X_OK):
            return program
        raise CommandNotFound([program], f"{program}: not found or not executable")
    found = shutil.which(program, path=search_path)
    if found is None:
        raise CommandNotFound([program], f"{program}: not found on PATH")
    return found


@dataclass
class SubprocessRunner:
    """The real runner. `failures` counts failed runs per program name."""

    extra_env: Mapping[str, str] = field(default_factory=dict)
    search_path: str | None = None
    failures: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> CommandResult:
        if not argv:
            raise ValueError("empty command")
        prog = os.path.basename(argv[0])
        try:
            exe = resolve(argv[0], self.search_path)
        except CommandNotFound:
            self._count(prog)
            raise
        full = [exe, *argv[1:]]
        run_env = dict(os.environ)
        run_env.update(self.extra_env)
        if env:
            run_env.update(env)
        try:
            proc = subprocess.run(
                full,
                shell=False,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=run_env,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            self._count(prog)
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            raise CommandTimeout(
                full, f"{' '.join(full)}: timed out after {timeout:g}s", stderr=err, timed_out=True
            ) from None
        except OSError as exc:
            self._count(prog)
            raise CommandError(full, f"{' '.join(full)}: cannot run: {exc}") from None
        result = CommandResult(tuple(full), proc.returncode, proc.stdout, proc.stderr)
        if check and proc.returncode != 0:
            self._count(prog)
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            msg = detail[-1] if detail else f"exit status {proc.returncode}"
            raise CommandError(
                full, f"{' '.join(full)}: {msg}", returncode=proc.returncode, stderr=proc.stderr
            )
        return result

    def _count(self, prog: str) -> None:
        with self._lock:
            self.failures[prog] += 1
