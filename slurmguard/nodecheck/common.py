"""What the prolog and the epilog share: policy lookup and the node's name."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from slurmguard.config import Policy, load_policy

SYSTEM_POLICY = Path("/etc/slurmguard/policies.yaml")


def policy_path(explicit: str | None, env: Mapping[str, str]) -> Path | None:
    """--policy, then $SLURMGUARD_POLICY, then /etc/slurmguard/policies.yaml.

    Never ./policies.yaml: slurmd runs prolog and epilog in the job's working
    directory, which the job's user controls, and both run as root.
    """
    if explicit:
        return Path(explicit)
    if env.get("SLURMGUARD_POLICY"):
        return Path(env["SLURMGUARD_POLICY"])
    return SYSTEM_POLICY if SYSTEM_POLICY.is_file() else None


def load(explicit: str | None, env: Mapping[str, str]) -> Policy:
    """The policy for a prolog/epilog run; ConfigError names file, line and key."""
    path = policy_path(explicit, env)
    return load_policy(path) if path is not None else Policy()


def node_name(explicit: str | None, env: Mapping[str, str]) -> str:
    """--node, then $SLURMD_NODENAME (set by slurmd), then the short host name."""
    return explicit or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
