"""Rendering a WhatIfResult: one JSON object, or tables for a terminal.

Slowdowns are ratios (1.0 = no slowdown); waste is a fraction of GPU-hours;
times are seconds. Maps are keyed by strings: op type, DP rank, stage, global
rank, step.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from slurmguard.whatif.analysis import WhatIfResult


def _f(x: float | None) -> float | None:
    return None if x is None else float(x)


def to_json(r: WhatIfResult) -> dict[str, Any]:
    """The result as plain JSON types. Required keys: slowdown, by_optype, by_dp_rank, by_stage, mw, ms."""
    pp, dp = r.worker_slowdown.shape
    steps = [str(int(s)) for s in r.steps]
    workers = {}
    by_worker = {}
    for s in range(pp):
        for d in range(dp):
            key = str(int(r.rank[s, d]))
            workers[key] = {"dp_rank": d, "stage": s}
            by_worker[key] = float(r.worker_slowdown[s, d])
    return {
        "name": r.name,
        "dp_size": r.dp_size,
        "pp_size": r.pp_size,
        "workers_traced": pp * dp,
        "slowdown": float(r.slowdown),
        "waste": float(r.waste),
        "step_time_s": {
            "actual": r.t_actual,
            "simulated_original": r.t_original,
            "ideal": r.t_ideal,
        },
        "step_slowdown": {k: float(v) for k, v in zip(steps, r.step_slowdown)},
        "by_optype": {k: float(v) for k, v in r.by_optype.items()},
        "waste_by_optype": {k: float(v) for k, v in r.waste_by_optype.items()},
        "by_dp_rank": {str(d): float(v) for d, v in enumerate(r.by_dp_rank)},
        "by_stage": {str(s): float(v) for s, v in enumerate(r.by_stage)},
        "by_worker": by_worker,
        "workers": workers,
        "by_dp_rank_per_step": {
            k: {str(d): float(v) for d, v in enumerate(row)} for k, row in zip(steps, r.by_dp_rank_per_step)
        },
        "by_stage_per_step": {
            k: {str(s): float(v) for s, v in enumerate(row)} for k, row in zip(steps, r.by_stage_per_step)
        },
        "mw": float(r.mw),
        "ms": float(r.ms),
        "mw_detail": {
            "top_workers": [
                {
                    "rank": w.rank,
                    "dp_rank": w.dp_rank,
                    "stage": w.stage,
                    "slowdown": w.slowdown,
                }
                for w in r.top_workers
            ],
            "step_time_fixed_s": r.t_fix_top_workers,
        },
        "ms_detail": {"step_time_fixed_s": r.t_fix_last_stage},
        "discrepancy": float(r.discrepancy),
        "fwd_bwd_correlation": _f(r.fwd_bwd_correlation),
        "diagnosis": {
            "pattern": r.diagnosis.pattern,
            "detail": r.diagnosis.detail,
            "affected_workers": r.diagnosis.affected_workers,
            "affected_fraction": r.diagnosis.affected_fraction,
            "sequence_imbalance_likely": r.diagnosis.sequence_imbalance_likely,
            "fidelity_ok": r.diagnosis.fidelity_ok,
        },
        "by_worker_exact": None
        if r.worker_slowdown_exact is None
        else {
            str(int(r.rank[s, d])): float(r.worker_slowdown_exact[s, d]) for s in range(pp) for d in range(dp)
        },
        "simulations": r.simulations,
        "timings_s": {k: float(v) for k, v in r.timings.items()},
    }


def to_text(r: WhatIfResult, top: int = 8, width: int = 100) -> str:
    """Human-readable tables (summary, op types, stages, DP ranks, workers)."""
    buf = io.StringIO()
    # rich only for the tables: --json output does not pay for importing it
    from rich.console import Console
    from rich.table import Table

    from slurmguard.whatif.tensor import median

    # Trace, job and op-type names are data: printed as they are, never read as rich markup
    # ('[...]') or emoji codes (':name:'); also spares loading rich's emoji table
    con = Console(
        file=buf,
        width=width,
        force_terminal=False,
        color_system=None,
        markup=False,
        emoji=False,
        highlight=False,
    )
    summary = Table(title=f"what-if: {r.name} (dp={r.dp_size}, pp={r.pp_size})", show_header=False)
    summary.add_column("metric")
    summary.add_column("value")
    ss = r.step_slowdown
    rows = [
        ("slowdown S (Eq. 1)", f"{r.slowdown:.3f}"),
        ("resource waste (Eq. 3)", f"{100 * r.waste:.1f}% of GPU-hours"),
        (
            "step time actual / simulated / ideal",
            f"{r.t_actual:.4g} / {r.t_original:.4g} / {r.t_ideal:.4g} s",
        ),
        (
            "per-step slowdown min / median / max",
            f"{ss.min():.3f} / {median(ss):.3f} / {ss.max():.3f} over {len(ss)} steps",
        ),
        ("M_W (Eq. 5, top workers fixed)", f"{r.mw:.3f}"),
        ("M_S (5.2, last stage fixed)", f"{r.ms:.3f}"),
        (
            "simulation discrepancy (6)",
            f"{100 * r.discrepancy:.2f}%"
            + ("" if r.diagnosis.fidelity_ok else "  (above the fidelity limit)"),
        ),
        (
            "fwd/bwd compute correlation (5.3)",
            "n/a" if r.fwd_bwd_correlation is None else f"{r.fwd_bwd_correlation:.3f}",
        ),
        ("pattern", f"{r.diagnosis.pattern}: {r.diagnosis.detail}"),
    ]
    for k, v in rows:
        summary.add_row(k, v)
    con.print(summary)

    ops = Table(title="S_t by op type (Eq. 2)", min_width=50)
    ops.add_column("op type")
    ops.add_column("S_t", justify="right")
    ops.add_column("waste", justify="right")
    for op, st in list(r.by_optype.items())[:top]:
        ops.add_row(op, f"{st:.3f}", f"{100 * r.waste_by_optype[op]:.1f}%")
    con.print(ops)

    stages = Table(title="S_w by PP stage (Eq. 4)", min_width=50)
    stages.add_column("stage", justify="right")
    stages.add_column("S_w", justify="right")
    for s in np.argsort(-r.by_stage, kind="stable")[:top]:
        stages.add_row(str(int(s)), f"{r.by_stage[s]:.3f}")
    con.print(stages)

    dps = Table(
        title=f"S_w by DP rank (Eq. 4), top {min(top, r.dp_size)} of {r.dp_size}",
        min_width=50,
    )
    dps.add_column("dp_rank", justify="right")
    dps.add_column("S_w", justify="right")
    for d in np.argsort(-r.by_dp_rank, kind="stable")[:top]:
        dps.add_row(str(int(d)), f"{r.by_dp_rank[d]:.3f}")
    con.print(dps)

    workers = Table(title="workers fixed for M_W (S_w = min of DP rank and stage)", min_width=60)
    for c in ("rank", "dp_rank", "stage", "S_w"):
        workers.add_column(c, justify="right")
    for w in r.top_workers:
        workers.add_row(str(w.rank), str(w.dp_rank), str(w.stage), f"{w.slowdown:.3f}")
    con.print(workers)
    return buf.getvalue()
