"""Where the policy file is, decided without importing the policy's models.

Lookup order: --policy, $SLURMGUARD_POLICY, /etc/slurmguard/policies.yaml,
then none (the built-in defaults). Never the current directory: the policy
names the Slurm binaries and the secret, and an admin's command run as root in
a user's directory must not take them from it (nor slurmd's prolog and epilog,
run as root in the job's working directory).

Apart from slurmguard.config so that a short command (`slurmguard whatif`) can
learn that there is no file, and use its defaults, without importing pydantic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSTEM_POLICY = Path("/etc/slurmguard/policies.yaml")


def find_policy_file(
    explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None
) -> Path | None:
    """--policy, then $SLURMGUARD_POLICY, then /etc/slurmguard/policies.yaml; never ./."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    if env.get("SLURMGUARD_POLICY"):
        return Path(env["SLURMGUARD_POLICY"])
    return SYSTEM_POLICY if SYSTEM_POLICY.is_file() else None
