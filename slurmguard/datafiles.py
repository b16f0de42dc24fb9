"""Where slurmguard's runtime files are: the one lookup every caller uses.

Shipped with the package (a wheel and a source checkout alike, see
`slurmguard._data`), found through importlib.resources:

* `sql/` (Alembic env and migrations): `migrations_dir()`
* `sweeps/` (the sweep workloads and their sbatch templates): `sweep_dir()`
* `prolog_epilog/` (the Slurm Prolog/Epilog wrappers): `prolog_epilog_dir()`
* `slurmguard/hook/site/` (the torch hook's sitecustomize): `torch_hook_site()`

Only in a source checkout (development tools that compile C or read test
fixtures): `checkout_path()`.

Callers get real directories, because Alembic, sbatch and slurmd need paths on
disk; a zipped install is refused with a clear error.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from slurmguard.errors import SlurmguardError


class DataFilesMissing(SlurmguardError):
    """A runtime file is not where this installation should have it."""


def _on_disk(package: str, *parts: str) -> Path:
    node = resources.files(package).joinpath(*parts)
    if not isinstance(node, Path):
        raise DataFilesMissing(
            f"{package}/{'/'.join(parts)}: slurmguard must be installed as files on disk "
            f"(not zipped): Alembic, sbatch and slurmd need real paths"
        )
    # a checkout reaches sql/ etc. through the symlinks in slurmguard/_data:
    # report the real location, as paths written into scripts and errors
    return node.resolve()


def data_path(*parts: str) -> Path:
    """A file or directory shipped in `slurmguard._data` (it may not exist: callers
    check and name what they expected there)."""
    return _on_disk("slurmguard._data", *parts)


def migrations_dir() -> Path:
    """The Alembic script directory (`sql/migrations`)."""
    return data_path("sql", "migrations")


def sweep_dir() -> Path:
    """The sweep workloads (`sweeps/`: node_sweep.py, pair_sweep.py, templates/)."""
    return data_path("sweeps")


def prolog_epilog_dir() -> Path:
    """The Slurm Prolog/Epilog wrapper scripts (`prolog_epilog/`)."""
    return data_path("prolog_epilog")


def torch_hook_site() -> Path:
    """The directory the SPANK plugin's `torch_hook=` puts on a guarded job's PYTHONPATH."""
    return _on_disk("slurmguard.hook", "site")


def checkout_root() -> Path:
    """The directory holding the `slurmguard/` package: a source checkout's root, or
    site-packages in an installed copy (where `checkout_path` finds nothing)."""
    return Path(__file__).resolve().parent.parent


def checkout_path(*parts: str, what: str) -> Path:
    """A path that only a source checkout has (spank_plugin/, tests/fixtures/);
    `what` names the command that needs it, for the error."""
    path = checkout_root().joinpath(*parts)
    if not path.exists():
        raise DataFilesMissing(
            f"{what} needs a slurmguard source checkout: {path} not found "
            f"(this slurmguard is installed at {checkout_root()})"
        )
    return path
