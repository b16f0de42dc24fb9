"""`slurmguard bench ...`: each benchmark prints its figure and the baseline
measured in the same run. One module per area of the product it measures (named by the
bench: detect, hook, loop = the online loop of respond/controller, prolog = nodecheck...)."""

from __future__ import annotations

import click

from slurmguard.cli import LazyGroup

BENCHES = {
    "detect": "slurmguard_dev.bench.detect:bench_detect",
    "hook": "slurmguard_dev.bench.hook:bench_hook",
    "whatif": "slurmguard_dev.bench.whatif:bench_whatif",
    "plan": "slurmguard_dev.bench.plan:bench_plan",
    "sweeps": "slurmguard_dev.bench.sweeps:bench_sweeps",
    "loop": "slurmguard_dev.bench.loop:bench_loop",
    "prolog": "slurmguard_dev.bench.prolog:bench_prolog",
    "agent": "slurmguard_dev.bench.agent:bench_agent",
    "scale": "slurmguard_dev.bench.scale:bench_scale",
}

BENCH_HELP = {
    "detect": "Detector accuracy, detection delay and throughput vs. baselines.",
    "hook": "Per-call cost of the NCCL hook and guarded step-time overhead.",
    "whatif": "What-if simulator time on the shared traces.",
    "plan": "Micro-batch planner: exact algorithm vs. cvxpy MILP.",
    "sweeps": "Time and node-hours to verify and return a drained node.",
    "loop": "Detection delay of the online loop on the local cluster.",
    "prolog": "Prolog wall time, hung-NVML bound, epilog archive time.",
    "agent": "CPU and RSS of a node agent watching 8 busy rings vs an idle agent.",
    "scale": "Controller cycle, ingestion, memory at 100-10,000 nodes vs the previous release.",
}


class _BenchGroup(LazyGroup):
    commands_map = BENCHES
    help_map = BENCH_HELP


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmarks that print their figures with a baseline from the same run."""
