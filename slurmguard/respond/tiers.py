"""Response tiers (Guard 4.2): how bad a job's slowdown is.

The tier says what the observed impact calls for; the ski-rental rule
(slurmguard.respond.escalation.gate) says whether it has cost enough yet to
pay for it. The action taken is the cheaper of the two: a severe slowdown that
has not yet cost the price of a requeue is drained first and requeued once its
accumulated cost reaches the requeue price.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from slurmguard.config import TierPolicy


class Tier(IntEnum):
    NONE = 0
    VERIFY = 1  # no observable impact: pending verification comment
    DRAIN = 2  # moderate sustained: drain, checkpoint signal, free at exit
    REQUEUE = 3  # severe or stall: drain and requeue now

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
    named_for_s: float = 0.0
    """How long (s) the node must have been named, cycle after cycle, before
    anything is done about it (0: at once); see controller.assess.ALONE_NAMED_S."""


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


def calls_for_a_tier(slowdown: float, policy: TierPolicy) -> bool:
    """A slowdown (fraction) large enough for a drain tier once sustained (moderate_slowdown)."""
    return slowdown >= policy.moderate_slowdown


def classify(a: JobAssessment, policy: TierPolicy, now: float) -> Tier:
    """The tier a job's observed impact calls for (before the cost gate)."""
    if a.stalled_for_s >= policy.stall_s:
        return Tier.REQUEUE
    s = a.slowdown
    if s >= policy.severe_slowdown:
        return Tier.REQUEUE
    if calls_for_a_tier(s, policy) and a.onset is not None and now - a.onset >= policy.sustained_s:
        return Tier.DRAIN
    return Tier.NONE
