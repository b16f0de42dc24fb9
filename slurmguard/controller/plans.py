"""Mitigation plans the controller serves to opted-in jobs (Greyhound S2).

A job opts in with its Slurm comment: `slurmguard:mitigate,microbatches=M`
(M = micro-batches in its global batch). When its slowdown has cost the
price of a rebalance (response.escalation.rebalance_gpu_s) but not yet that
of a drain, the controller plans micro-batch counts per DP rank from each
rank's measured time per micro-batch (slurmguard.mitigate.plan_microbatches,
exact) and serves them at /v1/jobs/<id>/plan; the training loop polls it
(slurmguard.mitigate.client). Plans are also kept in the incident's evidence,
so a restarted controller serves the same plan.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from slurmguard.mitigate.microbatch import plan_microbatches
from slurmguard.mitigate.plan import JobPlan

_OPT_IN = re.compile(r"slurmguard:mitigate(?:,microbatches=(\d+))?")


@dataclass(frozen=True)
class OptIn:
    microbatches: int


def opt_in(comment: str | None) -> OptIn | None:
    """The job's opt-in from its Slurm comment, or None."""
    m = _OPT_IN.search(comment or "")
    if m is None or m.group(1) is None:
        return None
    return OptIn(microbatches=int(m.group(1)))


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

    def rebalance(self, job_id: int, compute_s: dict[int, float], total: int) -> JobPlan | None:
        """Plan from each DP rank's compute time per step (s) under the current split."""
        ranks = sorted(compute_s)
        if len(ranks) < 2 or ranks != list(range(len(ranks))) or total < len(ranks):
            return None
        current = self.get(job_id)
        if current is not None and current.microbatches is not None and len(current.microbatches) == len(ranks):
            counts = list(current.microbatches)
        else:
            base, extra = divmod(total, len(ranks))
            counts = [base + (1 if i < extra else 0) for i in range(len(ranks))]
        per_mb = [max(compute_s[r], 1e-6) / counts[r] for r in ranks]
        plan = plan_microbatches(per_mb, total)
        if current is not None and tuple(plan.m) == current.microbatches:
            return None
        new = JobPlan(job_id=str(job_id), version=(current.version + 1) if current else 1,
                      action="rebalance", microbatches=tuple(plan.m), makespan_s=plan.makespan)
        self.put(new)
        return new
