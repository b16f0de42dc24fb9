"""`slurmguard sweep ...`: run sweeps locally, check and judge results, render job scripts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from slurmguard.config import Policy, load_policy
from slurmguard.errors import InputError
from slurmguard.sweeps.baseline import baseline_for
from slurmguard.sweeps.result import ResultError, load_result
from slurmguard.sweeps.schedule import passes_for
from slurmguard.sweeps.templates import SweepJobSpec, render_sweep_script, small_workload_args
from slurmguard.sweeps.verdict import JobOutcome, judge_job, judge_multi

if TYPE_CHECKING:
    from slurmguard.context import AppContext
    from slurmguard.sweeps.scheduler import SweepScheduler, TickResult


def _policy(ctx: click.Context) -> Policy:
    return load_policy(ctx.find_root().obj.get("policy_path") if ctx.find_root().obj else None)


@click.group()
def sweep() -> None:
    """Run or inspect node sweeps (Guard 5)."""


@sweep.command("run-local", context_settings={"ignore_unknown_options": True})
@click.option("--kind", type=click.Choice(["node", "pair"]), default="node", show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="result JSON")
@click.option(
    "--nodes",
    default=None,
    help="node name(s), comma-separated; pair: node under test first, then reference"
    " [default: node1 (node), node2,node1 (pair)]",
)
@click.option("--small", is_flag=True, help="short, small settings for a quick CPU run")
@click.option("--timeout", type=float, default=None, help="seconds [default: time_limit_min]")
@click.argument("workload_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_local(
    ctx: click.Context,
    kind: str,
    out: str,
    nodes: str | None,
    small: bool,
    timeout: float | None,
    workload_args: tuple[str, ...],
) -> None:
    """Run a sweep workload here, without Slurm; extra args go to the workload
    (e.g. --device cpu --duration 1). Exit status 1 when the sweep reported errors."""
    from slurmguard.sweeps.local import run_node_local, run_pair_local

    pol = _policy(ctx).sweeps
    names = [n for n in (nodes or ("node1" if kind == "node" else "node2,node1")).split(",") if n]
    args = list(small_workload_args() if small else ()) + list(workload_args)
    limit = timeout or pol.time_limit_min * 60.0
    out = os.path.abspath(out)
    if kind == "node":
        if len(names) != 1:
            raise click.UsageError("--kind node takes exactly one node name")
        results = [run_node_local(out, names[0], args, pol, timeout_s=limit)]
    else:
        if len(names) < 2:
            raise click.UsageError("--kind pair takes two or more node names")
        results = run_pair_local(out, names, args, pol, timeout_s=limit)
    for r in results:
        if r.returncode != 0 and r.stderr.strip():
            click.echo(r.stderr.strip().splitlines()[-1], err=True)
    code = max(r.returncode for r in results)
    click.echo(f"{out}: exit {code}")
    ctx.exit(0 if code == 0 else 1)


@sweep.command("check")
@click.argument("result", type=click.Path(dir_okay=False))
def check(result: str) -> None:
    """Validate a result file against the schema and print a summary."""
    r = load_result(result)
    click.echo(
        f"{result}: ok: {r.kind} sweep of {r.node_under_test}"
        f"{' vs ' + r.reference if r.reference else ''} on {r.hw_class} ({r.device}),"
        f" {len(r.devices)} devices, {len(r.p2p)} p2p pairs, {len(r.allreduce)} all-reduce,"
        f" {len(r.transfers)} transfers, {len(r.errors)} errors"
    )


@sweep.command("judge")
@click.argument("result", type=click.Path(dir_okay=False))
@click.option(
    "--history",
    "history",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="result files of healthy nodes (repeatable) that form the class baseline",
)
@click.option(
    "--suspected/--unsuspected",
    default=True,
    show_default=True,
    help="an unsuspected node may seed an empty baseline (bootstrap)",
)
@click.option(
    "--trust-reference",
    is_flag=True,
    help="pair sweeps: the reference is known good (else only passes are conclusive)",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def judge(
    ctx: click.Context,
    result: str,
    history: tuple[str, ...],
    suspected: bool,
    trust_reference: bool,
    as_json: bool,
) -> None:
    """Judge RESULT against a baseline learned from --history results. Exit 0 when the
    node may return (pass/bootstrap), 1 otherwise."""
    from slurmguard.sweeps.verdict import ReferenceStatus

    pol = _policy(ctx).sweeps
    healthy = [load_result(h) for h in history]
    try:
        text = Path(result).read_bytes()
    except FileNotFoundError:
        text = None
    except OSError as exc:
        raise InputError(f"{result}: cannot read: {exc.strerror}") from None
    try:
        peek = load_result(result)
    except ResultError:
        peek = None
    if peek is not None and peek.kind == "multi":
        verdicts = judge_multi(peek, pol)
    else:
        kind = peek.kind if peek else "node"
        node = peek.node_under_test if peek else "unknown"
        baseline = baseline_for(peek, healthy) if peek else None
        ref = None
        if peek is not None and peek.reference:
            ref = ReferenceStatus(
                peek.reference,
                trust_reference,
                "trusted on the command line" if trust_reference else "not vouched for",
            )
        verdicts = [
            judge_job(
                JobOutcome("COMPLETED", 0, text, result),
                kind=kind,
                node=node,
                baseline=baseline,
                policy=pol,
                suspected=suspected,
                ref_status=ref,
            )
        ]
    for v in verdicts:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "node": v.node,
                        "outcome": v.outcome.value,
                        "reason": v.reason,
                        "detail": v.detail,
                        "basis": v.basis,
                        "basis_nodes": list(v.basis_nodes),
                    }
                )
            )
        else:
            click.echo(f"{v.node}: {v.outcome.value}: {v.reason}\n  {v.detail}\n  judged vs {v.basis_text}")
    ctx.exit(0 if all(v.outcome.returns_node for v in verdicts) else 1)


@sweep.command("render")
@click.option("--kind", type=click.Choice(["node", "pair"]), default="node", show_default=True)
@click.option("--nodes", required=True, help="node under test[,reference]")
@click.option("--out", "out_path", required=True, help="absolute path of the result JSON")
@click.option("--log", "log_path", required=True, help="absolute path of the job log")
@click.option("--reservation", default=None)
@click.option("--partition", default=None)
@click.option("--time-limit", type=int, default=None, help="minutes [default: policy]")
@click.option("--small", is_flag=True, help="short settings (demo/tests)")
@click.pass_context
def render(
    ctx: click.Context,
    kind: Literal["node", "pair"],
    nodes: str,
    out_path: str,
    log_path: str,
    reservation: str | None,
    partition: str | None,
    time_limit: int | None,
    small: bool,
) -> None:
    """Print the sbatch script of a sweep job."""
    spec = SweepJobSpec(
        kind=kind,
        nodes=tuple(n for n in nodes.split(",") if n),
        out_path=out_path,
        log_path=log_path,
        time_limit_min=time_limit,
        reservation=reservation,
        partition=partition,
        extra_args=small_workload_args() if small else (),
    )
    sys.stdout.write(render_sweep_script(spec, _policy(ctx).sweeps))


@sweep.command("schedule")
@click.argument("topology", type=click.Choice(["ring", "tree"]))
@click.argument("ranks", type=click.IntRange(min=1, max=100000))
def schedule(topology: str, ranks: int) -> None:
    """Print the O(1) link-validation passes of a ring or tree over RANKS nodes."""
    for i, p in enumerate(passes_for(topology, ranks)):  # type: ignore[arg-type]
        click.echo(f"pass {i}: " + " ".join(f"{s}->{d}" for s, d in p))


# ---------------------------------------------------------------- scheduling (issue 6)
def _scheduler(ctx: click.Context, dry_run: bool = False) -> tuple[AppContext, SweepScheduler]:
    from slurmguard.context import app_context
    from slurmguard.respond.actions import ActionExecutor, unsettled_after
    from slurmguard.sweeps.scheduler import build_scheduler

    app = app_context(ctx)
    pol = app.policy
    executor = ActionExecutor(
        app.slurm,
        app.store,
        actor="slurmguard",
        dry_run=dry_run or pol.safety.dry_run,
        unsettled_s=unsettled_after(pol.slurm),
    )
    return app, build_scheduler(
        policy=pol, store=app.store, slurm=app.slurm, clock=app.clock, executor=executor
    )


def _print_tick(res: TickResult, verbose: bool) -> None:
    for line in res.done:
        click.echo(line)
    for s in res.steps:
        shown = any(line.startswith(f"{s.node}:") for line in res.done)
        if (verbose or s.action not in ("wait", "blocked")) and not shown:
            click.echo(f"{s.node}: {s.action}: {s.why}")
    for e in res.errors:
        click.echo(f"error: {e}", err=True)


@sweep.command("scheduler")
@click.option("--once", is_flag=True, help="one tick, then exit (cron, debugging)")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=None,
    help="seconds between ticks [default: controller.cycle_interval_s]",
)
@click.option("--dry-run", is_flag=True, help="decide and print, change nothing")
@click.option("-v", "--verbose", is_flag=True, help="also print nodes that are only waiting")
@click.pass_context
def scheduler_cmd(
    ctx: click.Context, once: bool, interval: float | None, dry_run: bool, verbose: bool
) -> None:
    """Quarantine, sweep and gate drained nodes without the controller (one tick per cycle).

    The controller runs the same scheduler every cycle; run this only where the controller
    runs with --no-sweeps. Exit status 1 when a tick reported errors (--once)."""
    import signal
    import threading

    from slurmguard.slurm.errors import SlurmError

    app, sched = _scheduler(ctx, dry_run)
    if once:
        res = sched.tick()
        _print_tick(res, verbose or dry_run)
        ctx.exit(1 if res.errors else 0)
    period = interval or app.policy.controller.cycle_interval_s
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        try:
            _print_tick(sched.tick(), verbose)
        except SlurmError as exc:  # slurmctld away: say so and try again next cycle
            click.echo(f"error: {exc}", err=True)
        stop.wait(period)


@sweep.command("status")
@click.option("--all", "show_all", is_flag=True, help="also nodes that are healthy")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status_cmd(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Nodes under verification: lifecycle, the sweeps of this episode, the triage rung."""
    from slurmguard.context import app_context
    from slurmguard.store import NodeState
    from slurmguard.sweeps.episode import load_episode
    from slurmguard.sweeps.records import outcome_of

    app = app_context(ctx)
    rows: list[dict[str, Any]] = []
    for r in app.store.list_nodes():
        if r.state is NodeState.HEALTHY and not show_all:
            continue
        ep = load_episode(app.store, r.name)
        sweeps = [
            {
                "id": s.id,
                "kind": s.kind.value,
                "job": s.slurm_job_id,
                "reference": s.reference_node,
                "outcome": outcome_of(s) or "pending",
                "reason": s.failure_reason or (s.metrics or {}).get("reason"),
            }
            for s in ep.sweeps
        ]
        a = ep.last_action
        rows.append(
            {
                "node": r.name,
                "state": r.state.value,
                "hw_class": r.hw_class,
                "since": r.state_since.isoformat(),
                "rolling": ep.rolling,
                "sweeps": sweeps,
                "triage": None
                if a is None
                else {"rung": a.rung.value, "status": a.status.value, "detail": a.detail},
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo("no node under verification")
    for row in rows:
        tri = row["triage"]
        click.echo(
            f"{row['node']}: {row['state']} since {row['since'][:19]}"
            + (" (rolling sweep)" if row["rolling"] else "")
            + (f"; triage {tri['rung']} {tri['status']}" if tri else "")
        )
        for s in row["sweeps"]:
            ref = f" vs {s['reference']}" if s["reference"] else ""
            job = f" job {s['job']}" if s["job"] else ""
            click.echo(
                f"  {s['kind']} sweep {s['id']}{ref}{job}: {s['outcome']}"
                + (f": {s['reason']}" if s["reason"] and s["outcome"] != "pass" else "")
            )


@sweep.command("baseline")
@click.option(
    "--refresh",
    is_flag=True,
    help="sweep idle healthy nodes now to seed or refresh the baselines (unsuspected"
    " sweeps, returned when they pass)",
)
@click.option("--class", "klass", default=None, help="only this hardware class")
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="nodes per class to sweep [default: bootstrap_min_nodes]",
)
@click.option(
    "--wait",
    is_flag=True,
    help="with --refresh: run the scheduler here until those nodes are back (only where"
    " no controller runs the scheduler)",
)
@click.option("--timeout", type=float, default=3600.0, show_default=True, help="--wait limit, seconds")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def baseline_cmd(
    ctx: click.Context,
    refresh: bool,
    klass: str | None,
    count: int | None,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Class baselines (healthy nodes whose last sweep passed, within baseline_max_age_h)
    and, with --refresh, sweeps that seed or refresh them on demand."""
    import time

    from slurmguard.store import NodeState

    if wait and not refresh:
        raise click.UsageError("--wait goes with --refresh")
    if refresh:
        app, sched = _scheduler(ctx)
        res = sched.start_baseline_sweeps(klass, count)
        _print_tick(res, True)
        started = [line.split(":")[0] for line in res.done]
        if wait and started and not sched.dry_run:
            deadline = time.monotonic() + timeout
            period = app.policy.controller.cycle_interval_s
            while time.monotonic() < deadline:
                _print_tick(sched.tick(), False)
                if all(
                    (rec := app.store.get_node(n)) is not None and rec.state is not NodeState.QUARANTINED
                    for n in started
                ):
                    break
                time.sleep(period)
            else:
                raise click.ClickException(
                    f"baseline sweeps of {', '.join(started)} not done in {timeout:g}s"
                )
        if res.errors and not started:
            ctx.exit(1)
    rows = baseline_rows(ctx, klass)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo(
            "no passed sweep of a healthy node yet: no class baseline (a drained node is judged"
            " against same-window peers or the policy floor)"
        )
    for row in rows:
        state = "ok" if row["fresh_nodes"] >= row["needed"] else "too few nodes"
        click.echo(
            f"{row['hw_class']} {row['kind']}: {row['fresh_nodes']}/{row['needed']} nodes ({state})"
            + (
                f"; newest {row['newest_age_h']:.1f} h, first expiry in {row['expires_in_h']:.1f} h"
                if row["fresh_nodes"]
                else ""
            )
            + (f"; {row['expired_nodes']} expired" if row["expired_nodes"] else "")
            + (f": {', '.join(row['nodes'])}" if row["nodes"] else "")
        )


def baseline_rows(ctx: click.Context, klass: str | None = None) -> list[dict]:
    """Per hardware class and sweep kind: the healthy nodes behind its baseline and their age."""
    from slurmguard.context import app_context
    from slurmguard.store import NodeState
    from slurmguard.sweeps import records as rec

    app = app_context(ctx)
    pol = app.policy.sweeps
    now = app.clock.now()
    healthy = {r.name for r in app.store.list_nodes(NodeState.HEALTHY)}
    pool = [
        s
        for s in app.store.sweeps(limit=5000)
        if s.node in healthy and (klass is None or s.hw_class == klass)
    ]
    max_age = pol.baseline_max_age_h * 3600.0
    groups: dict[tuple[str, str], list] = {}
    for r in rec.healthy_results(pool):
        groups.setdefault((r.hw_class, r.kind), []).append(r)
    rows: list[dict[str, Any]] = []
    for (k, kind), results in sorted(groups.items()):
        fresh = [r for r in results if now - r.finished <= max_age]
        rows.append(
            {
                "hw_class": k,
                "kind": kind,
                "needed": pol.bootstrap_min_nodes,
                "fresh_nodes": len(fresh),
                "expired_nodes": len(results) - len(fresh),
                "nodes": sorted(r.node_under_test for r in fresh),
                "newest_age_h": min((now - r.finished for r in fresh), default=0.0) / 3600.0,
                "expires_in_h": min((max_age - (now - r.finished) for r in fresh), default=0.0) / 3600.0,
            }
        )
    return rows
