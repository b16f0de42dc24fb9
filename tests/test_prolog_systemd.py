"""systemd units of the controller and the agent: syntax, what the sandbox allows, verify."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmguard.config import Policy

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
CONTROLLER = UNITS / "slurmguard-controller.service"
AGENT = UNITS / "slurmguard-agent.service"
ENV_EXAMPLE = UNITS / "slurmguard.env.example"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: [Section], Key=Value (repeatable), # and ; comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}:{no}: key outside a section"
        assert "=" in line, f"{path.name}:{no}: not Key=Value: {line!r}"
        key, value = line.split("=", 1)
        assert re.fullmatch(r"[A-Za-z]+", key.strip()), f"{path.name}:{no}: bad key {key!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit, section, key):
    values = unit[section].get(key)
    assert values is not None and len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


@pytest.mark.parametrize("path,command", [(CONTROLLER, "controller"), (AGENT, "agent")])
def test_common_service_settings(path, command):
    u = parse_unit(path)
    assert set(u) == {"Unit", "Service", "Install"}
    exec_start = one(u, "Service", "ExecStart")
    assert re.fullmatch(rf"/\S+/slurmguard {command} \$SLURMGUARD_{command.upper()}_ARGS", exec_start)
    assert one(u, "Service", "Restart") == "on-failure"
    assert re.fullmatch(r"\d+s", one(u, "Service", "TimeoutStopSec"))
    assert one(u, "Service", "KillSignal") == "SIGTERM"  # both daemons stop cleanly on it
    assert one(u, "Service", "EnvironmentFile") == "-/etc/default/slurmguard"
    assert one(u, "Service", "NoNewPrivileges") == "yes"
    assert one(u, "Service", "ProtectSystem") == "strict"
    assert one(u, "Service", "ProtectHome") == "yes"
    assert "StartLimitBurst" in u["Unit"] and "StartLimitBurst" not in u["Service"]
    assert one(u, "Install", "WantedBy") == "multi-user.target"


def _writable(u, path: str) -> bool:
    """Under ProtectSystem=strict only /dev, /proc, /sys and the listed paths are writable."""
    rw = [p.lstrip("-") for v in u["Service"].get("ReadWritePaths", []) for p in v.split()]
    rw += ["/var/lib/" + d for v in u["Service"].get("StateDirectory", []) for d in v.split()]
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in rw + ["/dev"])


def test_agent_sandbox_allows_rings_gpus_and_sysfs():
    u = parse_unit(AGENT)
    s = u["Service"]
    # rings: 0600 files of the job's user in 0700 dirs; the agent reads them and sets the hold bit
    assert set(one(u, "Service", "CapabilityBoundingSet").split()) == {
        "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH",
    }
    assert _writable(u, Policy().agent.ring_root)
    assert "PrivateDevices" not in s  # NVML opens /dev/nvidia*
    for key in ("InaccessiblePaths", "TemporaryFileSystem", "ProtectProc"):
        assert key not in s  # /dev/shm, /sys and /proc stay visible
    assert one(u, "Service", "ProtectKernelTunables") == "yes"  # /sys read-only is enough


def test_controller_sandbox_allows_its_state_and_nothing_else():
    u = parse_unit(CONTROLLER)
    assert one(u, "Service", "CapabilityBoundingSet") == ""
    assert one(u, "Service", "StateDirectory") == "slurmguard"
    p = Policy()
    sqlite_path = p.database.url.split("sqlite:///", 1)[1]
    assert _writable(u, sqlite_path)
    assert _writable(u, p.sweeps.result_dir)
    assert not _writable(u, "/etc/slurm/slurm.conf")
    assert one(u, "Service", "PrivateDevices") == "yes"


def test_env_example_defines_what_the_units_use():
    keys = {}
    for no, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", line), f"line {no}: {line!r}"
        k, v = line.split("=", 1)
        keys[k] = v
    for path in (CONTROLLER, AGENT):
        for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", path.read_text()):
            assert var in keys, f"{path.name} uses ${var}, not in {ENV_EXAMPLE.name}"
    assert keys["SLURMGUARD_POLICY"] == "/etc/slurmguard/policies.yaml"


def test_prolog_wrapper_reads_the_env_example():
    # the example names /opt/slurmguard/venv/bin/python; absent here, so the wrapper says so
    wrapper = ROOT / "prolog_epilog" / "slurmguard-prolog"
    if Path("/opt/slurmguard/venv/bin/python").exists():
        pytest.skip("a real install is present on this machine")
    res = subprocess.run(
        [str(wrapper)],
        env={"SLURMGUARD_ENV_FILE": str(ENV_EXAMPLE)},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0
    assert res.stderr == (
        f"slurmguard-prolog: no Python interpreter (set SLURMGUARD_PYTHON in {ENV_EXAMPLE}); skipped\n"
    )


def _slurmguard_executable() -> str | None:
    beside = Path(sys.executable).parent / "slurmguard"
    if beside.is_file():
        return str(beside)
    return shutil.which("slurmguard")


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package: systemd)")
    exe = _slurmguard_executable()
    if exe is None:
        pytest.skip("no slurmguard executable on this machine (pip install -e .)")
    copies = []
    for unit in (CONTROLLER, AGENT):
        # verify checks that ExecStart exists: point it at this machine's slurmguard
        text = re.sub(r"ExecStart=/\S+/slurmguard ", f"ExecStart={exe} ", unit.read_text())
        dest = tmp_path / unit.name
        dest.write_text(text)
        copies.append(str(dest))
    res = subprocess.run(
        [tool, "verify", *copies], check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    ours = [line for line in (res.stdout + res.stderr).splitlines() if "slurmguard-" in line]
    assert res.returncode == 0 and ours == [], res.stdout + res.stderr
