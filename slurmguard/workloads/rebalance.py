"""Gradient accumulation over a job-wide number of micro-batches, split between
the data-parallel ranks by slurmguard's rebalance plan (the S2 tier).

A step's global batch is M micro-batches (--accum M); rank r runs the ones its
share names (slurmguard.mitigate.plan.rank_share: count, offset and the loss
weight dp_size / M that keeps DDP's gradient average equal to the uniform
split's). Rank 0 asks the controller for the job's plan every `every` steps
(slurmguard.mitigate.client.PlanClient: SLURMGUARD_CONTROLLER_URL and
SLURM_JOB_ID); what it found rides on the step's flags all-reduce
(runtime.train) as a proposal, so every rank switches to a new split at the
same step, and no rank ever runs another's micro-batches. A plan that does not
fit the job (other DP size or M) is refused by the poller with a warning.

No torch here: the proposal is a list of floats that train() adds to its
all-reduce.
"""

from __future__ import annotations

from slurmguard.mitigate.client import PlanPoller
from slurmguard.mitigate.plan import JobPlan, RankShare, rank_share


class Shares:
    """The micro-batch split of one DP rank. dp_rank/dp_size: this rank in the
    data-parallel group; total: micro-batches per step (M); poller: rank 0's
    (slurmguard.mitigate.client.PlanPoller: it fetches every N steps, refuses a
    plan that does not fit with a warning, keeps the last good one); None on
    the other ranks, or without a controller."""

    def __init__(self, dp_rank: int, dp_size: int, total: int, poller: PlanPoller | None) -> None:
        # the uniform split; raises InputError when M < dp_size
        self.share: RankShare = rank_share(None, dp_rank, dp_size, total)
        self.dp_rank, self.dp_size, self.total = dp_rank, dp_size, total
        self.poller = poller
        self.version: int | None = None  # the plan in force (None: the uniform split)

    @property
    def width(self) -> int:
        """Floats this rank adds to the step's all-reduce: a plan's version + 1, then its counts."""
        return 1 + self.dp_size

    def proposal(self, step: int) -> list[float]:
        """What this rank adds to step `step`'s all-reduce: zeros, except on the
        rank with the poller once it holds a plan: its version + 1 (0 means
        none) and its counts (zeros: the controller withdrew the rebalance)."""
        out = [0.0] * self.width
        plan = self.poller.poll(step) if self.poller is not None else None
        if plan is not None:
            out[0] = float(plan.version + 1)
            if plan.microbatches is not None:
                out[1:] = [float(c) for c in plan.microbatches]
        return out

    def adopt(self, summed: list[float]) -> bool:
        """Apply the all-reduced proposals (one rank proposes, the others add
        zeros); True when the split changed at this step."""
        if len(summed) != self.width or summed[0] < 1:
            return False
        version = int(round(summed[0])) - 1
        if version == self.version:
            return False
        counts = tuple(int(round(c)) for c in summed[1:])
        plan = JobPlan(job_id="-", version=version, microbatches=counts if any(counts) else None)
        self.share = rank_share(plan, self.dp_rank, self.dp_size, self.total)
        self.version = version
        return True
