"""`slurmguard bench plan`: exact micro-batch planner vs. the cvxpy MILP.

For each number of DP groups (16, 32, ... doubling) it draws per-micro-batch
times (healthy groups around 1.0 s, one in 16 slowed 1.5-3x, a computation
fail-slow), plans M = groups x per-group micro-batches with both methods, and
prints the time of each, whether their makespans match, and the makespan of the
uniform split the job would otherwise run with. Greyhound Table 5 reports the
paper's cvxpy planner at 0.01 s (16 groups) to 35.93 s (512 groups).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import click
import numpy as np

from slurmguard.errors import InputError
from slurmguard.mitigate.microbatch import makespan, plan_microbatches, uniform_split


def make_times(groups: int, rng: np.random.Generator) -> np.ndarray:
    """Seconds per micro-batch: U(0.9, 1.1), with ceil(groups/16) groups slowed 1.5-3x."""
    t = rng.uniform(0.9, 1.1, groups)
    slow = max(1, groups // 16)
    idx = rng.choice(groups, slow, replace=False)
    t[idx] *= rng.uniform(1.5, 3.0, slow)
    return t


def _time_exact(times: list[float], total: int, pp: int, repeats: int):
    plan = plan_microbatches(times, total, pp)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_microbatches(times, total, pp)
        samples.append(time.perf_counter() - t0)
    return plan, statistics.median(samples)


def run_bench(
    min_groups: int = 16,
    max_groups: int = 1024,
    max_cvxpy_groups: int = 512,
    per_group: int = 8,
    pp: int = 1,
    repeats: int = 20,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per size; times in seconds. ``cvxpy_s`` is None above ``max_cvxpy_groups``."""
    rng = np.random.default_rng(seed)
    if max_cvxpy_groups >= min_groups:
        from slurmguard.mitigate.reference import plan_microbatches_milp

        # Import and first-solve costs of cvxpy are not part of a planning step.
        plan_microbatches_milp([1.0, 2.0], 3 * pp, pp)
    rows: list[dict[str, Any]] = []
    groups = min_groups
    while groups <= max_groups:
        times = make_times(groups, rng).tolist()
        total = groups * per_group * pp
        plan, exact_s = _time_exact(times, total, pp, repeats)
        row: dict[str, Any] = {
            "groups": groups,
            "microbatches": total,
            "exact_s": exact_s,
            "cvxpy_s": None,
            "match": None,
            "makespan": plan.makespan,
            "uniform_makespan": makespan(_uniform(total, groups, pp), times),
        }
        if groups <= max_cvxpy_groups:
            from slurmguard.mitigate.reference import plan_microbatches_milp

            t0 = time.perf_counter()
            ref = plan_microbatches_milp(times, total, pp)
            row["cvxpy_s"] = time.perf_counter() - t0
            row["cvxpy_makespan"] = ref.makespan
            row["match"] = ref.makespan == plan.makespan
        rows.append(row)
        groups *= 2
    return rows


def _uniform(total: int, groups: int, pp: int) -> tuple[int, ...]:
    return tuple(u * pp for u in uniform_split(total // pp, groups))


@click.command("plan")
@click.option("--min-groups", default=16, show_default=True, type=click.IntRange(1))
@click.option("--max-groups", default=1024, show_default=True, type=click.IntRange(1))
@click.option(
    "--max-cvxpy-groups",
    default=512,
    show_default=True,
    type=click.IntRange(0),
    help="Largest size also solved with cvxpy (about 10 s at 512 groups; 0 = none).",
)
@click.option(
    "--per-group",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Micro-batches per DP group (M = groups x this x pp).",
)
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1))
@click.option(
    "--repeats",
    default=20,
    show_default=True,
    type=click.IntRange(1),
    help="Runs of the exact planner per size (median reported).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print rows as JSON.")
def bench_plan(
    min_groups: int,
    max_groups: int,
    max_cvxpy_groups: int,
    per_group: int,
    pp: int,
    repeats: int,
    seed: int,
    as_json: bool,
) -> None:
    """Micro-batch planner: exact algorithm vs. cvxpy MILP (HiGHS), same instances."""
    if min_groups > max_groups:
        raise InputError(f"--min-groups {min_groups} is larger than --max-groups {max_groups}")
    rows = run_bench(min_groups, max_groups, max_cvxpy_groups, per_group, pp, repeats, seed)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(
        f"{'groups':>6} {'M':>6} {'exact ms':>9} {'cvxpy s':>8} {'speedup':>9} {'match':>5} "
        f"{'makespan':>9} {'uniform':>8}"
    )
    for r in rows:
        cv = r["cvxpy_s"]
        cv_txt = f"{cv:8.3f}" if cv is not None else f"{'-':>8}"
        sp = f"{cv / r['exact_s']:8.0f}x" if cv is not None else f"{'-':>9}"
        match = {True: "yes", False: "NO", None: "-"}[r["match"]]
        click.echo(
            f"{r['groups']:>6} {r['microbatches']:>6} {r['exact_s'] * 1e3:9.3f} {cv_txt} {sp} {match:>5} "
            f"{r['makespan']:9.3f} {r['uniform_makespan']:8.3f}"
        )
    mism = [r["groups"] for r in rows if r["match"] is False]
    if mism:
        raise click.ClickException(f"exact and cvxpy makespans differ at {mism} groups")
