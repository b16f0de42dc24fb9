"""`slurmguard triage report`, `slurmguard incidents`, and the body of `slurmguard node show`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurmguard.context import app_context
from slurmguard.store import NodeState

if TYPE_CHECKING:
    from slurmguard.context import AppContext
    from slurmguard.slurm.client import SlurmClient

FORMATS = ("table", "json", "html")


def _slurm_factory(app: AppContext) -> Callable[[], SlurmClient]:
    # Built lazily inside the report, so a Slurm that cannot even be configured degrades
    # to the audit-log view instead of failing the command.
    return lambda: app.slurm


@click.group()
def triage() -> None:
    """Triage report of nodes that are not healthy."""


@triage.command("report")
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NODES",
    help="Only these nodes (name or hostlist like gpu[01-08]; repeatable).",
)
@click.option(
    "--state",
    "states",
    multiple=True,
    metavar="STATE",
    help=f"Only nodes in these lifecycle states ({', '.join(s.value for s in NodeState)};"
    " repeatable or comma-separated).",
)
@click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="Nodes whose state began at/after WHEN (24h, 7d, or ISO date); also limits "
    "the fleet figures to events since then.",
)
@click.option(
    "--partition", default=None, help="Only nodes of this partition (also scopes the summary and figures)."
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option(
    "--output",
    "-o",
    "output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write to this file (html default: slurmguard-report.html).",
)
@click.option("--offline", is_flag=True, help="Do not ask Slurm; reasons come from the audit log.")
@click.option("--window", default="7d", show_default=True, help="How far back the HTML charts reach.")
@click.option(
    "--max-detail",
    type=click.IntRange(0),
    default=100,
    show_default=True,
    help="HTML: nodes with a detail section (charts).",
)
@click.pass_context
def report_cmd(
    ctx: click.Context,
    nodes: tuple[str, ...],
    states: tuple[str, ...],
    since: str | None,
    partition: str | None,
    fmt: str,
    output: str | None,
    offline: bool,
    window: str,
    max_detail: int,
) -> None:
    """Which nodes are out, why, since when, what was tried, and what to do next."""
    from slurmguard.triage.report import (
        build_report,
        parse_duration,
        parse_nodes,
        parse_since,
        parse_states,
    )
    from slurmguard.triage.report_data import FleetSnapshot
    from slurmguard.triage.report_model import ReportFilters

    app = app_context(ctx)
    store = app.store
    now = store.now()
    filters = ReportFilters(
        nodes=parse_nodes(nodes),
        states=parse_states(states),
        since=parse_since(since, now) if since else None,
        partition=partition,
        offline=offline,
        window=parse_duration(window, "--window"),
    )
    snap = FleetSnapshot.load(store)
    rep = build_report(store, _slurm_factory(app), app.policy, filters, now=now, snapshot=snap)
    if fmt == "table":
        from slurmguard.report.terminal import render_terminal

        if output:
            from rich.console import Console

            with open(output, "w", encoding="utf-8") as fh:
                render_terminal(rep, Console(file=fh, width=160, no_color=True))
            click.echo(f"wrote {output}")
        else:
            render_terminal(rep)
        return
    if fmt == "json":
        from slurmguard.report.jsonout import render_json

        text = render_json(rep)
        if output:
            Path(output).write_text(text + "\n", encoding="utf-8")
            click.echo(f"wrote {output}")
        else:
            click.echo(text)
        return
    from slurmguard.report.html import report_html

    page = report_html(store, rep, snap, app.policy, max_detail=max_detail)
    path = Path(output or "slurmguard-report.html")
    path.write_text(page, encoding="utf-8")
    click.echo(f"wrote {path} ({len(rep.rows)} nodes listed, {len(page) // 1024} KiB)")


@triage.command("schema")
def schema_cmd() -> None:
    """Print the JSON Schema of `triage report --format json`."""
    from slurmguard.report.jsonout import load_schema

    click.echo(json.dumps(load_schema(), indent=2))


@click.command()
@click.option("--since", default=None, metavar="WHEN", help="Detected at/after WHEN (24h, 7d, ISO).")
@click.option("--status", default=None, help="open, mitigated, resolved, false_positive, suppressed.")
@click.option("--node", default=None, help="Only incidents involving this node.")
@click.option("--job", default=None, help="Only incidents of this job.")
@click.option("--limit", type=click.IntRange(1), default=None, help="The newest N.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.pass_context
def incidents(
    ctx: click.Context,
    since: str | None,
    status: str | None,
    node: str | None,
    job: str | None,
    limit: int | None,
    fmt: str,
) -> None:
    """Incidents with their detection delay, tier, affected jobs and outcome."""
    from slurmguard.triage.report import parse_since
    from slurmguard.triage.report_node import (
        incidents_json,
        list_incidents,
        render_incidents,
    )

    store = app_context(ctx).store
    when = parse_since(since, store.now()) if since else None
    incs = list_incidents(store, since=when, status=status, node=node, job=job, limit=limit)
    if fmt == "json":
        click.echo(incidents_json(incs))
    else:
        render_incidents(incs)


def show_node(ctx: click.Context, name: str, fmt: str, offline: bool) -> None:
    """`slurmguard node show NAME`: the node's whole recorded history."""
    from slurmguard.triage.report_node import history_dict, node_history, render_history

    app = app_context(ctx)
    h = node_history(app.store, name, _slurm_factory(app), app.policy, offline=offline)
    if fmt == "json":
        click.echo(json.dumps(history_dict(h), indent=2, allow_nan=False))
    else:
        render_history(h)
