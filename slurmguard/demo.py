"""`slurmguard demo`: the main job on the embedded default (local cluster, SQLite)."""

from __future__ import annotations

from pathlib import Path

import click

from slurmguard.context import app_context
from slurmguard.devcluster import ClusterSpec, DevCluster
from slurmguard.devcluster.cluster import DEFAULT_STATE_DIR


@click.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_STATE_DIR, show_default=True)
@click.option("--nodes", "n_nodes", default=4, show_default=True, type=click.IntRange(2, 16))
@click.pass_context
def demo(ctx: click.Context, state_dir: Path, n_nodes: int) -> None:
    """Start the local cluster, create the database, register and show the fleet."""
    from slurmguard.slurm.cli import nodes
    from slurmguard.slurm.commands import CommandSlurmClient
    from slurmguard.store import Store, db

    cluster = DevCluster(ClusterSpec(state_dir=state_dir, nodes=n_nodes))
    if cluster.is_running():
        click.echo(f"stopping the previous development cluster in {state_dir}")
        cluster.down()
    cluster.up()
    click.echo(f"[1/3] local Slurm cluster up: {', '.join(cluster.node_names)} "
               f"(SLURM_CONF={cluster.conf_path})")
    app = app_context(ctx)
    url = app.db_url
    rev = db.upgrade(url)
    click.echo(f"[2/3] database ready: {db.mask_url(url)} (revision {rev})")
    import os

    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    slurm = CommandSlurmClient(timeout_s=app.policy.slurm.command_timeout_s)
    with Store.open(url) as store:
        for n in slurm.nodes():
            store.get_or_create_node(n.name, partitions=list(n.partitions))
    click.echo("[3/3] fleet as Slurm and slurmguard see it:")
    ctx.invoke(nodes, fmt="table")
    click.echo(f"\nThe cluster keeps running. Use it with: {cluster.export_line()}\n"
               f"Stop it with: slurmguard devcluster down --state-dir {state_dir}")
