"""What a CLI command needs, built lazily from the global options."""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import click

from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy, database_url, load_policy

if TYPE_CHECKING:  # imported when first used: commands that need neither stay light
    from slurmguard.slurm.client import SlurmClient
    from slurmguard.store import Store


@dataclass
class AppContext:
    policy_path: str | None = None
    db_override: str | None = None
    clock: Clock = field(default_factory=SystemClock)

    @cached_property
    def policy(self) -> Policy:
        return load_policy(self.policy_path)

    @property
    def db_url(self) -> str:
        return database_url(self.policy, self.db_override)

    @cached_property
    def store(self) -> Store:
        from slurmguard.store import Store

        return Store.open(self.db_url, self.clock)

    @cached_property
    def slurm(self) -> SlurmClient:
        from slurmguard.slurm.backend import client_from_policy

        return client_from_policy(self.policy.slurm)

    @staticmethod
    def admin_actor() -> str:
        user = os.environ.get("SUDO_USER") or getpass.getuser()
        return f"admin:{user}"


def app_context(ctx: click.Context) -> AppContext:
    root = ctx.find_root()
    obj = root.obj if isinstance(root.obj, dict) else {}
    if "app" not in obj:
        obj["app"] = AppContext(policy_path=obj.get("policy_path"), db_override=obj.get("db_url"))
        root.obj = obj
    return obj["app"]
