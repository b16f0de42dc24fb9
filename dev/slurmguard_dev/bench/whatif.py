"""`slurmguard bench whatif`: time of the what-if analysis on the shared traces.

For each trace (AR, SE, ST) it prints: the time to load and check it (the
floor any analysis pays), the full vectorised analysis (every simulation the
what-if summary needs), one vectorised simulation of all steps, and the baseline
measured in the same run: one simulation by the per-op Python event loop,
and that cost times the number of simulations the analysis ran. A scale
case tiles ST's DP ranks into a job of `--scale-workers` workers and times
load + analysis.

End to end (`--artifact DIR`): `slurmguard whatif` on the AR trace as a
subprocess, as a user runs it (start-up, reading, analysis, output; text and
--json), against the simulator released with paper 004 (ByteDance-Seed/
StragglerAnalysis, `analyzer/wia.py`, run with `--artifact-python`, an
interpreter with its requirements.txt: pandas < 3, which its code needs),
alternating runs after one untimed run of each, in the same run of the bench,
both from bytecode caches as installed programs run. Both wall time and the
child's CPU time (user + sys) are printed, with the load average: on a shared
machine the CPU time is the steadier comparison. S of both is printed with
their difference.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np

from slurmguard.errors import InputError

TRACES_ENV = "SLURMGUARD_WHATIF_TRACES"
T = TypeVar("T")
"""Environment variable naming the trace directory when --traces is not given (no default:
the traces are data, not part of an install)."""


def _best(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    best = float("inf")
    for _ in range(repeat):
        c = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - c)
    return best, out


def tile_dp(tr, dp: int, pp: int, copies: int, seed: int = 0) -> dict:
    """A trace with `copies` x dp DP ranks: each copy's compute ops scaled by a small random factor.

    `tr` is a checked Trace; returns columns for check_trace.
    """
    from slurmguard.whatif.trace import OPTYPE_NAMES, REQUIRED_COLUMNS, Coded

    rng = np.random.default_rng(seed)
    compute = [OPTYPE_NAMES.index(n) for n in ("forward-compute", "backward-compute")]
    comp = np.isin(tr["optype"], compute)
    parts = []
    for c in range(copies):
        part = dict(tr.columns)
        new_dp = tr["dp_rank"] + c * dp
        part["dp_rank"] = new_dp
        part["rank"] = tr["stage"] * dp * copies + new_dp
        factor = rng.uniform(0.98, 1.02, size=len(tr))
        part["duration"] = np.where(comp, tr["duration"] * factor, tr["duration"])
        parts.append(part)
    out: dict[str, Any] = {k: np.concatenate([p[k] for p in parts]) for k in REQUIRED_COLUMNS}
    out["optype"] = Coded(out["optype"], list(OPTYPE_NAMES))
    return out


def _timed_run(argv: list[str], cwd: str, env: dict, what: str) -> tuple[float, float, str]:
    """Run argv; (wall s, child CPU s, stdout). A failure is an InputError with its stderr tail."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    c = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - c
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise InputError(f"{what} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return wall, cpu, proc.stdout


def _slurmguard_argv() -> list[str]:
    """The installed `slurmguard` command beside this interpreter (else `python -m`)."""
    script = Path(sys.executable).with_name("slurmguard")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "slurmguard.cli"]


