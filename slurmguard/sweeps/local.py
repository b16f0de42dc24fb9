"""Run the sweep workloads on this machine without Slurm (`slurmguard sweep run-local`).

The pair sweep is started as one process per "node" with the environment srun would give
it (SLURM_PROCID, SLURM_NTASKS, SLURMD_NODENAME, MASTER_ADDR/PORT on loopback), so the
CPU path, the rendezvous and anything keyed by node name (the development tools' fault
launcher, when it is the policy's `python`) behave as under Slurm.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from slurmguard.config import SweepPolicy
from slurmguard.runner import CommandResult, CommandRunner, SubprocessRunner
from slurmguard.sweeps.templates import workload_dir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python(policy: SweepPolicy) -> str:
    return policy.python or sys.executable


def run_node_local(
    out: str,
    node: str,
    args: Sequence[str],
    policy: SweepPolicy,
    *,
    timeout_s: float,
    runner: CommandRunner | None = None,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run sweeps/node_sweep.py as node `node`; the result lands in `out`."""
    runner = runner or SubprocessRunner()
    argv = [_python(policy), str(workload_dir(policy) / "node_sweep.py"), "--out", out, "--node", node, *args]
    return runner.run(argv, timeout=timeout_s, check=False, env={**(env or {}), "SLURMD_NODENAME": node})


def run_pair_local(
    out: str,
    nodes: Sequence[str],
    args: Sequence[str],
    policy: SweepPolicy,
    *,
    timeout_s: float,
    runner: CommandRunner | None = None,
    env: Mapping[str, str] | None = None,
) -> list[CommandResult]:
    """Run sweeps/pair_sweep.py as len(nodes) local tasks; node rank 0 writes `out`.

    nodes[0] is the node under test, nodes[1] the reference (2-node sweeps).
    """
    if len(nodes) < 2:
        raise ValueError("a pair sweep needs at least two node names")
    runner = runner or SubprocessRunner()
    port = free_port()
    script = str(workload_dir(policy) / "pair_sweep.py")
    extra = ["--node-under-test", nodes[0]] + (["--reference", nodes[1]] if len(nodes) == 2 else [])

    def one(rank: int) -> CommandResult:
        task_env = {
            **(env or {}),
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(len(nodes)),
            "SLURMD_NODENAME": nodes[rank],
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        argv = [_python(policy), script, "--out", out, "--node", nodes[rank], *extra, *args]
        return runner.run(argv, timeout=timeout_s, check=False, env=task_env)

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(one, range(len(nodes))))
