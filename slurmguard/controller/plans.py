"""Mitigation plans the controller serves to opted-in jobs (Greyhound S2), and the
job's opt-ins read from its Slurm comment.

A job opts in with its Slurm comment, `--comment=slurmguard:ITEM[,ITEM...]`:
- `mitigate,microbatches=M[,pp=P]`: in-job mitigation (M = micro-batches in its
  global batch, 1..65536, a multiple of P; P = pipeline stages, 1..1024, default
  1; ranks in Megatron order, stage-major: rank = stage * dp + dp_rank);
- `signal[=NAME]`: when a node under the job is drained, send it NAME (default
  response.tiers.checkpoint_signal) to ask for a checkpoint; NAME is one of
  CHECKPOINT_SIGNALS. A job without it is drained under and left running.
The comment belongs to the job's user, so every value is bounded and checked:
a bad item is ignored and named in `JobOptions.problems` (recorded in the job's
incident), never an exception in the controller. Slurm 22.05 does not report a
job's own `--signal` in squeue or scontrol (checked), so the comment is the way
to ask. In the
ski-rental order of Greyhound Algorithm 1, once its slowdown has cost:
- response.escalation.rebalance_gpu_s (S2, needs dp >= 2): micro-batch counts
  per DP group from each group's measured time per micro-batch
  (slurmguard.mitigate.plan_microbatches, exact; multiples of P);
- response.escalation.retopology_gpu_s (S3, needs pp >= 2): role swaps that
  consolidate the slow ranks into the fewest, interior PP stages
  (slurmguard.mitigate.plan_consolidation);
then drain and requeue at their own prices. Plans are served at
/v1/jobs/<id>/plan for the training loop (slurmguard.mitigate.client) and
kept in the incident's evidence, so a restarted controller serves the same.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from slurmguard.mitigate.microbatch import plan_microbatches
from slurmguard.mitigate.plan import JobPlan
from slurmguard.mitigate.topology import Layout, plan_consolidation

_OPT_IN = re.compile(r"slurmguard:(\S{0,256})")
MAX_MICROBATCHES = 65536
MAX_PP = 1024
#: signals a job may ask to receive; never KILL or STOP, which a job cannot handle
CHECKPOINT_SIGNALS = frozenset({"USR1", "USR2", "TERM", "INT", "HUP", "URG", "CONT"})


@dataclass(frozen=True)
class OptIn:
    microbatches: int
    pp: int = 1


@dataclass(frozen=True)
class JobOptions:
    """What a job asked for in its comment. signal: the checkpoint signal name
    (without SIG) or None; problems: items that were ignored, and why."""

    mitigate: OptIn | None = None
    signal: str | None = None
    problems: tuple[str, ...] = ()


def _bounded_int(item: str, value: str, lo: int, hi: int, problems: list[str]) -> int | None:
    if not value.isdigit() or len(value) > 6 or not lo <= int(value) <= hi:
        problems.append(f"{item}: expected an integer {lo}..{hi}")
        return None
    return int(value)


def job_options(comment: str | None, default_signal: str = "USR1") -> JobOptions:
    """The opt-ins of a job from its Slurm comment (see the module docstring)."""
    m = _OPT_IN.search(comment or "")
    if m is None:
        return JobOptions()
    problems: list[str] = []
    mitigate = False
    mb: int | None = None
    pp: int | None = 1
    signal: str | None = None
    for item in filter(None, m.group(1).split(",")):
        key, eq, value = item.partition("=")
        if key == "mitigate" and not eq:
            mitigate = True
        elif key == "microbatches" and eq:
            mb = _bounded_int(item, value, 1, MAX_MICROBATCHES, problems)
        elif key == "pp" and eq:
            pp = _bounded_int(item, value, 1, MAX_PP, problems)
        elif key == "signal":
            name = value.upper().removeprefix("SIG") if eq else default_signal.removeprefix("SIG")
            if name in CHECKPOINT_SIGNALS:
                signal = name
            else:
                problems.append(f"{item}: signal must be one of {', '.join(sorted(CHECKPOINT_SIGNALS))}")
        else:
            problems.append(
                f"{item[:40]}: unknown item (known: mitigate, microbatches=M, pp=P, signal[=NAME])"
            )
    opt = None
    if mitigate:
        if mb is None or pp is None:
            problems.append("mitigate: needs microbatches=M (and a valid pp=P)")
        elif mb % pp:
            problems.append(f"mitigate: microbatches={mb} is not a multiple of pp={pp}")
        else:
            opt = OptIn(microbatches=mb, pp=pp)
    return JobOptions(mitigate=opt, signal=signal, problems=tuple(problems))


def opt_in(comment: str | None) -> OptIn | None:
    """The job's mitigation opt-in from its Slurm comment, or None."""
    return job_options(comment).mitigate


class PlanBook:
    def __init__(self) -> None:
        self._plans: dict[int, JobPlan] = {}
        self._lock = threading.Lock()

    def get(self, job_id: int) -> JobPlan | None:
        with self._lock:
            return self._plans.get(job_id)

    def put(self, plan: JobPlan) -> None:
        with self._lock:
            self._plans[int(plan.job_id)] = plan

    def served(self, job_id: int) -> dict | None:
        p = self.get(job_id)
        return None if p is None else p.model_dump(mode="json")

    def rebalance(self, job_id: int, compute_s: dict[int, float], total: int, pp: int = 1) -> JobPlan | None:
        """S2 plan from each rank's compute time per step (s) under the current split.

        A DP group's time per micro-batch is that of its slowest stage (a
        pipeline runs at the pace of its slowest stage)."""
        ranks = sorted(compute_s)
        world = len(ranks)
        if ranks != list(range(world)) or world % pp:
            return None
        dp = world // pp
        if dp < 2 or total < dp * pp:
            return None
        current = self.get(job_id)
        if current is not None and current.microbatches is not None and len(current.microbatches) == dp:
            counts = list(current.microbatches)
        else:
            base = total // (dp * pp) * pp
            extra = (total - base * dp) // pp
            counts = [base + (pp if d < extra else 0) for d in range(dp)]
        per_mb = [max(max(compute_s[s * dp + d] for s in range(pp)), 1e-6) / counts[d] for d in range(dp)]
        plan = plan_microbatches(per_mb, total, pp)
        if list(plan.m) == counts:
            return None  # the current split is already the best one: nothing to serve
        return self._next(
            job_id, current, action="rebalance", microbatches=tuple(plan.m), pp=pp, makespan_s=plan.makespan
        )

    def retopology(self, job_id: int, slow_ranks: list[int], world: int, pp: int) -> JobPlan | None:
        """S3 plan: swaps that put the slow ranks into the fewest interior stages."""
        if pp < 2 or world % pp or not slow_ranks:
            return None
        layout = Layout.grid(pp, world // pp)
        plan = plan_consolidation(layout, [f"w{r}" for r in slow_ranks])
        if not plan.improves:
            return None
        current = self.get(job_id)
        return self._next(
            job_id,
            current,
            action="retopology",
            microbatches=current.microbatches if current else None,
            pp=pp,
            swaps=tuple((s.a, s.b) for s in plan.swaps),
            makespan_s=current.makespan_s if current else None,
        )

    def _next(self, job_id: int, current: JobPlan | None, **fields: Any) -> JobPlan:
        new = JobPlan(job_id=str(job_id), version=(current.version + 1) if current else 1, **fields)
        self.put(new)
        return new
