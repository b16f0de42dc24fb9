"""What the prolog and the epilog share: policy lookup, the node's name, and the guard
that keeps a slurmguard bug from failing the node."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from slurmguard.config import Policy, load_policy
from slurmguard.policyfile import SYSTEM_POLICY, find_policy_file

__all__ = ["SYSTEM_POLICY", "guarded_exit", "load", "node_name", "policy_path"]


def policy_path(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """policyfile.find_policy_file with the hook's environment: never ./policies.yaml
    (slurmd runs prolog and epilog as root in the job's working directory)."""
    return find_policy_file(explicit, env)


def load(explicit: str | None, env: Mapping[str, str]) -> Policy:
    """The policy for a prolog/epilog run; ConfigError names file, line and key."""
    path = policy_path(explicit, env)
    return load_policy(path) if path is not None else Policy()


def node_name(explicit: str | None, env: Mapping[str, str]) -> str:
    """--node, then $SLURMD_NODENAME (set by slurmd), then the short host name."""
    return explicit or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def guarded_exit(prog: str, main: Callable[[], int]) -> None:
    """Run a Slurm hook's `main` and exit with its code; never fail the node for our bug.

    slurmd drains a node whose prolog exits non-zero (and logs an epilog's failure
    against it), so an exception escaping `main` is a slurmguard bug: one line on
    stderr, no traceback in slurmd's log, exit 0. argparse's own exits (--help, usage
    errors) keep their code. os._exit: a check thread stuck in a driver call must not
    hold the interpreter's exit.
    """
    try:
        os.chdir("/")
        code = main()
    except SystemExit as exc:  # argparse --help / usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    except Exception as exc:  # noqa: BLE001 - never a traceback in slurmd's log, never a drain for a bug
        sys.stderr.write(f"{prog}: internal error (ignored): {type(exc).__name__}: {exc}\n")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
