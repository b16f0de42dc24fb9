"""`slurmguard policy ...`"""

from __future__ import annotations

import json

import click

from slurmguard.config import load_policy


@click.group()
def policy() -> None:
    """Validate and show policy files."""


@policy.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def check(file: str) -> None:
    """Validate FILE; exit non-zero with FILE:LINE: KEY: message on error.

    Only validates: FILE need not be root-owned (the daemons check that)."""
    load_policy(file, trusted=False)
    click.echo(f"{file}: ok")


@policy.command("show")
@click.pass_context
def show(ctx: click.Context) -> None:
    """Print the effective policy (file values over defaults) as JSON."""
    p = load_policy(ctx.find_root().obj.get("policy_path"))
    click.echo(json.dumps(p.model_dump(mode="json"), indent=2))
