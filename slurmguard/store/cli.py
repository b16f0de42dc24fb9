"""`slurmguard db ...`: create, migrate and inspect the database."""

from __future__ import annotations

import click

from slurmguard.config import database_url, load_policy
from slurmguard.store import db as dbmod


def _url(ctx: click.Context) -> str:
    """--db, then $SLURMGUARD_DB, then database.url of the policy."""
    obj = ctx.find_root().obj or {}
    policy = load_policy(obj.get("policy_path"))
    return database_url(policy, obj.get("db_url"))


def _describe(rev: str | None, head: str) -> str:
    if rev is None:
        return "none (empty database)"
    return f"{rev} (head)" if rev == head else f"{rev} (head is {head})"


@click.group()
def db() -> None:
    """Create, upgrade and inspect the database (URL: --db, $SLURMGUARD_DB, database.url)."""


@db.command("upgrade")
@click.argument("revision", default="head")
@click.pass_context
def upgrade_cmd(ctx: click.Context, revision: str) -> None:
    """Create the database or migrate it to REVISION (default: head). Safe to repeat."""
    url = _url(ctx)
    head = dbmod.head_revision()
    before = dbmod.current(url)
    after = dbmod.upgrade(url, revision)
    click.echo(f"database: {dbmod.mask_url(url)}")
    if before == after:
        click.echo(f"revision: {_describe(after, head)}, already up to date")
    else:
        click.echo(f"revision: {_describe(after, head)}, upgraded from {before or 'empty'}")


@db.command("current")
@click.option(
    "--check",
    is_flag=True,
    help="Exit 1 unless the database is at the newest revision.",
)
@click.pass_context
def current_cmd(ctx: click.Context, check: bool) -> None:
    """Show the database's migration revision."""
    url = _url(ctx)
    head = dbmod.head_revision()
    rev = dbmod.current(url)
    click.echo(f"database: {dbmod.mask_url(url)}")
    click.echo(f"revision: {_describe(rev, head)}")
    if check and rev != head:
        ctx.exit(1)


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Confirm: downgrading drops tables and their data.")
@click.pass_context
def downgrade_cmd(ctx: click.Context, revision: str, yes: bool) -> None:
    """Migrate down to REVISION ('base' removes every slurmguard table)."""
    url = _url(ctx)
    if not yes:
        raise click.UsageError("downgrade drops tables and their data; pass --yes to confirm")
    after = dbmod.downgrade(url, revision)
    click.echo(f"database: {dbmod.mask_url(url)}")
    click.echo(f"revision: {_describe(after, dbmod.head_revision())}")
