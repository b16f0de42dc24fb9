"""`slurmguard whatif TRACE --meta META` / `slurmguard whatif --rings DIR [--meta META]`:
what-if analysis of one job trace, or of a job's slurmguard rings."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from slurmguard.errors import InputError


def parse_steps(text: str) -> set[int]:
    """'16,21,400-410' -> {16, 21, 400, ..., 410}."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.update(range(int(lo), int(hi) + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise InputError(f"--steps: '{part}' is not a step number or a range like 400-410") from None
    return out


@contextlib.contextmanager
def lean_process() -> Iterator[None]:
    """Run one what-if command without the process costs it does not need.

    Start-up and exit are most of `slurmguard whatif`'s time (`slurmguard bench whatif`):
    - OpenBLAS starts (and spins) a worker thread per core when numpy loads it, and the
      analysis does no BLAS-sized product: one thread (0.1 s of CPU), unless the user set
      OPENBLAS_NUM_THREADS. The library reads the variable when it loads, so it is set only
      around numpy's first import and then restored (what this process starts inherits the
      user's environment).
    - Importing allocates some 10^5 long-lived objects (modules, classes, functions) and
      the analysis works on arrays, so the cyclic collector finds nothing: it is paused
      while the command runs (about 20 ms), and at exit the heap is frozen so that the
      interpreter's exit collections skip it (about 60 ms). Both only affect collection,
      never what is freed by reference counting; in-process callers (tests) get the
      collector back as it was.
    """
    added = "OPENBLAS_NUM_THREADS" not in os.environ
    if added:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401  (loads OpenBLAS under the setting above)
    finally:
        if added:
            del os.environ["OPENBLAS_NUM_THREADS"]
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        atexit.register(gc.freeze)


@click.command("whatif")
@click.argument("trace", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--meta",
    "meta_path",
    type=click.Path(dir_okay=False),
    help="YAML with dp_size, pp_size (tp_size, dsp_size, vpp_size, world_size);"
    " required with TRACE, optional with --rings (default dp = world size, pp = 1).",
)
@click.option(
    "--rings",
    "rings_dir",
    type=click.Path(file_okay=False),
    help="Analyse a job's rings instead of TRACE: an archived job <trace_store>/<job> or a ring directory.",
)
@click.option(
    "--job-step",
    default=None,
    help="With --rings: the Slurm job step (0, 1, batch, ...) when the rings hold several.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option(
    "--heatmap",
    "heatmap_path",
    type=click.Path(dir_okay=False),
    help="Write the SMon worker heatmap (SVG) here.",
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False),
    help="Write simulated original and ideal timelines (Perfetto JSON; .gz compresses).",
)
@click.option(
    "--timeline-steps",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Steps written to the timeline.",
)
@click.option(
    "--steps",
    "steps_text",
    default=None,
    help="Analyse only these steps, e.g. '16,21,400-410'.",
)
@click.option(
    "--heatmap-step",
    type=int,
    default=None,
    help="Heatmap of this step's worker slowdowns instead of the average (SMon per-step view).",
)
@click.option(
    "--exact-workers",
    is_flag=True,
    help="Also simulate every worker alone (Eq. 4 without the DP x PP approximation).",
)
@click.option(
    "--rank-ops",
    is_flag=True,
    help="TRACE is a slurmguard per-rank op table (rank, step, op, start_ns, end_ns).",
)
@click.pass_context
def whatif(ctx: click.Context, **options: Any) -> None:
    """What-if analysis of TRACE (paper 004): slowdown S, S_t per op type, S_w per DP rank
    and stage, M_W, M_S and the simulation discrepancy. With --rings DIR, of a job's own
    slurmguard rings: per iteration, the compute between collectives and the DP
    collectives are inferred (see slurmguard/whatif/rings.py)."""
    with lean_process():
        _whatif(ctx, **options)


