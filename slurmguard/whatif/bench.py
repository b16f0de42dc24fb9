"""`slurmguard bench whatif`: time of the what-if analysis on the shared traces.

For each trace (AR, SE, ST) it prints: the time to load and check it (the
floor any analysis pays), the full vectorised analysis (every simulation the
report needs), one vectorised simulation of all steps, and the baseline
measured in the same run: one simulation by the per-op Python event loop,
and that cost times the number of simulations the analysis ran. A scale
case tiles ST's DP ranks into a job of `--scale-workers` workers and times
load + analysis.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import click
import numpy as np
import pandas as pd

from slurmguard.errors import InputError

TRACES_ENV = "SLURMGUARD_WHATIF_TRACES"
"""Environment variable naming the trace directory when --traces is not given (no default:
the traces are data, not part of an install)."""


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        c = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - c)
    return best, out


def tile_dp(
    df: pd.DataFrame, dp: int, pp: int, copies: int, seed: int = 0
) -> pd.DataFrame:
    """A trace with `copies` x dp DP ranks: each copy's compute ops scaled by a small random factor."""
    rng = np.random.default_rng(seed)
    parts = []
    comp = (
        df["optype"]
        .astype(str)
        .isin(("forward-compute", "backward-compute"))
        .to_numpy()
    )
    for c in range(copies):
        part = df.copy()
        new_dp = part["dp_rank"].to_numpy() + c * dp
        part["dp_rank"] = new_dp
        part["rank"] = part["stage"].to_numpy() * dp * copies + new_dp
        factor = rng.uniform(0.98, 1.02, size=len(part))
        part["duration"] = np.where(
            comp, part["duration"].to_numpy() * factor, part["duration"].to_numpy()
        )
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


@click.command("whatif")
@click.option(
    "--traces",
    "traces_dir",
    type=click.Path(file_okay=False),
    envvar=TRACES_ENV,
    default=None,
    help=f"Directory with trace-{{AR,SE,ST}}.parquet and meta-*.yaml [default: ${TRACES_ENV}].",
)
@click.option(
    "--repeat",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs per timing; the best is reported.",
)
@click.option(
    "--naive/--no-naive",
    default=True,
    show_default=True,
    help="Also time the per-op Python event loop baseline.",
)
@click.option(
    "--scale-workers",
    default=4096,
    show_default=True,
    type=click.IntRange(min=0),
    help="Workers of the tiled scale case (0 skips it).",
)
def bench_whatif(traces_dir: str | None, repeat: int, naive: bool, scale_workers: int) -> None:
    """Time the what-if analysis on the three shared traces, against the naive event loop."""
    from dataclasses import replace

    from slurmguard.config import WhatIfPolicy
    from slurmguard.whatif.analysis import analyse, simulation_durations
    from slurmguard.whatif.model import build_model
    from slurmguard.whatif.simulate import simulate, simulate_naive
    from slurmguard.whatif.tensor import tensorize
    from slurmguard.whatif.trace import check_trace, load_trace

    if not traces_dir:
        raise InputError(
            f"no trace directory: pass --traces DIR or set ${TRACES_ENV} "
            f"(a directory with trace-{{AR,SE,ST}}.parquet and meta-{{AR,SE,ST}}.yaml)"
        )
    base = Path(traces_dir)
    if not base.is_dir():
        raise InputError(f"{base}: trace directory not found (use --traces)")
    policy = WhatIfPolicy()
    click.echo(
        f"{'trace':<6}{'ops':>9}{'workers':>8}{'load s':>9}{'analysis s':>12}{'sims':>6}"
        f"{'1 sim s':>9}{'naive 1 sim s':>15}{'naive est. s':>14}{'speedup':>9}   S / M_W / M_S"
    )
    for name in ("AR", "SE", "ST"):
        trace, meta_path = base / f"trace-{name}.parquet", base / f"meta-{name}.yaml"
        t_load, (df, meta) = _best(partial(load_trace, trace, meta_path), repeat)
        t_tens, t = _best(partial(tensorize, df, meta, name), repeat)
        t_an, r = _best(partial(analyse, t, policy), repeat)
        model = build_model(t)
        dur = simulation_durations(t, model)
        t_one, _ = _best(partial(simulate, model, dur[:, None]), repeat)
        line = (
            f"{name:<6}{len(df):>9}{meta.workers:>8}{t_load + t_tens:>9.3f}{t_an:>12.3f}"
            f"{r.simulations:>6}{t_one:>9.4f}"
        )
        if naive:
            t_naive, _ = _best(partial(simulate_naive, model, dur), 1)
            est = t_naive * r.simulations
            line += f"{t_naive:>15.3f}{est:>14.1f}{est / t_an:>8.0f}x"
        else:
            line += f"{'-':>15}{'-':>14}{'-':>9}"
        click.echo(line + f"   {r.slowdown:.3f} / {r.mw:.3f} / {r.ms:.3f}")
    if scale_workers:
        df, meta = load_trace(base / "trace-ST.parquet", base / "meta-ST.yaml")
        copies = max(1, scale_workers // meta.workers)
        big = tile_dp(df, meta.dp_size, meta.pp_size, copies)
        big_meta = replace(
            meta,
            dp_size=meta.dp_size * copies,
            world_size=meta.world_size * copies,
            name=f"ST x{copies}",
        )
        c0 = time.perf_counter()
        checked = check_trace(big, big_meta, "tiled ST", "tiled meta")
        t = tensorize(checked, big_meta, "tiled ST")
        c1 = time.perf_counter()
        r = analyse(t, policy)
        c2 = time.perf_counter()
        click.echo(
            f"scale: ST tiled to dp={big_meta.dp_size} x pp={big_meta.pp_size} = {big_meta.workers}"
            f" workers, {len(big)} ops, {len(t.steps)} steps: check+tensorize {c1 - c0:.2f} s,"
            f" analysis {c2 - c1:.2f} s ({r.simulations} simulations), S={r.slowdown:.3f},"
            f" pattern {r.diagnosis.pattern}"
        )
