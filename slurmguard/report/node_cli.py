"""`slurmguard nodes` and `slurmguard node drain|resume|show`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from slurmguard.context import AppContext, app_context
from slurmguard.slurm.models import NodeInfo, is_ours
from slurmguard.store import NodeState, SchemaNotCurrent, StoreError

if TYPE_CHECKING:
    from slurmguard.respond.actions import ActionExecutor


def _owner(n: NodeInfo) -> str:
    if n.drained or n.down:
        return "slurmguard" if is_ours(n.reason) else "other"
    return "-"


def _lifecycle(app: AppContext) -> dict[str, str]:
    try:
        return {r.name: str(r.state) for r in app.store.list_nodes()}
    except StoreError:
        return {}


@click.command()
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
@click.pass_context
def nodes(ctx: click.Context, fmt: str) -> None:
    """Show every node: Slurm state, who drained it, lifecycle, jobs, reason."""
    app = app_context(ctx)
    fleet = app.slurm.nodes()
    lifecycle = _lifecycle(app)
    if fmt == "json":
        click.echo(
            json.dumps(
                [
                    {
                        "name": n.name,
                        "state": n.state_text,
                        "partitions": list(n.partitions),
                        "jobs": list(n.jobs),
                        "reason": n.reason,
                        "comment": n.comment,
                        "drained_by": _owner(n),
                        "lifecycle": lifecycle.get(n.name),
                    }
                    for n in fleet
                ],
                indent=2,
            )
        )
        return
    table = Table(title=f"{len(fleet)} nodes", title_justify="left")
    for col in ("NODE", "SLURM STATE", "LIFECYCLE", "PARTITIONS", "JOBS", "DRAINED BY", "REASON / COMMENT"):
        table.add_column(col, overflow="fold")
    for n in fleet:
        note = n.reason or n.comment or ""
        table.add_row(
            n.name,
            n.state_text,
            lifecycle.get(n.name, "-"),
            ",".join(n.partitions),
            ",".join(map(str, n.jobs)) or "-",
            _owner(n),
            note,
        )
    Console(width=max(120, Console().width)).print(table)
    if not lifecycle:
        click.echo("(no lifecycle data: database not initialised; run `slurmguard db upgrade`)")


@click.group()
def node() -> None:
    """Drain, resume or inspect one node."""


def _executor(ctx: click.Context) -> tuple[AppContext, ActionExecutor]:
    from slurmguard.respond.actions import ActionExecutor, unsettled_after

    app = app_context(ctx)
    try:
        store = app.store  # open first: no Slurm change without an audit trail
    except SchemaNotCurrent as exc:
        raise click.ClickException(f"{exc}; the audit log must exist before slurmguard acts") from None
    return app, ActionExecutor(
        app.slurm,
        store,
        actor=app.admin_actor(),
        dry_run=app.policy.safety.dry_run,
        unsettled_s=unsettled_after(app.policy.slurm),
    )


@node.command()
@click.argument("name")
@click.option("--reason", required=True, help="Why; stored as 'slurmguard: <reason>'.")
@click.pass_context
def drain(ctx: click.Context, name: str, reason: str) -> None:
    """Drain NAME with a slurmguard reason (refused if someone else drained it)."""
    app, ex = _executor(ctx)
    full = ex.drain(name, reason, evidence={"source": "cli"})
    app.store.get_or_create_node(name)
    rec = app.store.get_node(name)
    if rec is not None and rec.state not in (NodeState.DRAINING, NodeState.TERMINAL):
        app.store.transition(
            name, NodeState.DRAINING, f"admin drain: {reason}", {"source": "cli"}, actor=ex.actor, force=True
        )
    click.echo(f"{name}: drained ({full})" if full else f"{name}: dry-run, not drained")


@node.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Resume NAME if slurmguard drained it; refused for anyone else's drain."""
    app, ex = _executor(ctx)
    ex.resume(name, evidence={"source": "cli"})
    rec = app.store.get_node(name)
    if rec is not None and rec.state != NodeState.HEALTHY and not ex.dry_run:
        app.store.transition(
            name, NodeState.HEALTHY, "admin resume", {"source": "cli"}, actor=ex.actor, force=True
        )
    click.echo(f"{name}: {'dry-run, not resumed' if ex.dry_run else 'resumed'}")


@node.command()
@click.argument("name")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
@click.option("--offline", is_flag=True, help="Do not ask Slurm; the database view only.")
@click.pass_context
def show(ctx: click.Context, name: str, fmt: str, offline: bool) -> None:
    """Full history of NAME: lifecycle rows, audited actions, incidents, sweeps, triage."""
    from slurmguard.report.cli import show_node

    show_node(ctx, name, fmt, offline)
