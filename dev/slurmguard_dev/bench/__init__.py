"""`slurmguard bench ...`: each benchmark prints its figure and the baseline
measured in the same run. The benchmarks live with the code they measure."""

from __future__ import annotations

import click

from slurmguard.cli import LazyGroup

BENCHES = {
    "detect": "slurmguard.detect.bench:bench_detect",
    "hook": "slurmguard.hook.bench:bench_hook",
    "whatif": "slurmguard.whatif.bench:bench_whatif",
    "plan": "slurmguard.mitigate.bench:bench_plan",
    "sweeps": "slurmguard.sweeps.bench:bench_sweeps",
    "loop": "slurmguard.respond.bench:bench_loop",
    "prolog": "slurmguard.nodecheck.bench:bench_prolog",
    "agent": "slurmguard.agent.bench:bench_agent",
    "scale": "slurmguard.controller.scale_bench:bench_scale",
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
