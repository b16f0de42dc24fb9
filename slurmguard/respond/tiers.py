"""Response tiers (Guard 4.2) and the ski-rental gate between them.

The tier says how bad a job's slowdown is; the ski-rental rule (Greyhound
Algorithm 1, slurmguard.mitigate.escalation) says whether it has cost enough
yet to pay for the next action. The action taken is the cheaper of the two:
a severe slowdown that has not yet cost the price of a requeue is drained
first and requeued once its accumulated cost reaches the requeue price. A
stall makes no progress at all, so it skips the gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from slurmguard.config import EscalationPolicy, TierPolicy


class Tier(IntEnum):
    NONE = 0
    VERIFY = 1      # no observable impact: pending verification comment
    DRAIN = 2       # moderate sustained: drain, checkpoint signal, free at exit
    REQUEUE = 3     # severe or stall: drain and requeue now

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Culprit:
    """A node blamed for a job's slowdown, with human-readable evidence."""

    node: str
    ranks: tuple[int, ...] = ()
    gpu: int | None = None
    why: str = ""
    telemetry: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobAssessment:
    """The controller's view of one guarded job at one moment.

    Times are Unix seconds; step times in seconds; slowdown a fraction
    (0.23 = 23% slower than the job's own healthy baseline).
    """

    job_id: int
    nodes: tuple[str, ...]
    gpus: int
    baseline_s: float | None
    current_s: float | None
    onset: float | None
    stalled_for_s: float = 0.0
    culprits: tuple[Culprit, ...] = ()
    evidence: dict = field(default_factory=dict)

    @property
    def slowdown(self) -> float:
        if not self.baseline_s or not self.current_s:
            return 0.0
        return self.current_s / self.baseline_s - 1.0


def classify(a: JobAssessment, policy: TierPolicy, now: float) -> Tier:
    """The tier a job's observed impact calls for (before the cost gate)."""
    if a.stalled_for_s >= policy.stall_s:
        return Tier.REQUEUE
    s = a.slowdown
    if s >= policy.severe_slowdown:
        return Tier.REQUEUE
    if s >= policy.moderate_slowdown and a.onset is not None and now - a.onset >= policy.sustained_s:
        return Tier.DRAIN
    return Tier.NONE


def accumulated_cost_gpu_s(a: JobAssessment, now: float) -> float:
    """Cost of the slowdown so far: slow iterations x (t_slow - t_healthy) x GPUs.

    Derived from the assessment alone (onset, step times), so a restarted
    controller computes the same figure without remembering anything.
    """
    if a.onset is None or not a.baseline_s or not a.current_s or a.current_s <= a.baseline_s:
        return 0.0
    slow_iterations = max(0.0, now - a.onset) / a.current_s
    return slow_iterations * (a.current_s - a.baseline_s) * max(1, a.gpus)


def gated_tier(a: JobAssessment, tier: Tier, costs: EscalationPolicy, now: float) -> Tier:
    """Apply the ski-rental gate: the highest tier up to `tier` whose price is paid."""
    if tier <= Tier.VERIFY:
        return tier
    if a.stalled_for_s > 0 and tier == Tier.REQUEUE:
        return Tier.REQUEUE  # a stall makes no progress: the rent is unbounded
    paid = accumulated_cost_gpu_s(a, now)
    if tier >= Tier.REQUEUE and paid >= costs.requeue_gpu_s:
        return Tier.REQUEUE
    if paid >= costs.drain_checkpoint_gpu_s:
        return Tier.DRAIN
    return Tier.NONE


def time_to_pay(a: JobAssessment, price_gpu_s: float) -> float:
    """Seconds after onset at which the accumulated cost reaches `price_gpu_s`."""
    if not a.baseline_s or not a.current_s or a.current_s <= a.baseline_s:
        return math.inf
    per_s = (a.current_s - a.baseline_s) * max(1, a.gpus) / a.current_s
    return price_gpu_s / per_s
