"""`slurmguard devcluster up|down|status|env|fault`"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from slurmguard_dev.devcluster.cluster import DEFAULT_STATE_DIR, ClusterSpec, DevCluster

_state_dir = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE_DIR,
    show_default=True,
    help="Where the cluster keeps conf, spools, logs and pids ($SLURMGUARD_DEVCLUSTER_DIR).",
)


@click.group()
def devcluster() -> None:
    """Run a real multi-node Slurm cluster on this machine (needs root)."""


@devcluster.command()
@_state_dir
@click.option("--nodes", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--partition", default="debug", show_default=True)
@click.option("--cpus-per-node", default=2, show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--guard",
    is_flag=True,
    help="Also install the SPANK plugin and prolog/epilog and start the controller "
    "(SQLite) and one agent per node (sim telemetry).",
)
@click.option("--restd", is_flag=True, help="Also enable JWT auth and run slurmrestd on a loopback port.")
def up(state_dir: Path, nodes: int, partition: str, cpus_per_node: int, guard: bool, restd: bool) -> None:
    """Start munged, slurmctld and NODES slurmd; wait until all nodes are idle."""
    c = DevCluster(
        ClusterSpec(
            state_dir=state_dir, nodes=nodes, partition=partition, cpus_per_node=cpus_per_node, restd=restd
        )
    )
    c.up()
    if guard:
        from slurmguard_dev.devcluster.guard import Guard

        try:
            g = Guard(c).start()
        except BaseException:
            c.down()
            raise
        click.echo(
            f"slurmguard: controller {g.controller_url}, agents on {', '.join(c.node_names)}, "
            f"database {g.db_url}, policy {g.policy_path}"
        )
        click.echo("submit guarded jobs with: sbatch --straggler-guard ...")
    click.echo(f"development cluster up: {nodes} nodes ({', '.join(c.node_names)}) in partition {partition}")
    click.echo(f"SLURM_CONF={c.conf_path}")
    if restd:
        click.echo(
            f"slurmrestd {c.restd_url} (JWT key {c.jwt_key_path}); policy: slurm.backend: "
            f"restd, restd_url: {c.restd_url}, restd_jwt_key_file: {c.jwt_key_path}"
        )
    click.echo(f"use it with: eval $(slurmguard devcluster env --state-dir {state_dir})")


@devcluster.command()
@_state_dir
def down(state_dir: Path) -> None:
    """Stop the cluster's jobs and daemons (only the processes it started)."""
    c = DevCluster(ClusterSpec(state_dir=state_dir))
    if not (state_dir / "state.json").exists():
        click.echo(f"no development cluster in {state_dir}")
        return
    c.down()
    click.echo("development cluster stopped")


@devcluster.command()
@_state_dir
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(state_dir: Path, as_json: bool) -> None:
    """Show daemons, node states and the SLURM_CONF path."""
    st = DevCluster(ClusterSpec(state_dir=state_dir)).status()
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    if "slurm_conf" not in st:
        click.echo(f"no development cluster in {state_dir}")
        raise SystemExit(1)
    click.echo(f"running: {'yes' if st['running'] else 'no'}")
    click.echo(f"SLURM_CONF={st['slurm_conf']}")
    for name, d in st["daemons"].items():
        click.echo(f"  {name:<14} pid {d['pid']:<8} {'alive' if d['alive'] else 'stopped'}")
    for node, state in st["nodes"].items():
        click.echo(f"  {node:<14} {state}")
    if not st["running"]:
        raise SystemExit(1)


@devcluster.command()
@_state_dir
def env(state_dir: Path) -> None:
    """Print `export SLURM_CONF=...` for this cluster (use with eval), and
    `export SLURMGUARD_POLICY=...` when it was started with --guard, so that
    `slurmguard incidents`, `nodes` and `triage report` read its database."""
    c = DevCluster(ClusterSpec(state_dir=state_dir))
    if not c.conf_path.exists():
        raise click.ClickException(f"no development cluster in {state_dir}; run `slurmguard devcluster up`")
    click.echo(c.export_line())
    policy = state_dir / "policies.yaml"
    if policy.exists():
        click.echo(f"export SLURMGUARD_POLICY={shlex.quote(str(policy))}")


@devcluster.command()
@_state_dir
@click.argument("node")
@click.option(
    "--cpu",
    "percent",
    type=float,
    default=None,
    metavar="PERCENT",
    help="Cap the node's slurmd and all its job-step processes at PERCENT of one CPU "
    "(e.g. 30); steps started later inherit the cap.",
)
@click.option("--clear", is_flag=True, help="Remove the node's fault.")
def fault(state_dir: Path, node: str, percent: float | None, clear: bool) -> None:
    """Slow NODE from outside its jobs (a cgroup CPU cap), or --clear it.

    The jobs are not told: their ranks on NODE just get less CPU, like a GPU
    node held back by a thermal or power limit. `devcluster down` clears all.
    """
    from slurmguard_dev.devcluster.fault import apply_cpu_cap, clear_fault

    if (percent is None) == (not clear):
        raise click.UsageError("give exactly one of --cpu PERCENT or --clear")
    c = DevCluster(ClusterSpec(state_dir=state_dir))
    if not (state_dir / "state.json").exists():
        raise click.ClickException(f"no development cluster in {state_dir}")
    if clear:
        done = clear_fault(c, node)
        click.echo(f"{node}: fault cleared" if done else f"{node}: no fault to clear")
        return
    cap = apply_cpu_cap(c, node, percent)  # type: ignore[arg-type]
    click.echo(
        f"{node}: slurmd and {cap.moved - 1} job-step processes capped at {cap.percent:g}% "
        f"of one CPU (cgroup v{cap.version} {cap.cgroup})"
    )
