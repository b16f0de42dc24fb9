"""What the prolog and the epilog share: policy lookup and the node's name."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from slurmguard.config import SYSTEM_POLICY, Policy, find_policy_file, load_policy

__all__ = ["SYSTEM_POLICY", "load", "node_name", "policy_path"]


def policy_path(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """config.find_policy_file with the hook's environment: never ./policies.yaml
    (slurmd runs prolog and epilog as root in the job's working directory)."""
    return find_policy_file(explicit, env)


def load(explicit: str | None, env: Mapping[str, str]) -> Policy:
    """The policy for a prolog/epilog run; ConfigError names file, line and key."""
    path = policy_path(explicit, env)
    return load_policy(path) if path is not None else Policy()


def node_name(explicit: str | None, env: Mapping[str, str]) -> str:
    """--node, then $SLURMD_NODENAME (set by slurmd), then the short host name."""
    return explicit or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
