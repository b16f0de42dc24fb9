"""Commands of other distributions: the `slurmguard.commands` entry-point group (slurmguard/cli.py).

The development tools (dev/, slurmguard-dev) add `bench`, `devcluster` and `demo` this way;
the product never imports them. Here a distribution made up for the test registers its
commands through real package metadata on the subprocess's path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmguard import cli as cli_mod

PLUGIN = '''import click


@click.command("hello")
def hello():
    """Say hello from a plugin."""
    click.echo("hello from sg-test-plugin")
'''


@pytest.fixture()
def plugin_path(tmp_path: Path) -> Path:
    (tmp_path / "sg_test_plugin.py").write_text(PLUGIN)
    meta = tmp_path / "sg_test_plugin-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: sg-test-plugin\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(
        "[slurmguard.commands]\n"
        "hello = sg_test_plugin:hello\n"
        "node = sg_test_plugin:hello\n"  # must not replace the product's `node`
        "broken = sg_test_no_such_module:cmd\n"
    )
    return tmp_path


def _run(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "slurmguard.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_a_plugin_command_runs_and_is_listed(plugin_path):
    res = _run(plugin_path, "hello")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "hello from sg-test-plugin\n"
    listing = _run(plugin_path, "--help")
    assert listing.returncode == 0, listing.stderr
    assert "hello       Say hello from a plugin." in listing.stdout
    # a plugin that cannot load is listed as such; the listing itself still works
    assert "broken      (unavailable:" in listing.stdout


def test_a_plugin_cannot_replace_a_product_command(plugin_path):
    res = _run(plugin_path, "node", "--help")
    assert res.returncode == 0, res.stderr
    assert "Drain, resume or inspect one node." in res.stdout
    assert "drain " in res.stdout and "plugin" not in res.stdout


def test_a_plugin_whose_module_is_missing_is_one_line(plugin_path):
    res = _run(plugin_path, "broken")
    assert res.returncode == 1
    assert res.stderr.strip() == (
        "Error: command 'broken' is unavailable: module 'sg_test_no_such_module' is not installed"
    )


@pytest.mark.parametrize("name", ["bench", "devcluster", "demo"])
def test_dev_commands_without_the_dev_tools_say_how_to_install_them(monkeypatch, name):
    monkeypatch.setattr(cli_mod, "plugin_commands", lambda: {})
    res = CliRunner().invoke(cli_mod.cli, [name, "--help"])
    assert res.exit_code == 2
    assert (
        f"command '{name}' comes with slurmguard-dev, which is not installed: the development "
        "tools (local cluster, demo, benchmarks); from a source checkout: pip install ./dev"
    ) in res.output


def test_the_dev_tools_register_their_commands_in_the_group():
    # this checkout's dev/pyproject.toml is what `pip install ./dev` registers
    import tomllib

    dev = tomllib.loads((Path(cli_mod.__file__).resolve().parents[1] / "dev" / "pyproject.toml").read_text())
    eps = dev["project"]["entry-points"][cli_mod.PLUGIN_GROUP]
    assert eps == {
        "bench": "slurmguard_dev.bench:bench",
        "devcluster": "slurmguard_dev.devcluster.cli:devcluster",
        "demo": "slurmguard_dev.demo:demo",
    }
    assert set(eps) == set(cli_mod.ELSEWHERE) and not set(eps) & set(cli_mod.COMMANDS)
    for target in eps.values():  # each names a click command that exists
        mod, attr = target.split(":")
        assert getattr(__import__(mod, fromlist=[attr]), attr).name == next(
            k for k, v in eps.items() if v == target
        )


def test_devcluster_env_exports_the_guard_policy_so_the_admin_commands_read_its_database(tmp_path):
    """`eval $(slurmguard devcluster env)` after `up --guard`: SLURM_CONF and
    SLURMGUARD_POLICY, so that `slurmguard incidents` reads the cluster's
    database rather than saying it is not initialised; without the guard, SLURM_CONF only."""
    from slurmguard_dev.devcluster.cli import devcluster

    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "slurm.conf").write_text("")
    res = CliRunner().invoke(devcluster, ["env", "--state-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == [f"export SLURM_CONF={tmp_path}/etc/slurm.conf"]
    (tmp_path / "policies.yaml").write_text("{}")
    res = CliRunner().invoke(devcluster, ["env", "--state-dir", str(tmp_path)])
    assert res.output.splitlines()[1] == f"export SLURMGUARD_POLICY={tmp_path}/policies.yaml"
