"""Fault injection for sweep workloads, the development tools' own: never on a production node.

The development cluster has no GPUs and all its "nodes" share one host, so a bad node
cannot be produced physically. The product's workloads cannot be told to fake one (no
policy key, variable or file does it): this launcher does it from the outside. Used as the
sweep interpreter (`sweeps.python`, see `launcher`), it runs

    python -m slurmguard_dev.sweepfaults WORKLOAD.py [ARGS...]

which reads the faults from

* ``SLURMGUARD_SWEEP_INJECT``: inline JSON, or
* ``SLURMGUARD_SWEEP_INJECT_FILE``: path of a JSON file (read when the workload starts),

keyed by the Slurm node name (``SLURMD_NODENAME``), e.g.::

    SLURMGUARD_SWEEP_INJECT='{"node2": {"gemm_slowdown": 0.25, "gpus": [5]}}'

replaces the workload's `sweeplib.fault_for` (which answers "no fault" in the product) and
runs WORKLOAD.py as its own main. Slowdowns are fractions of throughput lost (0.25 = the
metric reads 25% low); the workload realises them by sleeping inside the timed region
(sweeplib.NodeFault, extra_delay). Every result written while faults are active records
them under ``injected``, so a demo result can never pass for a real one.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import sys
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from slurmguard import datafiles
from slurmguard.errors import InputError, SlurmguardError
from slurmguard.names import is_node_name

ENV_INLINE = "SLURMGUARD_SWEEP_INJECT"
ENV_FILE = "SLURMGUARD_SWEEP_INJECT_FILE"

_SLOWDOWNS = ("gemm_slowdown", "membw_slowdown", "p2p_slowdown", "link_slowdown")


def _sweeplib(workload_dir: Path | None = None) -> ModuleType:
    """The workloads' shared module (it defines NodeFault), imported as the workloads do:
    by name from their own folder, so a NodeFault pickled to a worker is the same class."""
    if "sweeplib" not in sys.modules:
        sys.path.insert(0, str(workload_dir or datafiles.sweep_dir()))
    import sweeplib

    return sweeplib


def __getattr__(name: str) -> Any:
    # NodeFault and extra_delay belong to the workload (sweeplib); re-exported for callers
    if name in ("NodeFault", "extra_delay", "NO_FAULT"):
        return getattr(_sweeplib(), name)
    raise AttributeError(name)


def parse_faults(data: Any, source: str) -> dict[str, Any]:
    """Validate the node -> fault mapping into sweeplib.NodeFault records. Raises
    InputError naming source and key."""
    NodeFault = _sweeplib().NodeFault
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a JSON object of node name -> faults")
    known = {f.name for f in fields(NodeFault)}
    out: dict[str, Any] = {}  # NodeFault of the workloads' sweeplib
    for node, spec in data.items():
        if not is_node_name(node):
            raise InputError(f"{source}: invalid node name {node!r}")
        if not isinstance(spec, dict):
            raise InputError(f"{source}: {node}: expected an object of faults")
        kw: dict[str, Any] = {}
        for key, value in spec.items():
            where = f"{source}: {node}.{key}"
            if key not in known:
                raise InputError(f"{where}: unknown fault (known: {', '.join(sorted(known))})")
            if key in _SLOWDOWNS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise InputError(f"{where}: expected a fraction in [0, 1), got {value!r}")
                kw[key] = float(value)
            elif key == "hang_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise InputError(f"{where}: expected seconds >= 0, got {value!r}")
                kw[key] = float(value)
            elif key in ("crash", "corrupt_output", "gemm_corrupt"):
                if not isinstance(value, bool):
                    raise InputError(f"{where}: expected true or false, got {value!r}")
                kw[key] = value
            elif key == "link_direction":
                if value not in ("tx", "rx", "both"):
                    raise InputError(f"{where}: expected tx, rx or both, got {value!r}")
                kw[key] = value
            elif key == "gpus":
                if value is not None and (
                    not isinstance(value, list)
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
                ):
                    raise InputError(f"{where}: expected a list of GPU indexes or null")
                kw[key] = None if value is None else tuple(value)
        out[node] = NodeFault(**kw)
    return out


def load_faults(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Faults from the environment (inline JSON beats the file); {} when neither is set."""
    env = os.environ if env is None else env
    inline = env.get(ENV_INLINE)
    if inline:
        source, text = ENV_INLINE, inline
    elif env.get(ENV_FILE):
        source = env[ENV_FILE]
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise InputError(f"{source}: cannot read fault file: {exc.strerror or exc}") from None
    else:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    return parse_faults(data, source)


def launcher(path: Path, fault_file: Path | None = None, python: str | None = None) -> Path:
    """Write an executable interpreter for `sweeps.python` that runs every sweep workload
    under this module (with the faults of `fault_file` when given, else of the job's
    environment); returns its absolute path."""
    path = Path(path).absolute()
    env = f"export {ENV_FILE}={shlex.quote(str(fault_file))}\n" if fault_file is not None else ""
    path.write_text(
        "#!/bin/sh\n# slurmguard-dev: sweep workloads with injected faults (never in production)\n"
        f'{env}exec {shlex.quote(python or sys.executable)} -m slurmguard_dev.sweepfaults "$@"\n'
    )
    path.chmod(0o755)
    return path


def main(argv: list[str] | None = None) -> None:
    """Run WORKLOAD.py ARGS... with the faults of the environment (see the module doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or not args[0].endswith(".py"):
        sys.exit("usage: python -m slurmguard_dev.sweepfaults WORKLOAD.py [ARGS...]")
    script = os.path.abspath(args[0])
    try:
        faults = load_faults()
    except SlurmguardError as exc:
        print(f"slurmguard sweep: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # the workloads' "bad options/policy" status
    sl = _sweeplib(Path(script).parent)

    def fault_for(node: str) -> tuple[Any, dict[str, Any] | None]:
        f = faults.get(node)
        return (f or sl.NO_FAULT), ({node: f.to_dict()} if f is not None else None)

    cast(Any, sl).fault_for = fault_for  # replaces the workloads' lookup
    sys.argv = [script, *args[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
