"""Render the sweep sbatch templates (sweeps/templates/*.sbatch) with validated values.

Everything that reaches the script is checked first: node names against Slurm's name
rules, paths and names against a conservative character set (values on ``#SBATCH`` lines
are read by sbatch, not by a shell, so quoting would not protect them), and values in
the shell body are also shell-quoted. A bad value raises ConfigError naming the field.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurmguard import datafiles
from slurmguard.config import SweepPolicy
from slurmguard.errors import ConfigError, read_user_text
from slurmguard.names import is_node_name

_PLACEHOLDER = re.compile(r"\{\{([a-z_]+)\}\}")
_PATH_RE = re.compile(r"^/[A-Za-z0-9._/+@=,-]*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_GRES_RE = re.compile(r"^[A-Za-z0-9_:,.-]{1,128}$")
_ARG_RE = re.compile(r"^[A-Za-z0-9_.,:=/+@-]{1,256}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,254}$")
_PRINTABLE = re.compile(r"^[\x20-\x7e]{1,128}$")


def default_workload_dir() -> Path:
    """The shipped sweeps/ (slurmguard.datafiles), unless sweeps.workload_dir overrides it."""
    return datafiles.sweep_dir()


def workload_dir(policy: SweepPolicy) -> Path:
    return Path(policy.workload_dir) if policy.workload_dir else default_workload_dir()


@dataclass(frozen=True)
class SweepJobSpec:
    """One sweep job to submit. `nodes` = (node under test,) or (node under test, reference, ...)."""

    kind: Literal["node", "pair"]
    nodes: tuple[str, ...]
    out_path: str
    """Absolute path of the result JSON; must be readable by the controller afterwards."""
    log_path: str
    """Absolute path of the job's stdout/stderr."""
    time_limit_min: int | None = None
    """None = SweepPolicy.time_limit_min."""
    reservation: str | None = None
    partition: str | None = None
    gres: str | None = None
    job_name: str | None = None
    master_addr: str | None = None
    """None = the batch host's hostname (node rank 0 runs there)."""
    master_port: int | None = None
    """None = 20000 + job id mod 20000, so concurrent sweeps do not collide."""
    hw_class: str | None = None
    policy_path: str | None = None
    extra_args: tuple[str, ...] = ()
    """Extra workload options (tests/demo: --duration 1 ...), each a plain token."""


def _check(cond: bool, field: str, value: object, what: str) -> None:
    if not cond:
        raise ConfigError(f"sweep job: {field}: {what}, got {value!r}")


