"""Typed errors shared across slurmguard.

A user mistake (bad file, unknown node, bad option) is a SlurmguardError and is
printed as one line by the CLI; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SlurmguardError(Exception):
    """Base for errors reported to the user without a traceback."""

    exit_code = 2


class ConfigError(SlurmguardError):
    """A policy file or option is invalid. The message names file, key and line."""


class InputError(SlurmguardError):
    """An input file (CSV, trace, ring) is malformed. The message names the file."""
