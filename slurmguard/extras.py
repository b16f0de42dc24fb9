"""Optional dependencies: which pip extra installs which module, and the error that says so.

A node install (`pip install slurmguard`: agent, prolog/epilog, controller, CLI) leaves
out what only some commands need. A command that reaches a missing one stops with one
line naming the extra, never a traceback: the CLI maps a ModuleNotFoundError through
`missing_extra` (slurmguard.cli). pyproject.toml's [project.optional-dependencies] is
the other half of this table; tests/test_install_extras.py keeps the two equal.
"""

from __future__ import annotations

from slurmguard.errors import SlurmguardError

EXTRA_OF: dict[str, str] = {
    "pandas": "whatif",  # what-if trace tables
    "pyarrow": "whatif",  # parquet traces
    "torch": "torch",  # sweep workloads, torch.distributed hook, dev training jobs
    "cvxpy": "plan",  # reference MILP of the micro-batch planner
    "highspy": "plan",
}
"""Top-level module name -> the extra of pyproject.toml that installs it."""


class MissingExtra(SlurmguardError):
    """A command needs an optional dependency that is not installed."""


def missing_extra(module: str | None, what: str) -> MissingExtra | None:
    """The error for `what` (e.g. "command 'whatif'") failing to import `module`, or
    None when `module` is not one an extra provides (then it is a bug, not a choice)."""
    top = (module or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return MissingExtra(f"{what} needs {top}, which is not installed: pip install 'slurmguard[{extra}]'")
