"""The plan a controller hands to a guarded training job (wire format).

The controller serves it as JSON at ``GET {controller_url}/v1/jobs/{job_id}/plan``;
the training loop fetches it with :mod:`slurmguard.mitigate.client`. Unknown
fields are ignored so an older client keeps working with a newer controller.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slurmguard.errors import InputError


class JobPlan(BaseModel):
    """One job's current mitigation plan.

    ``version``: increases every time the controller changes the plan; a loop
    applies a plan once per version. ``microbatches``: micro-batch count per DP
    group (index = DP rank), None = uniform split. ``pp``: every count is a
    multiple of it (1F1B). ``swaps``: worker role exchanges (S3), applied by the
    job at its next pause. ``makespan_s``: planned time of the slowest group.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    job_id: str
    version: int = Field(ge=0)
    action: str = "rebalance"
    microbatches: tuple[int, ...] | None = None
    pp: int = Field(1, ge=1)
    swaps: tuple[tuple[str, str], ...] = ()
    makespan_s: float | None = None

    @model_validator(mode="after")
    def _counts(self) -> JobPlan:
        if self.microbatches is not None:
            if not self.microbatches:
                raise ValueError("microbatches is empty")
            for i, m in enumerate(self.microbatches):
                if m < self.pp or m % self.pp:
                    raise ValueError(f"microbatches[{i}]={m} is not a positive multiple of pp={self.pp}")
        return self

    @property
    def total(self) -> int | None:
        return sum(self.microbatches) if self.microbatches is not None else None


@dataclass(frozen=True)
class RankShare:
    """What one DP rank does in a step.

    ``count``: micro-batches; ``offset``: index of its first micro-batch in
    the global batch; ``loss_scale``: factor for each micro-batch's mean loss
    so that DDP's gradient average over ``dp_size`` ranks equals the gradient of
    the mean loss over the whole global batch (weighted aggregation): each
    micro-batch carries ``dp_size / total``, whatever the split.
    """

    count: int
    offset: int
    loss_scale: float


def rank_share(plan: JobPlan | None, dp_rank: int, dp_size: int, total: int) -> RankShare:
    """Micro-batches of ``dp_rank`` out of ``total`` under ``plan`` (None: uniform).

    Raises InputError when the plan does not fit the job (wrong number of DP
    groups or micro-batches): the caller keeps its previous split.
    """
    if not 0 <= dp_rank < dp_size:
        raise InputError(f"plan: dp_rank {dp_rank} outside 0..{dp_size - 1}")
    if plan is None or plan.microbatches is None:
        if total < dp_size:
            raise InputError(f"plan: {total} micro-batches cannot cover {dp_size} DP ranks")
        base, extra = divmod(total, dp_size)
        counts = [base + (1 if i < extra else 0) for i in range(dp_size)]
    else:
        counts = list(plan.microbatches)
        if len(counts) != dp_size:
            raise InputError(
                f"plan v{plan.version} of job {plan.job_id}: {len(counts)} DP groups, the job has {dp_size}"
            )
        if sum(counts) != total:
            raise InputError(
                f"plan v{plan.version} of job {plan.job_id}: {sum(counts)} micro-batches, the job has {total}"
            )
    return RankShare(count=counts[dp_rank], offset=sum(counts[:dp_rank]), loss_scale=dp_size / total)
