"""`slurmguard demo`: the closed loop on the embedded default.

A local 4-node Slurm cluster with the SPANK plugin and prolog/epilog, one
agent per node (sim telemetry), the controller on SQLite; a guarded 2-node
torch training job (slurmguard.workloads, DDP by default, gloo on CPU); a
fail-slow injected on one node from outside the job (its slurmd and job
processes capped in a cgroup to a fraction of a CPU and, in the sim telemetry,
the matching thermal throttling). It prints what happened: detection, the
drain reason, the requeue, the job finishing on healthy nodes, then the
sweeps that verify the drained node.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import click

from slurmguard.workloads import SHAPES
from slurmguard_dev.devcluster import ClusterSpec, DevCluster
from slurmguard_dev.devcluster.cluster import DEFAULT_STATE_DIR
from slurmguard_dev.devcluster.scenario import SEVERE


@click.command()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE_DIR,
    show_default=True,
)
@click.option(
    "--workload",
    type=click.Choice(SHAPES),
    default="ddp",
    show_default=True,
    help="The training job's parallel shape (slurmguard.workloads).",
)
@click.option(
    "--factor",
    type=float,
    default=SEVERE,
    show_default=True,
    help="How much slower the faulted node's steps get (the CPU cap is calibrated "
    "to it from the job's measured CPU use).",
)
@click.option(
    "--sweep-wait",
    type=float,
    default=180.0,
    show_default=True,
    help="Seconds to wait for the drained node's sweeps (0: don't wait).",
)
@click.option("--down", "stop_after", is_flag=True, help="Stop the cluster at the end.")
def demo(state_dir: Path, workload: str, factor: float, sweep_wait: float, stop_after: bool) -> None:
    """Run the online loop end to end on a local cluster and show what happened."""
    from slurmguard_dev.devcluster.guard import Guard
    from slurmguard_dev.devcluster.scenario import Scenario

    cluster = DevCluster(ClusterSpec(state_dir=state_dir, nodes=4))
    if cluster.is_running():
        click.echo(f"stopping the previous development cluster in {state_dir}")
        cluster.down()
    t0 = time.monotonic()
    cluster.up()
    step = _Steps()
    step(f"local Slurm cluster up: {', '.join(cluster.node_names)} (SLURM_CONF={cluster.conf_path})")
    try:
        guard = Guard(cluster).start(fresh=True)
        step(
            f"slurmguard up: SPANK plugin in plugstack.conf, prolog/epilog, controller "
            f"{guard.controller_url} on {guard.db_url}, 4 agents (sim telemetry)"
        )
        if sweep_wait > 0:
            seeded = guard.bootstrap_sweeps()
            step(
                f"sweep baselines seeded by rolling sweeps of unsuspected {', '.join(seeded)} "
                f"(1-node and 2-node, CPU path)"
            )
        res = Scenario(guard, say=step, workload=workload).run(factor=factor)
        if sweep_wait > 0:
            _wait_sweeps(cluster, guard, res.slow_node, sweep_wait, step)
        step("the fleet now:")
        _cli(guard, cluster, "nodes")
        _cli(guard, cluster, "triage", "report", "--format", "table")
        click.echo(
            f"\nSummary: {res.slow_node} capped at {res.cap_percent:.0f}% of a CPU at iteration "
            f"{res.inject_index} (steps {res.achieved_factor:.2f}x slower); "
            f"drained after {res.detection_delay_s:.1f}s ({res.iterations_to_drain} iterations); "
            f"job {res.job} requeued and {res.final_state.lower()} on {', '.join(res.final_nodes)}. "
            f"Total {time.monotonic() - t0:.0f}s."
        )
    except BaseException:
        click.echo(f"demo failed; logs in {cluster.log_dir}", err=True)
        cluster.down()
        raise
    if stop_after:
        cluster.down()
        click.echo("cluster stopped")
    else:
        click.echo(
            f"\nThe cluster keeps running: {cluster.export_line()}\n"
            f"  slurmguard --policy {guard.policy_path} triage report\n"
            f"  slurmguard devcluster down --state-dir {state_dir}"
        )


class _Steps:
    def __init__(self) -> None:
        self.n = 0
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        self.n += 1
        click.echo(f"[{time.monotonic() - self.t0:6.1f}s] {text}")


def _cli(guard, cluster, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "slurmguard.cli", "--policy", str(guard.policy_path), *args],
        env=cluster.env,
        timeout=120,
        check=False,
    )


def _wait_sweeps(cluster, guard, node: str, timeout: float, say) -> None:
    from slurmguard.store import Store

    say(
        f"{node} is drained and idle: the sweep scheduler quarantines it and runs its 1-node and "
        f"2-node sweeps"
    )
    deadline = time.monotonic() + timeout
    seen: set[tuple] = set()
    state = None
    while time.monotonic() < deadline:
        with Store.open(guard.db_url) as store:
            rec = store.get_node(node)
            state = str(rec.state) if rec else None
            for sw in store.sweeps(node=node):
                key = (sw.id, str(sw.verdict))
                if key not in seen and str(sw.verdict) != "pending":
                    seen.add(key)
                    say(
                        f"sweep {sw.kind} of {node} (job {sw.slurm_job_id}): {sw.verdict}"
                        + (f" - {sw.failure_reason}" if sw.failure_reason else "")
                    )
        if state in ("healthy", "terminal"):
            break
        time.sleep(2)
    say(f"{node} lifecycle: {state}")
