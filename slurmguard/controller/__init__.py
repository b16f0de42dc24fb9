"""The controller daemon: fleet model, decisions, actions (`slurmguard controller`)."""

from __future__ import annotations

import logging

import click


@click.command("controller")
@click.option("--listen", default=None, help="HOST:PORT (default controller.listen_host/port).")
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False),
              help="Shared secret of the agents (default controller.secret_file).")
@click.option("--interval", type=float, default=None, help="Seconds between cycles.")
@click.option("--dry-run", is_flag=True, help="Log and audit every action instead of taking it.")
@click.option("--once", is_flag=True, help="Run one cycle and exit.")
@click.option("--no-sweeps", is_flag=True, help="Do not run the sweep scheduler.")
@click.option("-v", "--verbose", count=True)
@click.pass_context
def controller_cmd(ctx: click.Context, listen: str | None, secret_file: str | None,
                   interval: float | None, dry_run: bool, once: bool, no_sweeps: bool,
                   verbose: int) -> None:
    """Run the controller: ingest agent reports, decide, act on Slurm."""
    from slurmguard.context import app_context
    from slurmguard.controller.daemon import DaemonOptions, run
    from slurmguard.reports import read_secret

    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    secret = read_secret(secret_file or policy.controller.secret_file)
    store = app.store
    opts = DaemonOptions(host=host, port=port, secret=secret,
                         interval_s=interval or policy.controller.cycle_interval_s, once=once,
                         sweeps=not no_sweeps)
    raise SystemExit(run(policy, store, app.slurm, opts, clock=app.clock))