def _whatif(
    ctx: click.Context,
    trace: str | None,
    meta_path: str | None,
    rings_dir: str | None,
    job_step: str | None,
    as_json: bool,
    heatmap_path: str | None,
    timeline_path: str | None,
    timeline_steps: int,
    steps_text: str | None,
    heatmap_step: int | None,
    exact_workers: bool,
    rank_ops: bool,
) -> None:
    # Only what this run needs is imported: start-up is most of the command's time.
    from slurmguard.policyfile import find_policy_file
    from slurmguard.whatif.analysis import analyse
    from slurmguard.whatif.tensor import tensorize
    from slurmguard.whatif.trace import check_trace, load_meta, read_columns
    from slurmguard.whatif_policy import WhatIfPolicy

    policy_path = (ctx.obj or {}).get("policy_path")
    # A policy file is validated whole, as for every command. Without one, a trace needs only
    # the whatif defaults, which come without pydantic and slurmguard.config (about a quarter
    # of the run); --rings also reads detection.period, from the policy models.
    if rings_dir is None and find_policy_file(policy_path) is None:
        policy = WhatIfPolicy()
    else:
        from slurmguard.config import load_policy

        full_policy = load_policy(
            policy_path,
            sections=("whatif", "detection") if rings_dir is not None else ("whatif",),
        )
        policy = full_policy.whatif
    ring_job = None
    if rings_dir is not None:
        from slurmguard.whatif.rings import RING_OP_MAP, load_ring_job

        if trace is not None or rank_ops:
            raise InputError("--rings: give either TRACE or --rings DIR, not both")
        from slurmguard.whatif.adapter import trace_from_rank_ops

        ring_job = load_ring_job(
            rings_dir,
            load_meta(meta_path) if meta_path else None,
            period=full_policy.detection.period,
            job_step=job_step,
            meta_source=Path(meta_path).name if meta_path else "--meta",
        )
        meta = ring_job.meta
        name = trace = str(rings_dir)
        meta_path = meta_path or "rings"
        table = trace_from_rank_ops(ring_job.table, meta, name, op_map=RING_OP_MAP)
    else:
        if trace is None:
            raise InputError("whatif: give a TRACE file (with --meta) or --rings DIR")
        if meta_path is None:
            raise InputError(f"{trace}: --meta META is required with a trace file")
        meta = load_meta(meta_path)
        name = Path(trace).name
        if rank_ops:
            from slurmguard.whatif.adapter import trace_from_rank_ops
            from slurmguard.whatif.trace import read_table

            table = trace_from_rank_ops(read_table(trace), meta, name)
        else:
            table = read_columns(trace)
    df = check_trace(table, meta, name, Path(meta_path).name)
    if steps_text:
        import numpy as np

        df = df.take(np.isin(df["step"], sorted(parse_steps(steps_text))))
        if len(df) == 0:
            raise InputError(f"{name}: none of the steps given with --steps is in the trace")
    if not meta.name:
        from dataclasses import replace

        meta = replace(meta, name=Path(trace).stem)
    t = tensorize(df, meta, name)
    result = analyse(t, policy, exact_workers=exact_workers)
    if heatmap_path:
        import numpy as np

        from slurmguard.whatif.heatmap import write_heatmap

        cells, what = result.worker_slowdown, "average"
        if heatmap_step is not None:
            hit = [i for i, s in enumerate(result.steps) if int(s) == heatmap_step]
            if not hit:
                raise InputError(f"{name}: --heatmap-step {heatmap_step} is not a step of the trace")
            i = hit[0]
            cells = np.minimum(
                result.by_stage_per_step[i][:, None],
                result.by_dp_rank_per_step[i][None, :],
            )
            what = f"step {heatmap_step}"
        write_heatmap(
            cells,
            heatmap_path,
            title=f"{result.name} ({what}): S={result.slowdown:.2f}, M_W={result.mw:.2f},"
            f" M_S={result.ms:.2f} ({result.diagnosis.pattern})",
        )
    if timeline_path:
        from slurmguard.whatif.timeline import write_timeline

        write_timeline(t, timeline_path, steps=timeline_steps)
    from slurmguard.whatif.render import to_json, to_text

    if as_json:
        out = to_json(result)
        if ring_job is not None:
            out["input"] = ring_job.summary()
        click.echo(json.dumps(out, indent=2))
    else:
        if ring_job is not None:
            j = ring_job
            click.echo(
                f"rings: job {j.job_id} step {j.summary()['job_step']}, {j.world_size} ranks on"
                f" {len(set(j.nodes.values()))} node(s), {j.steps} iterations matched;"
                " compute between iterations -> forward-compute, collectives -> grads-reduce-scatter"
            )
            for note in j.notes:
                click.echo(f"rings: {note}")
        click.echo(to_text(result), nl=False)
        for label, path in (("heatmap", heatmap_path), ("timeline", timeline_path)):
            if path:
                click.echo(f"{label}: {path}")
