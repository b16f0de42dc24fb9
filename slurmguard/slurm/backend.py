"""The SlurmClient a policy's `slurm` section asks for (`backend: commands | restd`)."""

from __future__ import annotations

from typing import Any

from slurmguard.errors import ConfigError
from slurmguard.slurm.client import SlurmClient


def client_from_policy(p: Any, env: dict[str, str] | None = None) -> SlurmClient:
    """Build the backend named by `p` (a config.SlurmPolicy); env: for the Slurm commands."""
    from slurmguard.slurm.commands import CommandSlurmClient

    commands = CommandSlurmClient(timeout_s=p.command_timeout_s, bin_dir=p.bin_dir, env=env)
    if p.backend == "commands":
        return commands
    if p.backend == "restd":
        from slurmguard.slurm.restd import RestdSlurmClient, TokenSource

        tokens = TokenSource(
            user=p.restd_user,
            key_file=p.restd_jwt_key_file,
            token_file=p.restd_token_file,
            lifespan_s=p.restd_token_lifespan_s,
        )
        return RestdSlurmClient(
            p.restd_url, tokens, api=p.restd_api, timeout_s=p.command_timeout_s, fallback=commands
        )
    raise ConfigError(f"slurm.backend {p.backend!r}: expected commands or restd")
