"""The controller daemon: fleet model, decisions, actions (`slurmguard controller`)."""

from __future__ import annotations

import click

from slurmguard.service import setup_logging


@click.command("controller")
@click.option("--listen", default=None, help="HOST:PORT (default controller.listen_host/port).")
@click.option(
    "--secret-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Master secret the node keys derive from (default controller.secret_file).",
)
@click.option("--interval", type=float, default=None, help="Seconds between cycles.")
@click.option("--dry-run", is_flag=True, help="Log and audit every action instead of taking it.")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--no-sweeps", is_flag=True, help="Do not run the sweep scheduler.")
@click.option("-v", "--verbose", count=True)
@click.pass_context
def controller_cmd(
    ctx: click.Context,
    listen: str | None,
    secret_file: str | None,
    interval: float | None,
    dry_run: bool,
    once: bool,
    no_sweeps: bool,
    verbose: int,
) -> None:
    """Run the controller: ingest agent reports, decide, act on Slurm."""
    from slurmguard.context import app_context
    from slurmguard.controller.daemon import DaemonOptions, run, tune_gc
    from slurmguard.wire import read_secret

    setup_logging(verbose)
    app = app_context(ctx)
    policy = app.policy
    if dry_run:
        policy = policy.model_copy(update={"safety": policy.safety.model_copy(update={"dry_run": True})})
    host, port = policy.controller.listen_host, policy.controller.listen_port
    if listen:
        h, _, p = listen.rpartition(":")
        if not h or not p.isdigit():
            raise click.BadParameter("expected HOST:PORT", param_hint="--listen")
        host, port = h, int(p)
    secret = read_secret(secret_file or policy.controller.secret_file, "master secret")
    store = app.store
    opts = DaemonOptions(
        host=host,
        port=port,
        secret=secret,
        interval_s=interval or policy.controller.cycle_interval_s,
        once=once,
        sweeps=not no_sweeps,
    )
    tune_gc()
    raise SystemExit(run(policy, store, app.slurm, opts, clock=app.clock))


@click.group("keys")
def keys() -> None:
    """Per-node report keys (see SECURITY.md)."""


@keys.command("derive")
@click.argument("node")
@click.option(
    "--secret-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Master secret (default controller.secret_file).",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write the key to this file (mode 0600, replaced atomically) instead of stdout.",
)
@click.pass_context
def derive(ctx: click.Context, node: str, secret_file: str | None, output: str | None) -> None:
    """Print NODE's report key: install it on NODE as agent.secret_file (root, 0600).

    The key is HMAC-SHA256(master, node): it lets its holder report for NODE only."""
    import os

    from slurmguard.context import app_context
    from slurmguard.wire import node_key, read_secret

    master = read_secret(secret_file or app_context(ctx).policy.controller.secret_file, "master secret")
    key = node_key(master, node)
    if output is None:
        click.echo(key.decode())
        return
    tmp = f"{output}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, key + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, output)
    click.echo(f"{output}: key of node {node} written (install it on {node} as agent.secret_file)")
