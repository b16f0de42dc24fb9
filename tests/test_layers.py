"""Layers point one way: the import-linter contracts of pyproject.toml hold.

The contracts (see [tool.importlinter] in pyproject.toml): no import cycle between
slurmguard's packages and top-level modules; the product never imports the development
tools (slurmguard_dev, in dev/: grimp must find that package, so the contract cannot pass
by not seeing it); the adapters (slurm, store, telemetry) import nothing above them; the
what-if analysis never imports the agent or the controller. A new import that breaks one
fails here, naming the import chain.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = (
    "import sys\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))\n"
)


def test_import_contracts_are_kept():
    # this checkout's dev/ package, whether or not slurmguard-dev is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "dev")])}
    res = subprocess.run(
        [sys.executable, "-c", RUN],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    out = res.stdout + res.stderr
    assert "the product never imports the development tools KEPT" in out, out
    assert "Contracts: 4 kept, 0 broken." in out, out
    assert res.returncode == 0, out
