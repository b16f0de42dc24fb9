"""The ski-rental rule (Greyhound Algorithm 1): when the next action is due.

This module is the one place that decides "act when the accumulated cost reaches
the next action's price"; the controller, the ``plan escalation`` command and the
per-iteration form below all call :func:`due`.

A fail-slow event starts in S1 (ignore). Each slow iteration "rents": it costs
``(t_slow - t_healthy) * gpus`` GPU-seconds. The candidate actions for the
event's root cause are sorted by their one-off cost (policy
``response.escalation``, GPU-seconds); an action is due as soon as the
accumulated cost of the event reaches (>=) its cost ("buy the skis when the
rent paid equals the price"). The accumulated cost is not reset after an
action: an effective action lowers ``t_slow`` and so slows the accumulation, an
ineffective one lets it run on to the next tier.

Two consumers pick from the due actions:
- in-job actions (S2 rebalance, S3 retopology) and the per-iteration
  :class:`SkiRentalEscalator`: the costliest due action not yet taken; the
  cheaper ones passed in the same step are dominated and recorded as skipped;
- the Slurm-side gate (:func:`gate`): the strongest :class:`Tier` up to the
  one the impact calls for (:func:`slurmguard.respond.tiers.classify`) whose
  price is paid. A stall makes no progress, so its rent is unbounded and a
  stall that calls for a requeue skips the gate.

Everything here is a pure function of the assessment, the policy and the
actions already taken (kept in the incident), so a restarted controller
decides the same without repeating an action.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from slurmguard.config import EscalationPolicy
from slurmguard.errors import InputError
from slurmguard.respond.tiers import JobAssessment, Tier


class Action(StrEnum):
    """Mitigation tiers in the ski-rental order."""

    IGNORE = "ignore"  # S1: the state before any action
    REBALANCE = "rebalance"  # S2: micro-batch redistribution
    RETOPOLOGY = "retopology"  # S3: consolidation / DP-PP role swap
    DRAIN_CHECKPOINT = "drain_checkpoint"  # S4a: drain, free the node at the next checkpoint
    REQUEUE = "requeue"  # S4b: checkpoint-and-restart on healthy nodes now


IN_JOB = frozenset({Action.REBALANCE, Action.RETOPOLOGY})
"""Actions the job applies itself (it must have opted in); the others act on Slurm."""

_TIER_OF = {Action.DRAIN_CHECKPOINT: Tier.DRAIN, Action.REQUEUE: Tier.REQUEUE}


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


# ------------------------------------------------------------------ the rule
def due(
    paid_gpu_s: float, candidates: Sequence[Candidate], taken: Collection[Action] = ()
) -> tuple[Action, ...]:
    """The actions not yet taken whose price ``paid_gpu_s`` has reached, in candidate order.

    The single statement of the rule: everything that asks "is it time?" asks here.
    """
    return tuple(c.action for c in candidates if c.action not in taken and paid_gpu_s >= c.cost_gpu_s)


def iterations_to_pay(cost_gpu_s: float, per_iteration_gpu_s: float) -> int | None:
    """Slow iterations after which :func:`due` names an action of this cost, under a
    constant slowdown of ``per_iteration_gpu_s``; None when nothing is lost per iteration."""
    if per_iteration_gpu_s <= 0:
        return None
    n = max(0, math.ceil(cost_gpu_s / per_iteration_gpu_s))
    cand = (Candidate(Action.IGNORE, cost_gpu_s),)
    while not due(n * per_iteration_gpu_s, cand):  # float rounding of the quotient
        n += 1
    return n


def rent_gpu_s(t_slow_s: float, t_healthy_s: float, gpus: int) -> float:
    """GPU-seconds lost in one iteration (s, s, GPUs); a fast iteration costs nothing."""
    for name, v in (("t_slow_s", t_slow_s), ("t_healthy_s", t_healthy_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InputError(f"escalation: {name}={v!r} must be a finite number of seconds >= 0")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InputError(f"escalation: gpus={gpus!r} must be an integer >= 1")
    return max(0.0, t_slow_s - t_healthy_s) * gpus


def accumulated_cost_gpu_s(a: JobAssessment, now: float) -> float:
    """Cost of a job's slowdown so far: slow iterations x (t_slow - t_healthy) x GPUs.

    Derived from the assessment alone (onset, step times), so a restarted
    controller computes the same figure without remembering anything.
    """
    if a.onset is None or not a.baseline_s or not a.current_s or a.current_s <= a.baseline_s:
        return 0.0
    slow_iterations = max(0.0, now - a.onset) / a.current_s
    return slow_iterations * (a.current_s - a.baseline_s) * max(1, a.gpus)


# ------------------------------------------------------------------ the controller's decision
@dataclass(frozen=True)
class InJob:
    """What a job opted in to (its Slurm comment): pipeline stages; the DP groups follow
    from its GPUs."""

    pp: int = 1


@dataclass(frozen=True)
class Decision:
    """What the rule says for one job now.

    ``tier``: the Slurm-side tier to act at (NONE, DRAIN or REQUEUE; never above
    the tier the impact called for); ``in_job``: the in-job action due now
    (only while ``tier`` is below DRAIN), None if none; ``skipped``: cheaper
    in-job actions passed in the same step; ``paid_gpu_s``: the accumulated cost.
    """

    tier: Tier
    paid_gpu_s: float
    in_job: Action | None = None
    skipped: tuple[Action, ...] = ()


def gate(
    a: JobAssessment,
    tier: Tier,
    policy: EscalationPolicy,
    now: float,
    *,
    in_job: InJob | None = None,
    taken: Collection[Action | str] = (),
) -> Decision:
    """Apply the rule to a job whose impact calls for ``tier`` (from classify).

    ``a.onset`` must be the event's onset (the incident's, which survives the
    agents' rolling windows); ``taken``: in-job actions already taken for the
    event (names or Actions). The Slurm tier is the strongest one up to ``tier``
    whose price is paid; below DRAIN, the costliest due in-job action is named.
    """
    if tier <= Tier.VERIFY:
        return Decision(tier, 0.0)
    paid = accumulated_cost_gpu_s(a, now)
    if a.stalled_for_s > 0 and tier == Tier.REQUEUE:
        return Decision(Tier.REQUEUE, paid)  # a stall makes no progress: the rent is unbounded
    world = max(1, a.gpus)
    opted = in_job is not None and world % in_job.pp == 0
    pp = in_job.pp if in_job is not None else 1
    cands = candidate_actions(policy, RootCause.COMPUTE, opted_in=opted, dp_groups=world // pp, pp_stages=pp)
    slurm_side = [c for c in cands if c.action in _TIER_OF and _TIER_OF[c.action] <= tier]
    gated = max((_TIER_OF[x] for x in due(paid, slurm_side)), default=Tier.NONE)
    if gated >= Tier.DRAIN or not opted:
        return Decision(gated, paid)
    done = {Action(x) for x in taken}
    now_due = due(paid, [c for c in cands if c.action in IN_JOB], done)
    if not now_due:
        return Decision(gated, paid)
    return Decision(gated, paid, now_due[-1], now_due[:-1])


# ------------------------------------------------------------------ per-iteration form
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
        return rent_gpu_s(self.t_slow_s, self.t_healthy_s, self.gpus)


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


def escalate(state: EscalationState, candidates: Sequence[Candidate], obs: SlowIteration) -> EscalationStep:
    """Add one iteration's slowdown to ``state``; say which action is due (:func:`due`)."""
    impact = state.impact_gpu_s + obs.impact_gpu_s()
    slow = obs.t_slow_s > obs.t_healthy_s
    new_state = replace(state, impact_gpu_s=impact, slow_iters=state.slow_iters + (1 if slow else 0))
    passed = due(impact, candidates, state.taken)
    if not passed:
        return EscalationStep(new_state, None)
    new_state = replace(new_state, taken=state.taken + passed)
    return EscalationStep(new_state, passed[-1], passed[:-1])


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
