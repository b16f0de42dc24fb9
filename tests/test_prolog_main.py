"""The prolog entry: exit codes, slurmd-log lines, policy lookup, and the sh wrapper."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from slurmguard import policyfile
from slurmguard.config import parse_policy
from slurmguard.nodecheck import common, prolog
from slurmguard.telemetry.fake_nvml import FakeNvml
from tests.fixtures.prolog import NVML_H100, ROOT, NoDriverNvml, fake_ib

WRAPPER = ROOT / "prolog_epilog" / "slurmguard-prolog"


def policy(text: str):
    return parse_policy(text, "test.yaml")


def run(pol, env=None, loader=NoDriverNvml, verbose=False):
    err, out = io.StringIO(), io.StringIO()
    code = prolog.run_prolog(pol, "node7", env or {}, err=err, out=out if verbose else None, loader=loader)
    return code, err.getvalue(), out.getvalue()


def test_healthy_node_exits_0_silently(tmp_path):
    fake_ib(tmp_path / "ib", {"mlx5_0:1": {}})
    code, err, _ = run(policy(f"prolog:\n  expected_gpus: 0\n  ib_sysfs_root: {tmp_path / 'ib'}\n"))
    assert (code, err) == (0, "")


def test_failed_check_exits_1_with_one_line_per_problem(tmp_path):
    fake_ib(
        tmp_path / "ib",
        {
            "mlx5_0:1": {"state": "1: DOWN", "phys_state": "3: Disabled"},
            "mlx5_1:1": {"state": "1: DOWN", "phys_state": "2: Polling"},
        },
    )
    code, err, _ = run(policy(f"prolog:\n  expected_gpus: 8\n  ib_sysfs_root: {tmp_path / 'ib'}\n"))
    assert code == 1
    assert err.splitlines() == [
        (
            "slurmguard-prolog: node7: gpu_count: NVML unavailable (NVML Shared Library Not Found); "
            "expected 8 GPU(s)"
        ),
        "slurmguard-prolog: node7: gpu_health: NVML unavailable: NVML Shared Library Not Found",
        "slurmguard-prolog: node7: nic_link: mlx5_0:1: link down (port not ACTIVE, phys_state 3: Disabled)",
        "slurmguard-prolog: node7: nic_link: mlx5_1:1: link down (port not ACTIVE, phys_state 2: Polling)",
    ]


def test_only_enabled_checks_run(tmp_path):
    fake_ib(tmp_path / "ib", {"mlx5_0:1": {"state": "1: DOWN"}})
    code, err, out = run(
        policy(f"prolog:\n  checks: [gpu_count]\n  expected_gpus: 8\n  ib_sysfs_root: {tmp_path / 'ib'}\n"),
        loader=lambda: FakeNvml.from_fixture(NVML_H100),
        verbose=True,
    )
    assert (code, err) == (0, "")
    assert out.startswith("slurmguard-prolog: node7: gpu_count: ok (") and "nic_link" not in out


def test_nvml_off_skips_gpu_checks():
    code, err, _ = run(
        policy("prolog:\n  nvml: false\n  expected_gpus: 8\n  checks: [gpu_count, gpu_health]\n")
    )
    assert (code, err) == (0, "")


def test_expected_gpus_from_slurm_conf(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("NodeName=node[1-8] Gres=gpu:h100:8\n")
    pol = policy("prolog:\n  checks: [gpu_count]\n")
    assert run(pol, {"SLURM_CONF": str(conf)}, loader=lambda: FakeNvml.from_fixture(NVML_H100))[0] == 0
    code, err, _ = run(pol, {"SLURM_CONF": str(conf)})
    assert code == 1 and "expected 8 GPU(s)" in err


def test_unknown_expected_count_is_an_internal_error(tmp_path):
    env = {"SLURM_CONF": str(tmp_path / "nope.conf")}
    code, err, _ = run(policy("prolog:\n  checks: [gpu_count]\n"), env)
    assert code == 0
    assert err == (
        f"slurmguard-prolog: node7: gpu_count: internal error (ignored, "
        f"prolog.fail_on_internal_error=false): expected GPU count unknown: "
        f"{tmp_path / 'nope.conf'}: slurm.conf not found\n"
    )
    code, err, _ = run(policy("prolog:\n  checks: [gpu_count]\n  fail_on_internal_error: true\n"), env)
    assert code == 2 and "internal error (failing, prolog.fail_on_internal_error=true)" in err


def test_check_failure_beats_internal_error(tmp_path):
    fake_ib(tmp_path / "ib", {"mlx5_0:1": {"state": "1: DOWN"}})
    env = {"SLURM_CONF": str(tmp_path / "nope.conf")}
    code, _, _ = run(
        policy(f"prolog:\n  ib_sysfs_root: {tmp_path / 'ib'}\n  fail_on_internal_error: true\n"), env
    )
    assert code == 1


def test_main_broken_policy_passes_and_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text("prolog:\n  timeout_s: 8\n  chekcs: []\n")
    code = prolog.main(["--node", "n1"], env={"SLURMGUARD_POLICY": str(bad)})
    assert code == 0
    assert capsys.readouterr().err == (
        f"slurmguard-prolog: n1: internal error (ignored, checks skipped): "
        f"{bad}:3: prolog.chekcs: unknown key\n"
    )


def test_policy_lookup_never_reads_the_jobs_working_directory(tmp_path, monkeypatch):
    (tmp_path / "policies.yaml").write_text("prolog:\n  expected_gpus: 99\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(policyfile, "SYSTEM_POLICY", tmp_path / "etc-absent.yaml")
    assert common.policy_path(None, {}) is None
    assert common.load(None, {}).prolog.expected_gpus is None
    assert common.policy_path(None, {"SLURMGUARD_POLICY": "/x.yaml"}).as_posix() == "/x.yaml"
    assert common.policy_path("/y.yaml", {"SLURMGUARD_POLICY": "/x.yaml"}).as_posix() == "/y.yaml"


def test_node_name_order():
    assert common.node_name("a", {"SLURMD_NODENAME": "b"}) == "a"
    assert common.node_name(None, {"SLURMD_NODENAME": "b"}) == "b"
    assert common.node_name(None, {})  # host name


# ------------------------------------------------------------------ the sh wrapper
def _wrapper_env(tmp_path, policy_text: str) -> dict[str, str]:
    pol = tmp_path / "policy.yaml"
    pol.write_text(policy_text)
    env_file = tmp_path / "slurmguard.env"
    # systemd EnvironmentFile syntax, as in systemd/slurmguard.env.example
    env_file.write_text(
        f'# comment\nSLURMGUARD_POLICY="{pol}"\nSLURMGUARD_PYTHON={sys.executable}\n'
        f"SLURMGUARD_OTHER=$(touch {tmp_path / 'executed'})\n"
    )
    # what slurmd gives a prolog: no PATH, SLURM_* only (+ our test hook for the env file)
    return {"SLURMD_NODENAME": "node3", "SLURM_JOB_ID": "12", "SLURMGUARD_ENV_FILE": str(env_file)}


def test_wrapper_without_path_fails_a_down_port(tmp_path):
    fake_ib(tmp_path / "ib", {"mlx5_0:1": {"state": "1: DOWN", "phys_state": "3: Disabled"}})
    env = _wrapper_env(tmp_path, f"prolog:\n  expected_gpus: 0\n  ib_sysfs_root: {tmp_path / 'ib'}\n")
    res = subprocess.run(
        [str(WRAPPER)], env=env, check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert res.returncode == 1, res.stderr
    assert not (tmp_path / "executed").exists()  # the env file is parsed, never run
    assert res.stderr == (
        "slurmguard-prolog: node3: nic_link: mlx5_0:1: link down (port not ACTIVE, phys_state 3: Disabled)\n"
    )


def test_wrapper_healthy_and_job_cwd_not_importable(tmp_path):
    fake_ib(tmp_path / "ib", {"mlx5_0:1": {}})
    env = _wrapper_env(tmp_path, f"prolog:\n  expected_gpus: 0\n  ib_sysfs_root: {tmp_path / 'ib'}\n")
    job_dir = tmp_path / "jobdir"
    job_dir.mkdir()
    marker = tmp_path / "imported"
    # a job's user could leave modules in the job's working directory: root must not import them
    for mod in ("pydantic.py", "yaml.py", "numpy.py"):
        (job_dir / mod).write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (job_dir / "policies.yaml").write_text("prolog:\n  expected_gpus: 64\n")
    res = subprocess.run(
        [str(WRAPPER), "-v"], env=env, check=False, capture_output=True, text=True, timeout=60, cwd=job_dir
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert not marker.exists()
    assert "nic_link: ok" in res.stdout


def test_wrapper_missing_interpreter_passes_with_a_message(tmp_path):
    env = {"SLURMGUARD_PYTHON": str(tmp_path / "no-python"), "SLURMGUARD_ENV_FILE": "/nonexistent"}
    res = subprocess.run([str(WRAPPER)], env=env, check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    assert "no Python interpreter" in res.stderr


def test_wrapper_is_executable_sh():
    for name in ("slurmguard-prolog", "slurmguard-epilog", "slurmguard-run"):
        p = ROOT / "prolog_epilog" / name
        assert os.access(p, os.X_OK), name
        assert p.read_text().startswith("#!/bin/sh\n")
        res = subprocess.run(["sh", "-n", str(p)], check=False, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("argv", [["--help"]])
def test_entry_help_exits_0(argv):
    res = subprocess.run(
        [sys.executable, "-m", "slurmguard.nodecheck.prolog", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0 and "--policy" in res.stdout


@pytest.mark.parametrize("hook", ["slurmguard.nodecheck.prolog", "slurmguard.nodecheck.epilog"])
def test_a_bug_in_either_hook_never_fails_the_node(hook):
    """Prolog and epilog share one guard: an exception escaping main is one line, exit 0."""
    code = f"import {hook} as h\ndef boom():\n    raise KeyError('bug')\nh.main = boom\nh.entry()\n"
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    prog = "slurmguard-prolog" if hook.endswith("prolog") else "slurmguard-epilog"
    assert res.returncode == 0
    assert res.stderr == f"{prog}: internal error (ignored): KeyError: 'bug'\n"
