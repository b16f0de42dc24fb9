"""Ski-rental escalation between mitigation tiers (Greyhound Algorithm 1).

A fail-slow event starts in S1 (ignore). Each slow iteration "rents": it costs
``(t_slow - t_healthy) * gpus`` GPU-seconds. The candidate actions for the
event's root cause are sorted by their one-off cost (policy
``response.escalation``, GPU-seconds); the next action is taken as soon as the
accumulated cost of the event reaches that action's cost ("buy the skis when
the rent paid equals the price"). The accumulated cost is not reset after an
action: an effective action lowers ``t_slow`` and so slows the accumulation,
an ineffective one lets it run on to the next tier.

The rule is a pure function over a small immutable state so the controller can
persist the state and resume after a restart without repeating an action.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from slurmguard.config import EscalationPolicy
from slurmguard.errors import InputError


class Action(StrEnum):
    """Mitigation tiers in the ski-rental order."""

    IGNORE = "ignore"  # S1: the state before any action
    REBALANCE = "rebalance"  # S2: micro-batch redistribution
    RETOPOLOGY = "retopology"  # S3: consolidation / DP-PP role swap
    DRAIN_CHECKPOINT = "drain_checkpoint"  # S4a: drain, free the node at the next checkpoint
    REQUEUE = "requeue"  # S4b: checkpoint-and-restart on healthy nodes now


class RootCause(StrEnum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Candidate:
    """One action and its one-off cost in GPU-seconds."""

    action: Action
    cost_gpu_s: float


def candidate_actions(
    policy: EscalationPolicy,
    cause: RootCause | str,
    *,
    opted_in: bool = True,
    dp_groups: int = 2,
    pp_stages: int = 2,
) -> tuple[Candidate, ...]:
    """FINDSTRATEGIES of Algorithm 1, sorted by cost (paper order on ties).

    Greyhound Table 2: S2 mitigates slow computation only; S3 and S4 mitigate
    both. S2 needs at least two DP groups to move work between, S3 at least two
    PP stages. A job that has not opted in to in-job mitigation only gets the
    drain/requeue tiers, which act on Slurm and need no help from the job.
    """
    cause = RootCause(cause)
    acts: list[Candidate] = []
    if opted_in:
        if cause is RootCause.COMPUTE and dp_groups >= 2:
            acts.append(Candidate(Action.REBALANCE, policy.rebalance_gpu_s))
        if cause is not RootCause.UNKNOWN and pp_stages >= 2:
            acts.append(Candidate(Action.RETOPOLOGY, policy.retopology_gpu_s))
    acts.append(Candidate(Action.DRAIN_CHECKPOINT, policy.drain_checkpoint_gpu_s))
    acts.append(Candidate(Action.REQUEUE, policy.requeue_gpu_s))
    return tuple(sorted(acts, key=lambda c: c.cost_gpu_s))


@dataclass(frozen=True)
class SlowIteration:
    """One observed iteration of a slowed job.

    ``t_slow_s``: the measured iteration time (s); ``t_healthy_s``: the job's
    healthy iteration time (s); ``gpus``: GPUs held by the job.
    """

    t_slow_s: float
    t_healthy_s: float
    gpus: int

    def impact_gpu_s(self) -> float:
        """GPU-seconds lost in this iteration; a fast iteration costs nothing."""
        for name in ("t_slow_s", "t_healthy_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise InputError(f"escalation: {name}={v!r} must be a finite number of seconds >= 0")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise InputError(f"escalation: gpus={self.gpus!r} must be an integer >= 1")
        return max(0.0, self.t_slow_s - self.t_healthy_s) * self.gpus


@dataclass(frozen=True)
class EscalationState:
    """Where one fail-slow event stands: what it has cost and what was done."""

    impact_gpu_s: float = 0.0
    slow_iters: int = 0
    taken: tuple[Action, ...] = field(default_factory=tuple)

    @property
    def current(self) -> Action:
        """The tier in force: the last action taken, IGNORE before any."""
        return self.taken[-1] if self.taken else Action.IGNORE


@dataclass(frozen=True)
class EscalationStep:
    """Result of one observation.

    ``due``: the action to apply now (None: keep the current tier).
    ``skipped``: cheaper actions whose cost was passed in the same step; the
    ski-rental argument says the costliest affordable action dominates them.
    """

    state: EscalationState
    due: Action | None
    skipped: tuple[Action, ...] = ()


def escalate(
    state: EscalationState, candidates: Sequence[Candidate], obs: SlowIteration
) -> EscalationStep:
    """Add one iteration's slowdown to ``state``; say which action is due.

    An action is due when the accumulated impact reaches (>=) its cost and it
    lies beyond the actions already taken, in the order of ``candidates``.
    """
    impact = state.impact_gpu_s + obs.impact_gpu_s()
    slow = obs.t_slow_s > obs.t_healthy_s
    new_state = replace(state, impact_gpu_s=impact, slow_iters=state.slow_iters + (1 if slow else 0))
    done = len(state.taken)
    passed = [c.action for c in candidates[done:] if impact >= c.cost_gpu_s]
    # Costs are sorted, so the passed ones are a prefix of the remaining ones.
    if not passed:
        return EscalationStep(new_state, None)
    due = passed[-1]
    skipped = tuple(passed[:-1])
    new_state = replace(new_state, taken=state.taken + skipped + (due,))
    return EscalationStep(new_state, due, skipped)


class SkiRentalEscalator:
    """Stateful wrapper of :func:`escalate` for one fail-slow event.

    ``candidates`` must be sorted by cost (use :func:`candidate_actions`).
    """

    def __init__(self, candidates: Sequence[Candidate], state: EscalationState | None = None) -> None:
        costs = [c.cost_gpu_s for c in candidates]
        if costs != sorted(costs):
            raise ValueError("escalation candidates must be sorted by cost")
        self.candidates = tuple(candidates)
        self.state = state or EscalationState()

    @classmethod
    def for_event(
        cls,
        policy: EscalationPolicy,
        cause: RootCause | str,
        *,
        opted_in: bool = True,
        dp_groups: int = 2,
        pp_stages: int = 2,
    ) -> SkiRentalEscalator:
        return cls(
            candidate_actions(policy, cause, opted_in=opted_in, dp_groups=dp_groups, pp_stages=pp_stages)
        )

    def observe(self, t_slow_s: float, t_healthy_s: float, gpus: int) -> Action | None:
        """Record one iteration (seconds, seconds, GPUs); return the action due now."""
        step = escalate(self.state, self.candidates, SlowIteration(t_slow_s, t_healthy_s, gpus))
        self.state = step.state
        return step.due

    @property
    def current(self) -> Action:
        return self.state.current

    @property
    def exhausted(self) -> bool:
        """True once the last (costliest) action has been taken."""
        return len(self.state.taken) >= len(self.candidates)

    def next_candidate(self) -> Candidate | None:
        done = len(self.state.taken)
        return self.candidates[done] if done < len(self.candidates) else None