def end_to_end(base: Path, name: str, artifact: Path, artifact_python: str, runs: int) -> None:
    """Print the end-to-end comparison of `slurmguard whatif` and the paper's simulator."""
    trace, meta = base / f"trace-{name}.parquet", base / f"meta-{name}.yaml"
    wia = artifact / "analyzer" / "wia.py"
    if not wia.is_file():
        raise InputError(
            f"{artifact}: not a StragglerAnalysis checkout (no analyzer/wia.py); clone"
            " https://github.com/ByteDance-Seed/StragglerAnalysis and pass --artifact"
        )
    # Both run as installed programs do: from bytecode caches (a development shell's
    # PYTHONDONTWRITEBYTECODE would have each run compile its own modules again, the
    # artifact's analyzer/ and slurmguard alike), after one untimed run each that writes
    # them and warms the page cache.
    env = {k: v for k, v in os.environ.items() if k not in ("SLURMGUARD_POLICY", "PYTHONDONTWRITEBYTECODE")}
    art_env = {**env, "PYTHONPATH": str(artifact)}
    ours = _slurmguard_argv() + ["whatif", str(trace), "--meta", str(meta)]
    times: dict[str, list[tuple[float, float]]] = {"text": [], "json": [], "artifact": []}
    load_before = os.getloadavg()
    s_ours = s_art = float("nan")
    with tempfile.TemporaryDirectory(prefix="sg-whatif-e2e-") as tmp:
        # cwd without policies.yaml: the built-in policy, as on a fresh host
        dump = Path(tmp) / "artifact"
        art = [artifact_python, str(wia), "--metadata", str(meta), "--trace", str(trace),
               "--dump-dir", str(dump), "--root", str(dump)]  # fmt: skip
        for i in range(runs + 1):
            timed = i > 0
            w, c, _ = _timed_run(ours, tmp, env, "slurmguard whatif")
            if timed:
                times["text"].append((w, c))
            w, c, out = _timed_run(ours + ["--json"], tmp, env, "slurmguard whatif --json")
            if timed:
                times["json"].append((w, c))
            s_ours = float(json.loads(out)["slowdown"])
            w, c, _ = _timed_run(art, str(artifact), art_env, "the artifact's analyzer/wia.py")
            if timed:
                times["artifact"].append((w, c))
            res = json.loads((dump / f"{name}.json").read_text())
            s_art = float(res["blocking_slowdown"])
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for k, v in times.items()}  # fmt: skip
    aw, ac = med["artifact"]
    click.echo(f"\nend to end on {name} ({runs} alternating runs each, median; child CPU = user+sys):")
    click.echo(f"{'command':<44}{'wall s':>8}{'CPU s':>8}{'speedup wall/CPU':>19}   S")
    for key, label in (("text", "slurmguard whatif"), ("json", "slurmguard whatif --json")):
        w, c = med[key]
        click.echo(f"{label:<44}{w:>8.2f}{c:>8.2f}{aw / w:>9.1f}x /{ac / c:>5.1f}x   {s_ours:.3f}")
    click.echo(
        f"{'artifact analyzer/wia.py (baseline)':<44}{aw:>8.2f}{ac:>8.2f}{'1.0x / 1.0x':>19}   {s_art:.3f}"
    )
    click.echo(f"S difference: {100 * (s_ours - s_art) / s_art:+.2f}% (target within 1%)")
    # wall times depend on what else runs; CPU times much less: say which it was
    load_after = os.getloadavg()
    click.echo(
        f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after,"
        f" on {os.cpu_count()} cores"
    )


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
@click.option(
    "--artifact",
    "artifact_dir",
    type=click.Path(file_okay=False),
    default=os.environ.get("SLURMGUARD_WHATIF_ARTIFACT"),
    help="Checkout of github.com/ByteDance-Seed/StragglerAnalysis: compare the command end to"
    " end with its simulator [default: $SLURMGUARD_WHATIF_ARTIFACT; none skips the comparison].",
)
@click.option(
    "--artifact-python",
    default=os.environ.get("SLURMGUARD_WHATIF_ARTIFACT_PYTHON", sys.executable),
    show_default="$SLURMGUARD_WHATIF_ARTIFACT_PYTHON or this interpreter",
    help="Interpreter with the artifact's requirements (pandas < 3).",
)
@click.option(
    "--e2e-runs",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Alternating end-to-end runs of each command.",
)
@click.option("--e2e-only", is_flag=True, help="Only the end-to-end comparison (needs --artifact).")
def bench_whatif(
    traces_dir: str | None,
    repeat: int,
    naive: bool,
    scale_workers: int,
    artifact_dir: str | None,
    artifact_python: str,
    e2e_runs: int,
    e2e_only: bool,
) -> None:
    """Time the what-if analysis on the three shared traces, against the naive event loop,
    and the command end to end against the paper's simulator."""
    from dataclasses import replace

    from slurmguard.whatif.analysis import analyse, simulation_durations
    from slurmguard.whatif.model import build_model
    from slurmguard.whatif.simulate import simulate, simulate_naive
    from slurmguard.whatif.tensor import tensorize
    from slurmguard.whatif.trace import check_trace, load_trace
    from slurmguard.whatif_policy import WhatIfPolicy

    if not traces_dir:
        raise InputError(
            f"no trace directory: pass --traces DIR or set ${TRACES_ENV} "
            f"(a directory with trace-{{AR,SE,ST}}.parquet and meta-{{AR,SE,ST}}.yaml)"
        )
    base = Path(traces_dir)
    if not base.is_dir():
        raise InputError(f"{base}: trace directory not found (use --traces)")
    if e2e_only and not artifact_dir:
        raise InputError("--e2e-only needs --artifact DIR (a StragglerAnalysis checkout)")
    if artifact_dir and e2e_only:
        end_to_end(base, "AR", Path(artifact_dir), artifact_python, e2e_runs)
        return
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
            f" workers, {len(big['step'])} ops, {len(t.steps)} steps: check+tensorize {c1 - c0:.2f} s,"
            f" analysis {c2 - c1:.2f} s ({r.simulations} simulations), S={r.slowdown:.3f},"
            f" pattern {r.diagnosis.pattern}"
        )
    if artifact_dir:
        end_to_end(base, "AR", Path(artifact_dir), artifact_python, e2e_runs)
    else:
        click.echo("end to end: skipped (--artifact DIR: a StragglerAnalysis checkout to compare with)")
