"""The node agent (`slurmguard agent`)."""

from __future__ import annotations

import json
import os
import socket
from typing import TYPE_CHECKING

import click

from slurmguard.service import setup_logging

if TYPE_CHECKING:
    from slurmguard.agent.analysis import RankAnalyzer
    from slurmguard.agent.rings import RingTracker
    from slurmguard.telemetry import TelemetrySource


@click.command("agent")
@click.option(
    "--node",
    default=None,
    help="Slurm node name this agent serves (default $SLURMD_NODENAME or the short hostname).",
)
@click.option(
    "--controller", "controller_url", default=None, help="Controller URL (default agent.controller_url)."
)
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False))
@click.option("--ring-root", default=None, help="Ring directory root (default agent.ring_root).")
@click.option(
    "--telemetry",
    "source_kind",
    default=None,
    type=click.Choice(["sim", "nvml", "dcgm", "prometheus", "none"]),
)
@click.option(
    "--sim-profiles",
    default=None,
    help='Sim fault profiles as JSON, e.g. \'{"node2": "thermal_throttle"}\' '
    "(or @FILE); $SLURMGUARD_SIM_PROFILES otherwise.",
)
@click.option("--once", is_flag=True, help="Send one report and exit.")
@click.option("-v", "--verbose", count=True)
@click.pass_context
def agent_cmd(
    ctx: click.Context,
    node: str | None,
    controller_url: str | None,
    secret_file: str | None,
    ring_root: str | None,
    source_kind: str | None,
    sim_profiles: str | None,
    once: bool,
    verbose: int,
) -> None:
    """Run the node agent: rings -> step times and changes, telemetry -> reports."""
    from slurmguard.agent.daemon import Agent, run
    from slurmguard.agent.sender import ReportSender
    from slurmguard.context import app_context
    from slurmguard.errors import ConfigError
    from slurmguard.telemetry import open_source
    from slurmguard.wire import read_secret

    setup_logging(verbose)
    app = app_context(ctx)
    p = app.policy.agent
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    kind = source_kind or p.telemetry_source
    kw: dict = {"clock": app.clock}
    spec = sim_profiles or os.environ.get("SLURMGUARD_SIM_PROFILES")
    source: TelemetrySource | None = None
    if kind == "sim" and spec and spec.startswith("@"):
        from slurmguard.agent.simfile import SimFromFile

        source = SimFromFile(spec[1:], node, app.clock)  # follows edits of the file
    elif kind == "sim":
        profiles = None
        if spec:
            try:
                profiles = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--sim-profiles: not JSON: {exc}") from None
            if not isinstance(profiles, dict):
                raise ConfigError("--sim-profiles: expected an object {node: profile}")
            profiles = {n: v for n, v in profiles.items() if n == node}
        kw["profiles"] = profiles
    if source is None:
        if kind != "sim":
            t = p.telemetry
            kw.update(
                infiniband=t.infiniband,
                ib_root=t.ib_sysfs_root,
                expected_ports=t.ib_expected_ports,
                targets=t.prometheus_targets,
                timeout_s=t.call_timeout_s,
            )
        source = open_source(kind, node, **kw)
    key = read_secret((secret_file or p.secret_file).replace("{node}", node), "node key")
    senders = [
        ReportSender(
            url,
            key,
            timeout_s=p.request_timeout_s,
            max_reports=p.buffer_max_reports,
            now=app.clock.now,
            ca_file=p.tls_ca_file,
        )
        for url in [controller_url or p.controller_url, *p.also_report_to]
    ]
    agent = Agent(
        node=node,
        policy=app.policy,
        sender=senders[0],
        also=senders[1:],
        source=source,
        clock=app.clock,
        ring_root=ring_root,
        slurm=app.slurm,
    )
    raise SystemExit(run(agent, once=once))


@click.command("iterations")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option(
    "--csv", "as_csv", is_flag=True, help="One row per iteration: node,rank,end_unix,step_s,compute_s."
)
@click.pass_context
def iterations_cmd(ctx: click.Context, paths: tuple[str, ...], as_csv: bool) -> None:
    """The iterations the agent derives from rings (ring files, or directories of
    them: a job's ring directory, an epilog archive), per rank: how many, the
    median step and compute time (step minus time inside collectives), the
    collectives per iteration and the role, read as the agent reads them while
    the job runs (RankAnalyzer.derive, at the policy's agent.report_interval_s).
    What slurmguard sees of a job, to compare with the job's own step log."""
    from slurmguard.agent.analysis import RankAnalyzer
    from slurmguard.agent.rings import RingTracker
    from slurmguard.context import app_context

    policy = app_context(ctx).policy
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".ring"))
        else:
            files.append(p)
    if not files:
        raise click.ClickException(f"no ring files (*.ring) in {', '.join(paths)}")
    if as_csv:
        click.echo("node,rank,end_unix,step_s,compute_s")
    for path in files:
        tracker = RingTracker(os.path.dirname(path) or ".", "", lambda: {}, max_ops=1 << 22)
        try:
            _print_iterations(path, tracker, RankAnalyzer(policy.agent, policy.detection), as_csv)
        finally:
            tracker.close()


def _print_iterations(path: str, tracker: RingTracker, an: RankAnalyzer, as_csv: bool) -> None:
    """One ring's iterations as `slurmguard iterations` prints them."""
    import numpy as np

    from slurmguard.hook.ring import RingError

    try:
        tr = tracker.inspect(path)
    except (RingError, OSError) as exc:
        raise click.ClickException(f"{path}: not a readable ring ({exc})") from None
    # every iteration the ring holds, as an agent's first look; an.structure, an.total_steps with them
    steps = an.derive(tr)
    h = tr.header
    if as_csv:
        for st in steps:
            click.echo(
                f"{h.node_name},{h.global_rank},{st.end:.6f},{st.step_s:.6f},{st.step_s - st.comm_s:.6f}"
            )
        return
    bad = f", {tr.corrupt} corrupt record(s) skipped" if tr.corrupt else ""
    if not steps:
        click.echo(f"{path}: node {h.node_name} rank {h.global_rank}: no iteration found{bad}")
        return
    step = np.array([st.step_s for st in steps])
    comp = step - np.array([st.comm_s for st in steps])
    period, role = an.structure or (None, None)
    click.echo(
        f"{path}: node {h.node_name} rank {h.global_rank}: {an.total_steps} iterations "
        f"({len(steps)} held), median step {np.median(step) * 1e3:.1f} ms, compute "
        f"{np.median(comp) * 1e3:.1f} ms, {period} collectives per iteration, role {role}{bad}"
    )
