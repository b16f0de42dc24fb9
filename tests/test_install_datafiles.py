"""Runtime files: the one lookup (slurmguard.datafiles) and what the wheel ships.

The wheel itself is built and installed outside the checkout by scripts/check_wheel.sh
(part of scripts/test.sh); these are the fast checks that catch the usual slip, a new
migration or template that package-data does not cover, before that runs.
"""

from __future__ import annotations

import glob
import tomllib
from pathlib import Path

import pytest

from slurmguard import datafiles

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DATA = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]


def _shipped(package: str) -> set[Path]:
    base = ROOT / package.replace(".", "/")
    return {
        Path(p).relative_to(base)
        for pat in PACKAGE_DATA[package]
        for p in glob.glob(str(base / pat))
        if Path(p).is_file()
    }


@pytest.mark.parametrize("top", ["sql", "sweeps", "prolog_epilog"])
def test_package_data_covers_every_file_of_the_shipped_directories(top):
    shipped = _shipped("slurmguard._data")
    on_disk = {
        p.relative_to(ROOT) for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    missing = sorted(str(p) for p in on_disk if p not in shipped)
    assert not missing, f"add to [tool.setuptools.package-data] slurmguard._data: {missing}"


def test_torch_hook_site_is_shipped():
    assert Path("hook/site/sitecustomize.py") in _shipped("slurmguard")


def test_lookups_resolve_to_the_top_level_directories_of_a_checkout():
    assert datafiles.migrations_dir() == ROOT / "sql" / "migrations"
    assert (datafiles.sweep_dir() / "templates" / "node_sweep.sbatch").is_file()
    assert datafiles.sweep_dir() == ROOT / "sweeps"
    assert datafiles.prolog_epilog_dir() == ROOT / "prolog_epilog"
    assert (datafiles.torch_hook_site() / "sitecustomize.py").is_file()


def test_checkout_only_path_missing_is_a_one_line_error_naming_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(datafiles, "checkout_root", lambda: tmp_path)
    with pytest.raises(
        datafiles.DataFilesMissing,
        match=r"bench hook needs a slurmguard source checkout: .*spank_plugin/Makefile not found",
    ):
        datafiles.checkout_path("spank_plugin", "Makefile", what="bench hook")


def test_bench_whatif_takes_its_traces_from_an_option_or_env_never_a_default(monkeypatch, capsys):
    from slurmguard.cli import main
    from slurmguard_dev.bench.whatif import TRACES_ENV

    monkeypatch.delenv(TRACES_ENV, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "whatif"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"slurmguard: error: no trace directory: pass --traces DIR or set ${TRACES_ENV} "
        "(a directory with trace-{AR,SE,ST}.parquet and meta-{AR,SE,ST}.yaml)\n"
    )