def render_sweep_script(spec: SweepJobSpec, policy: SweepPolicy, template_dir: Path | None = None) -> str:
    """The sbatch script text for `spec`; raises ConfigError on any invalid value."""
    _check(spec.kind in ("node", "pair"), "kind", spec.kind, "expected node or pair")
    want = (1, 1) if spec.kind == "node" else (2, 64)
    _check(
        want[0] <= len(spec.nodes) <= want[1],
        "nodes",
        spec.nodes,
        f"a {spec.kind} sweep takes {want[0]}{'' if want[0] == want[1] else '+'} node(s)",
    )
    for n in spec.nodes:
        _check(is_node_name(n), "nodes", n, "invalid node name")
    _check(len(set(spec.nodes)) == len(spec.nodes), "nodes", spec.nodes, "duplicate node")
    for field, p in (("out_path", spec.out_path), ("log_path", spec.log_path)):
        _check(
            isinstance(p, str) and bool(_PATH_RE.match(p)) and "/../" not in p + "/",
            field,
            p,
            "expected an absolute path of letters, digits and ._/+@=,-",
        )
    limit = policy.time_limit_min if spec.time_limit_min is None else spec.time_limit_min
    _check(
        isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= 7 * 24 * 60,
        "time_limit_min",
        limit,
        "expected whole minutes between 1 and 10080",
    )
    for field, v, rx in (
        ("reservation", spec.reservation, _NAME_RE),
        ("partition", spec.partition or policy.partition, _NAME_RE),
        ("job_name", spec.job_name, _NAME_RE),
        ("gres", spec.gres, _GRES_RE),
    ):
        if v is not None:
            _check(isinstance(v, str) and bool(rx.match(v)), field, v, "invalid characters")
    if spec.master_addr is not None:
        _check(
            bool(_HOST_RE.match(spec.master_addr)), "master_addr", spec.master_addr, "expected a host or IP"
        )
    if spec.master_port is not None:
        _check(
            isinstance(spec.master_port, int) and 1024 <= spec.master_port <= 65535,
            "master_port",
            spec.master_port,
            "expected a port in 1024-65535",
        )
    for a in spec.extra_args:
        _check(isinstance(a, str) and bool(_ARG_RE.match(a)), "extra_args", a, "expected a plain token")
    if spec.hw_class is not None:
        _check(bool(_PRINTABLE.match(spec.hw_class)), "hw_class", spec.hw_class, "expected printable text")
    if spec.policy_path is not None:
        _check(
            bool(_PATH_RE.match(spec.policy_path)),
            "policy_path",
            spec.policy_path,
            "expected an absolute path",
        )
    python = policy.python or sys.executable
    _check(bool(_PATH_RE.match(python)), "sweeps.python", python, "expected an absolute path")
    wdir = str(workload_dir(policy))
    _check(bool(_PATH_RE.match(wdir)), "sweeps.workload_dir", wdir, "expected an absolute path")

    nut = spec.nodes[0]
    args: list[str] = []
    if spec.kind == "pair":
        args += ["--node-under-test", nut]
        if len(spec.nodes) == 2:
            args += ["--reference", spec.nodes[1]]
    if spec.hw_class is not None:
        args += ["--hw-class", spec.hw_class]
    if spec.policy_path is not None:
        args += ["--policy", spec.policy_path]
    args += list(spec.extra_args)
    values = {
        "job_name": spec.job_name or f"slurmguard_sweep_{spec.kind}_{nut}",
        "nodelist": ",".join(spec.nodes),
        "node_count": str(len(spec.nodes)),
        "time_limit_min": str(limit),
        "log_path": spec.log_path,
        "opt_reservation": f"#SBATCH --reservation={spec.reservation}" if spec.reservation else "",
        "opt_partition": (
            f"#SBATCH --partition={spec.partition or policy.partition}"
            if (spec.partition or policy.partition)
            else ""
        ),
        "opt_gres": f"#SBATCH --gres={spec.gres}" if spec.gres else "",
        "python": shlex.quote(python),
        "workload_dir": shlex.quote(wdir),
        "out_path": shlex.quote(spec.out_path),
        "args": " ".join(shlex.quote(a) for a in args),
        "master_addr": shlex.quote(spec.master_addr) if spec.master_addr else '"$(hostname)"',
        "master_port": (
            str(spec.master_port) if spec.master_port is not None else '"$((20000 + SLURM_JOB_ID % 20000))"'
        ),
    }
    tdir = template_dir or (Path(wdir) / "templates")
    name = "node_sweep.sbatch" if spec.kind == "node" else "pair_sweep.sbatch"
    text = read_user_text(tdir / name, "sweep template", ConfigError)
    return fill_template(text, values, str(tdir / name))


def fill_template(text: str, values: dict[str, str], source: str = "<template>") -> str:
    """Replace {{name}} placeholders; unknown placeholders are an error; lines that an
    empty optional value leaves blank are dropped."""
    out_lines = []
    for lineno, line in enumerate(text.splitlines(), 1):
        names = _PLACEHOLDER.findall(line)
        for n in names:
            if n not in values:
                raise ConfigError(f"{source}:{lineno}: unknown placeholder {{{{{n}}}}}")
        new = _PLACEHOLDER.sub(lambda m: values[m.group(1)], line)
        if names and not new.strip():
            continue
        out_lines.append(new)
    return "\n".join(out_lines) + "\n"


def placeholders(text: str) -> set[str]:
    return set(_PLACEHOLDER.findall(text))


def small_workload_args(duration: float = 1.0, sizes_mb: Sequence[int] = (1,)) -> tuple[str, ...]:
    """Small settings for demo/test sweeps on a shared CPU: short GEMMs, small buffers."""
    return (
        "--duration",
        f"{duration:g}",
        "--gemm-size",
        "128",
        "--dtypes",
        "float32,bfloat16",
        "--membw-bytes",
        str(4 << 20),
        "--message-sizes-mb",
        ",".join(str(s) for s in sizes_mb),
        "--repeats",
        "2",
        "--threads",
        "1",
    )
