"""`slurmguard plan ...`: run the mitigation planners from the shell; JSON out."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import click

from slurmguard.errors import InputError

if TYPE_CHECKING:
    from slurmguard.mitigate.topology import Layout


def _floats(opt: str, text: str) -> list[float]:
    out = []
    for i, item in enumerate(text.split(","), start=1):
        try:
            v = float(item.strip())
        except ValueError:
            raise InputError(f"{opt}: item {i} {item.strip()!r} is not a number") from None
        if not math.isfinite(v) or v <= 0:
            raise InputError(f"{opt}: item {i} {item.strip()!r} must be a positive number")
        out.append(v)
    return out


def _int(opt: str, text: str, minimum: int) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise InputError(f"{opt}: {text.strip()!r} is not an integer") from None
    if v < minimum:
        raise InputError(f"{opt}: {v} must be >= {minimum}")
    return v


def _num(opt: str, text: str, minimum: float = 0.0) -> float:
    try:
        v = float(text.strip())
    except ValueError:
        raise InputError(f"{opt}: {text.strip()!r} is not a number") from None
    if not math.isfinite(v) or v < minimum:
        raise InputError(f"{opt}: {text.strip()!r} must be a finite number >= {minimum}")
    return v


def _names(opt: str, text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    for i, x in enumerate(items, start=1):
        if not x:
            raise InputError(f"{opt}: item {i} is empty")
    return items


def _layout(text: str | None, stages: str | None, per_stage: str | None) -> Layout:
    from slurmguard.mitigate.topology import Layout

    if text:
        return Layout.of(_names("--layout", row) for row in text.split(";"))
    if stages is None or per_stage is None:
        raise InputError("give --layout 'a,b;c,d' or both --stages and --per-stage")
    return Layout.grid(_int("--stages", stages, 1), _int("--per-stage", per_stage, 1))


def _echo(obj: object) -> None:
    click.echo(json.dumps(obj))


@click.group()
def plan() -> None:
    """Mitigation planners (Greyhound S2/S3) and the escalation rule (slurmguard.respond.escalation)."""


@plan.command("microbatch")
@click.option("--times", required=True, help="Seconds per micro-batch of each DP group: t1,t2,...")
@click.option("--microbatches", "total", required=True, help="Micro-batches in the global batch (M).")
@click.option("--pp", default="1", show_default=True, help="PP stages: counts are multiples of it (1F1B).")
@click.option(
    "--method",
    type=click.Choice(["exact", "milp"]),
    default="exact",
    show_default=True,
    help="exact: combinatorial algorithm; milp: cvxpy + HiGHS reference.",
)
def microbatch(times: str, total: str, pp: str, method: str) -> None:
    """Redistribute micro-batches to minimise the slowest DP group (Eq. 1).

    Prints {"m": [...], "makespan": seconds}.
    """
    from slurmguard.mitigate.microbatch import plan_microbatches

    ts = _floats("--times", times)
    m_total, n_pp = _int("--microbatches", total, 1), _int("--pp", pp, 1)
    if method == "milp":
        from slurmguard.mitigate.reference import plan_microbatches_milp

        result = plan_microbatches_milp(ts, m_total, n_pp)
    else:
        result = plan_microbatches(ts, m_total, n_pp)
    _echo(result.to_json())


@plan.command("consolidate")
@click.option("--stragglers", required=True, help="Straggling workers: w1,w6,...")
@click.option(
    "--layout", "layout_text", default=None, help="Workers by stage, ';' between stages: 'n1,n2;n3,n4'."
)
@click.option("--stages", default=None, help="PP stages (with --per-stage: workers w0..wN stage-major).")
@click.option("--per-stage", default=None, help="Workers per PP stage.")
def consolidate(stragglers: str, layout_text: str | None, stages: str | None, per_stage: str | None) -> None:
    """Move stragglers into the fewest PP stages, interior stages first (S3)."""
    from slurmguard.mitigate.topology import plan_consolidation

    layout = _layout(layout_text, stages, per_stage)
    _echo(plan_consolidation(layout, _names("--stragglers", stragglers)).to_json())


@plan.command("swap")
@click.option("--link", "links", multiple=True, required=True, help="Congested link a-b (repeatable).")
@click.option("--layout", "layout_text", default=None, help="Workers by stage: 'n1,n2;n3,n4'.")
@click.option("--stages", default=None, help="PP stages (with --per-stage).")
@click.option("--per-stage", default=None, help="Workers per PP stage.")
@click.option("--dp-bytes", default="1.0", show_default=True, help="DP ring traffic per iteration.")
@click.option("--pp-bytes", default="0.01", show_default=True, help="PP traffic per iteration.")
@click.option("--max-swaps", default="1", show_default=True, help="Role exchanges at most.")
def swap(
    links: tuple[str, ...],
    layout_text: str | None,
    stages: str | None,
    per_stage: str | None,
    dp_bytes: str,
    pp_bytes: str,
    max_swaps: str,
) -> None:
    """Exchange worker roles so congested links carry light PP traffic (S3)."""
    from slurmguard.mitigate.topology import plan_role_swap

    layout = _layout(layout_text, stages, per_stage)
    pairs = []
    for text in links:
        ends = [x.strip() for x in text.split("-")]
        if len(ends) != 2 or not all(ends):
            raise InputError(f"--link {text!r}: expected two worker names joined by '-'")
        pairs.append((ends[0], ends[1]))
    res = plan_role_swap(
        layout,
        pairs,
        dp_bytes=_num("--dp-bytes", dp_bytes),
        pp_bytes=_num("--pp-bytes", pp_bytes),
        max_swaps=_int("--max-swaps", max_swaps, 0),
    )
    _echo(res.to_json())


@plan.command("escalation")
@click.option(
    "--cause",
    type=click.Choice(["compute", "communication", "unknown"]),
    default="compute",
    show_default=True,
)
@click.option("--slow", "t_slow", required=True, help="Slowed iteration time, seconds.")
@click.option("--healthy", "t_healthy", required=True, help="Healthy iteration time, seconds.")
@click.option("--gpus", required=True, help="GPUs of the job.")
@click.option("--dp", "dp_groups", default="2", show_default=True, help="DP groups of the job.")
@click.option("--pp", "pp_stages", default="2", show_default=True, help="PP stages of the job.")
@click.option("--no-opt-in", is_flag=True, help="Job did not opt in to in-job mitigation.")
@click.pass_context
def escalation(
    ctx: click.Context,
    cause: str,
    t_slow: str,
    t_healthy: str,
    gpus: str,
    dp_groups: str,
    pp_stages: str,
    no_opt_in: bool,
) -> None:
    """When each tier becomes due under a constant slowdown (ski rental, policy costs)."""
    from slurmguard.config import load_policy
    from slurmguard.respond.escalation import candidate_actions, iterations_to_pay, rent_gpu_s

    root = ctx.find_root().obj or {}
    pol = load_policy(root.get("policy_path")).response.escalation
    slow_s, healthy_s = _num("--slow", t_slow), _num("--healthy", t_healthy)
    per_iter = rent_gpu_s(slow_s, healthy_s, _int("--gpus", gpus, 1))
    cands = candidate_actions(
        pol,
        cause,
        opted_in=not no_opt_in,
        dp_groups=_int("--dp", dp_groups, 1),
        pp_stages=_int("--pp", pp_stages, 1),
    )
    rows = []
    for c in cands:
        iters = iterations_to_pay(c.cost_gpu_s, per_iter)
        rows.append(
            {
                "action": c.action.value,
                "cost_gpu_s": c.cost_gpu_s,
                "after_iterations": iters,
                "after_s": iters * slow_s if iters is not None else None,
            }
        )
    _echo({"impact_gpu_s_per_iteration": per_iter, "tiers": rows})


def _add_example() -> None:
    # The example module imports torch only inside its workers, so listing it
    # here keeps `slurmguard plan --help` light.
    from slurmguard.mitigate.example_ddp import example_ddp

    plan.add_command(example_ddp)


_add_example()
