"""Optional dependencies: the node install works without them, and a command that needs
one names the extra to install (one line, no traceback).

"Not installed" is simulated in a fresh interpreter by `sys.modules[name] = None`,
which makes `import name` raise ModuleNotFoundError exactly as a missing package does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from slurmguard.extras import EXTRA_OF

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _req_name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()


def test_every_optional_module_is_in_its_extra_and_not_in_the_core():
    extras = PYPROJECT["optional-dependencies"]
    core = {_req_name(r) for r in PYPROJECT["dependencies"]}
    for module, extra in EXTRA_OF.items():
        assert module in {_req_name(r) for r in extras[extra]}, (module, extra)
        assert module not in core, module


def _cli(blocked: tuple[str, ...], *argv: str, extra_code: str = "") -> subprocess.CompletedProcess:
    code = (
        f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n{extra_code}\n"
        f"from slurmguard.cli import main\nmain({list(argv)!r})\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_node_install_runs_db_upgrade_and_imports_daemons_without_any_extra(tmp_path):
    res = _cli(
        tuple(EXTRA_OF),
        "--db",
        f"sqlite:///{tmp_path}/sg.db",
        "db",
        "upgrade",
        extra_code="import slurmguard.agent.cli, slurmguard.agent.analysis, "
        "slurmguard.controller.cli, slurmguard.controller.loop, "
        "slurmguard.nodecheck.prolog",
    )
    assert res.returncode == 0, res.stderr
    assert "revision: 0002 (head)" in res.stdout


def test_command_importing_a_missing_extra_at_run_time_names_the_extra(tmp_path):
    # the what-if command reads traces with pyarrow alone (pandas stays unimported)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    (tmp_path / "m.yaml").write_text(
        "dp_size: 2\ndsp_size: 1\npp_size: 4\ntp_size: 1\nvpp_size: 1\nworld_size: 8\n"
    )
    res = _cli(("pyarrow",), "whatif", str(tmp_path / "t.parquet"), "--meta", str(tmp_path / "m.yaml"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "slurmguard: error: this command needs pyarrow, which is not installed: "
        "pip install 'slurmguard[whatif]'"
    ]


def test_a_missing_module_no_extra_provides_is_a_bug_and_keeps_its_traceback(monkeypatch):
    from slurmguard import cli

    def broken(**_kw):
        raise ModuleNotFoundError("No module named 'sqlalchemy'", name="sqlalchemy")

    monkeypatch.setattr(cli.cli, "main", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["db", "upgrade"])
