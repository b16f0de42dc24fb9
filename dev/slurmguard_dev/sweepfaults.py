"""Fault injection for sweep workloads: a TEST AND DEMO FACILITY, never set in production.

The development cluster has no GPUs and all its "nodes" share one host, so a bad node
cannot be produced physically. A workload reads its node's faults from

* ``SLURMGUARD_SWEEP_INJECT``: inline JSON, or
* ``SLURMGUARD_SWEEP_INJECT_FILE``: path of a JSON file (read when the workload starts),

keyed by the Slurm node name (``SLURMD_NODENAME``), e.g.::

    SLURMGUARD_SWEEP_INJECT='{"node2": {"gemm_slowdown": 0.25, "gpus": [5]}}'

Slowdowns are fractions of throughput lost (0.25 = the metric reads 25% low). The
workload realises them by sleeping inside the timed region for t * s / (1 - s) after a
measurement of duration t, so a slowed link costs time proportional to its bytes and the
CPU stays idle (the dev machine is shared). Every result written while faults are active
records them under ``injected``, so a demo result can never pass for a real one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Mapping

from slurmguard.errors import InputError
from slurmguard.names import is_node_name

ENV_INLINE = "SLURMGUARD_SWEEP_INJECT"
ENV_FILE = "SLURMGUARD_SWEEP_INJECT_FILE"

_SLOWDOWNS = ("gemm_slowdown", "membw_slowdown", "p2p_slowdown", "link_slowdown")


@dataclass(frozen=True)
class NodeFault:
    gemm_slowdown: float = 0.0
    """Fraction of GEMM throughput lost on the affected GPUs."""
    membw_slowdown: float = 0.0
    """Fraction of device memory bandwidth lost on the affected GPUs."""
    p2p_slowdown: float = 0.0
    """Fraction of intra-node GPU-to-GPU copy bandwidth lost on pairs touching affected GPUs."""
    link_slowdown: float = 0.0
    """Fraction of cross-node bandwidth lost (send/recv and all-reduce) on this node."""
    link_direction: Literal["tx", "rx", "both"] = "both"
    """Which transfers of this node the link slowdown hits: sends, receives or both."""
    gpus: tuple[int, ...] | None = None
    """GPU indexes affected by the per-GPU faults; None = all."""
    crash: bool = False
    """Exit with status 3 before writing any result (a crashed sweep)."""
    hang_s: float = 0.0
    """Sleep this long before measuring (drives the sweep into its time limit)."""
    corrupt_output: bool = False
    """Write a truncated, invalid JSON result."""
    gemm_corrupt: bool = False
    """Flip one element of each verified GEMM product on the affected GPUs (silent data
    corruption): the float64 reference check must catch it."""

    def hits_gpu(self, index: int) -> bool:
        return self.gpus is None or index in self.gpus

    def link_factor(self, sending: bool) -> float:
        """Slowdown that applies to one transfer of this node (0 when it does not)."""
        if self.link_slowdown <= 0:
            return 0.0
        if self.link_direction == "both" or (self.link_direction == "tx") == sending:
            return self.link_slowdown
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.gpus is not None:
            d["gpus"] = list(self.gpus)
        return d


def extra_delay(elapsed_s: float, slowdown: float) -> float:
    """Seconds to add to a measurement of `elapsed_s` so its rate drops by `slowdown`."""
    if slowdown <= 0 or elapsed_s <= 0:
        return 0.0
    return elapsed_s * slowdown / (1.0 - slowdown)


def parse_faults(data: Any, source: str) -> dict[str, NodeFault]:
    """Validate the node -> fault mapping. Raises InputError naming source and key."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a JSON object of node name -> faults")
    known = {f.name for f in fields(NodeFault)}
    out: dict[str, NodeFault] = {}
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
                if value is not None and (not isinstance(value, list) or not all(
                        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
                    raise InputError(f"{where}: expected a list of GPU indexes or null")
                kw[key] = None if value is None else tuple(value)
        out[node] = NodeFault(**kw)
    return out


def load_faults(env: Mapping[str, str] | None = None) -> dict[str, NodeFault]:
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
        raise InputError(f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    return parse_faults(data, source)


def fault_for(node: str, faults: Mapping[str, NodeFault]) -> NodeFault | None:
    return faults.get(node)
