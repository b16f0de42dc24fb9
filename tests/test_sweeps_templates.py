import subprocess

import pytest

from slurmguard.config import SweepPolicy
from slurmguard.errors import ConfigError
from slurmguard.sweeps.templates import (
    SweepJobSpec,
    default_workload_dir,
    fill_template,
    placeholders,
    render_sweep_script,
)

POL = SweepPolicy(python="/usr/bin/python3")


def _bash_ok(text: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, timeout=10)
    assert proc.returncode == 0, proc.stderr


def test_node_template_renders_validated_values():
    spec = SweepJobSpec(
        "node",
        ("node2",),
        "/var/lib/slurmguard/sweeps/42.json",
        "/var/log/sg/42.log",
        reservation="slurmguard_quarantine_node2",
        extra_args=("--duration", "1"),
    )
    text = render_sweep_script(spec, POL)
    _bash_ok(text)
    assert "{{" not in text
    lines = text.splitlines()
    assert "#SBATCH --nodelist=node2" in lines
    assert "#SBATCH --reservation=slurmguard_quarantine_node2" in lines
    assert "#SBATCH --time=30" in lines  # policy time_limit_min
    assert "#SBATCH --job-name=slurmguard_sweep_node_node2" in lines
    assert not any(line.startswith("#SBATCH --partition") for line in lines)  # optional line dropped
    assert f"/usr/bin/python3 {default_workload_dir()}/node_sweep.py" in text
    assert "--out /var/lib/slurmguard/sweeps/42.json --duration 1" in text


def test_pair_template_names_node_under_test_and_reference():
    spec = SweepJobSpec(
        "pair",
        ("node2", "node1"),
        "/tmp/r.json",
        "/tmp/r.log",
        time_limit_min=12,
        master_addr="127.0.0.1",
        master_port=29555,
        partition="debug",
        hw_class="NVIDIA H100 80GB HBM3 x8",
    )
    text = render_sweep_script(spec, POL)
    _bash_ok(text)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --nodelist=node2,node1" in text
    assert "#SBATCH --partition=debug" in text and "#SBATCH --time=12" in text
    assert "export MASTER_ADDR=127.0.0.1" in text and "export MASTER_PORT=29555" in text
    assert "--node-under-test node2 --reference node1 --hw-class 'NVIDIA H100 80GB HBM3 x8'" in text
    default = render_sweep_script(SweepJobSpec("pair", ("node2", "node1"), "/tmp/r.json", "/tmp/r.log"), POL)
    assert 'MASTER_PORT="$((20000 + SLURM_JOB_ID % 20000))"' in default


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(nodes=("node2;reboot",)), "nodes"),
        (dict(nodes=("node2", "node2"), kind="pair"), "nodes"),
        (dict(nodes=("node2", "node1")), "nodes"),  # a node sweep takes one node
        (dict(out_path="relative.json"), "out_path"),
        (dict(out_path="/tmp/a b.json"), "out_path"),
        (dict(log_path="/tmp/../etc/x"), "log_path"),
        (dict(reservation="r\n#SBATCH --uid=0"), "reservation"),
        (dict(time_limit_min=0), "time_limit_min"),
        (dict(extra_args=("--duration", "1; rm -rf /")), "extra_args"),
        (dict(master_port=80), "master_port"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(kw, field):
    base = dict(kind="node", nodes=("node2",), out_path="/tmp/r.json", log_path="/tmp/r.log")
    base.update(kw)
    with pytest.raises(ConfigError, match=f"sweep job: {field}: "):
        render_sweep_script(SweepJobSpec(**base), POL)


def test_fill_template_rejects_unknown_placeholders():
    with pytest.raises(ConfigError, match=r"t.sbatch:2: unknown placeholder \{\{nope\}\}"):
        fill_template("#!/bin/bash\necho {{nope}}\n", {}, "t.sbatch")


def test_shipped_templates_use_only_known_placeholders():
    known = {
        "job_name",
        "nodelist",
        "node_count",
        "time_limit_min",
        "log_path",
        "opt_reservation",
        "opt_partition",
        "opt_gres",
        "python",
        "workload_dir",
        "out_path",
        "args",
        "master_addr",
        "master_port",
    }
    for name in ("node_sweep.sbatch", "pair_sweep.sbatch"):
        text = (default_workload_dir() / "templates" / name).read_text()
        assert placeholders(text) <= known
        assert {"nodelist", "time_limit_min", "out_path", "opt_reservation"} <= placeholders(text)
