"""Typed errors shared across slurmguard.

A user mistake (bad file, unknown node, bad option) is a SlurmguardError and is
printed as one line by the CLI; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
from pathlib import Path


class SlurmguardError(Exception):
    """Base for errors reported to the user without a traceback."""

    exit_code = 2


class ConfigError(SlurmguardError):
    """A policy file or option is invalid. The message names file, key and line."""


class InputError(SlurmguardError):
    """An input file (CSV, trace, ring) is malformed. The message names the file."""


def read_user_text(
    path: str | os.PathLike[str],
    what: str,
    error: type[SlurmguardError] = InputError,
    *,
    replace_undecodable: bool = False,
) -> str:
    """Text (UTF-8) of a file a user named. A missing or unreadable file, or
    one that is not UTF-8 (unless replace_undecodable), raises `error` naming
    the file and what it is ("step file", "metadata file", ...), never an
    OSError traceback."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8", errors="replace" if replace_undecodable else "strict")
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except OSError as exc:
        raise error(f"{p}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{p}: cannot read {what}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
