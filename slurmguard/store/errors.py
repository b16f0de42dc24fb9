"""Errors of the storage layer, all one-line SlurmguardErrors."""

from __future__ import annotations

from slurmguard.errors import SlurmguardError


class StoreError(SlurmguardError):
    """A storage problem the user can act on (bad URL, unreachable server, ...)."""


class DatabaseUnavailable(StoreError):
    """The database server cannot be reached or refuses the connection."""


class SchemaNotCurrent(StoreError):
    """The database is not migrated to the revision this code expects."""


class MigrationsMissing(StoreError):
    """The Alembic scripts under sql/ cannot be found."""


class NodeNotRegistered(StoreError):
    """A node name that is not in the nodes table."""


class NotFound(StoreError):
    """A row id (sweep, incident, triage action) that does not exist."""


class IllegalTransition(StoreError):
    """A lifecycle change that is not allowed without an admin override."""


class StaleState(IllegalTransition):
    """The node's state is not the one the caller expected (someone moved it)."""


class InvalidValue(StoreError):
    """A value that cannot be stored (non-UTC-able time, non-JSON evidence, bad enum)."""
