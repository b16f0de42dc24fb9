"""Where sweep jobs leave their results: a directory both the controller and the nodes see.

On a real cluster `SweepPolicy.result_dir` is on a shared filesystem; on the development
cluster every slurmd shares the host's filesystem. Layout:
``<result_dir>/<node>/sweep<id>-<kind>.json`` and ``.log`` beside it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from slurmguard.errors import ConfigError

MAX_RESULT_BYTES = 16 << 20
"""A result larger than this is not read (a runaway writer must not exhaust memory)."""


class ResultFiles(Protocol):
    def paths(self, node: str, sweep_id: int, kind: str) -> tuple[str, str]:
        """(result path, log path) for a sweep; creates the node's directory."""
        ...

    def read(self, path: str) -> bytes | None:
        """The result's bytes; None when the file does not exist."""
        ...


class LocalResultFiles:
    """ResultFiles on a mounted (shared) directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_absolute():
            raise ConfigError(f"sweeps.result_dir: expected an absolute path, got {root!r}")

    def paths(self, node: str, sweep_id: int, kind: str) -> tuple[str, str]:
        d = self.root / node
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"sweeps.result_dir: cannot create {d}: {exc.strerror or exc}") from None
        base = d / f"sweep{sweep_id}-{kind}"
        return str(base) + ".json", str(base) + ".log"

    def read(self, path: str) -> bytes | None:
        try:
            size = os.path.getsize(path)
            if size > MAX_RESULT_BYTES:
                return b"\0result larger than %d bytes" % MAX_RESULT_BYTES
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            # unreadable is not "absent": hand the parser something it rejects with the cause
            return f"\0unreadable: {exc.strerror or exc}".encode()
