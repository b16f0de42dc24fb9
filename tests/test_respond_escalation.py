"""Ski-rental escalation (Greyhound Algorithm 1) with known answers."""

from __future__ import annotations

import pytest

from slurmguard.config import EscalationPolicy, Policy
from slurmguard.errors import InputError
from slurmguard.respond.escalation import (
    Action,
    Candidate,
    EscalationState,
    SkiRentalEscalator,
    SlowIteration,
    candidate_actions,
    escalate,
)

POLICY = EscalationPolicy(
    rebalance_gpu_s=60, retopology_gpu_s=600, drain_checkpoint_gpu_s=1800, requeue_gpu_s=3600
)


def test_candidates_follow_table_2_and_are_sorted_by_cost():
    def names(cs):
        return [c.action for c in cs]

    assert names(candidate_actions(POLICY, "compute")) == [
        Action.REBALANCE,
        Action.RETOPOLOGY,
        Action.DRAIN_CHECKPOINT,
        Action.REQUEUE,
    ]
    # S2 has no effect on slow communication.
    assert names(candidate_actions(POLICY, "communication")) == [
        Action.RETOPOLOGY,
        Action.DRAIN_CHECKPOINT,
        Action.REQUEUE,
    ]
    assert names(candidate_actions(POLICY, "compute", opted_in=False)) == [
        Action.DRAIN_CHECKPOINT,
        Action.REQUEUE,
    ]
    assert names(candidate_actions(POLICY, "compute", dp_groups=1, pp_stages=1)) == [
        Action.DRAIN_CHECKPOINT,
        Action.REQUEUE,
    ]
    cheap_restart = EscalationPolicy(
        rebalance_gpu_s=60, retopology_gpu_s=600, drain_checkpoint_gpu_s=100, requeue_gpu_s=3600
    )
    assert names(candidate_actions(cheap_restart, "compute"))[:2] == [
        Action.REBALANCE,
        Action.DRAIN_CHECKPOINT,
    ]
    with pytest.raises(ValueError):
        candidate_actions(POLICY, "cosmic-rays")


def test_defaults_come_from_the_policy():
    cs = candidate_actions(Policy().response.escalation, "compute")
    assert [c.cost_gpu_s for c in cs] == [60.0, 600.0, 1800.0, 3600.0]


def test_constant_slowdown_escalates_when_rent_equals_price():
    # 0.5 s lost per iteration on 8 GPUs = 4 GPU-s per iteration.
    esc = SkiRentalEscalator.for_event(POLICY, "compute")
    due = {}
    for i in range(1, 1001):
        a = esc.observe(1.5, 1.0, 8)
        if a is not None:
            due[a] = i
    assert due == {
        Action.REBALANCE: 15,
        Action.RETOPOLOGY: 150,
        Action.DRAIN_CHECKPOINT: 450,
        Action.REQUEUE: 900,
    }
    assert esc.exhausted and esc.current is Action.REQUEUE
    assert esc.state.slow_iters == 1000 and esc.state.impact_gpu_s == 4000.0


def test_effective_mitigation_slows_the_escalation():
    esc = SkiRentalEscalator.for_event(POLICY, "compute")
    taken_at = None
    for i in range(1, 16):
        if esc.observe(1.5, 1.0, 8) is Action.REBALANCE:
            taken_at = i
    assert taken_at == 15 and esc.state.impact_gpu_s == 60.0
    # Rebalanced: 0.05 s lost per iteration -> 0.4 GPU-s; 540 more GPU-s needed for S3.
    steps = 0
    while esc.observe(1.05, 1.0, 8) is None:
        steps += 1
        assert steps < 5000
    assert esc.current is Action.RETOPOLOGY
    assert steps + 1 == pytest.approx(1350, abs=1)  # 540 / 0.4, up to float rounding


def test_fast_iterations_cost_nothing_and_are_not_slow():
    st = escalate(EscalationState(), candidate_actions(POLICY, "compute"), SlowIteration(0.9, 1.0, 8))
    assert st.due is None and st.state.impact_gpu_s == 0.0 and st.state.slow_iters == 0


def test_a_stall_jumps_to_the_costliest_affordable_action():
    cands = candidate_actions(POLICY, "compute")
    step = escalate(EscalationState(), cands, SlowIteration(t_slow_s=300.0, t_healthy_s=1.0, gpus=8))
    # 299 s x 8 = 2392 GPU-s: past rebalance, retopology and drain, short of requeue.
    assert step.due is Action.DRAIN_CHECKPOINT
    assert step.skipped == (Action.REBALANCE, Action.RETOPOLOGY)
    assert step.state.current is Action.DRAIN_CHECKPOINT
    nxt = escalate(step.state, cands, SlowIteration(152.0, 1.0, 8))  # +1208 = 3600 exactly
    assert nxt.due is Action.REQUEUE and nxt.skipped == ()


def test_state_resumes_after_restart_without_repeating_actions():
    cands = candidate_actions(POLICY, "communication")
    a = SkiRentalEscalator(cands)
    for _ in range(150):
        a.observe(1.5, 1.0, 8)
    assert a.current is Action.RETOPOLOGY
    b = SkiRentalEscalator(cands, state=a.state)  # e.g. loaded from the database
    assert b.observe(1.5, 1.0, 8) is None
    assert b.next_candidate() == Candidate(Action.DRAIN_CHECKPOINT, 1800.0)


def test_unsorted_candidates_are_refused():
    with pytest.raises(ValueError):
        SkiRentalEscalator([Candidate(Action.REQUEUE, 10.0), Candidate(Action.REBALANCE, 5.0)])


@pytest.mark.parametrize(
    "obs", [SlowIteration(float("nan"), 1.0, 8), SlowIteration(1.0, -1.0, 8), SlowIteration(1.0, 1.0, 0)]
)
def test_bad_observations_are_input_errors(obs):
    with pytest.raises(InputError):
        obs.impact_gpu_s()


# ---------------------------------------------------------------- the controller's decision
def _job(slowdown=0.5, onset=0.0, gpus=8, stalled=0.0):
    from slurmguard.respond.tiers import JobAssessment

    return JobAssessment(
        job_id=1,
        nodes=("n1",),
        gpus=gpus,
        baseline_s=1.0,
        current_s=1.0 + slowdown,
        onset=onset,
        stalled_for_s=stalled,
    )


def test_decide_gates_the_slurm_tier_by_price_and_never_exceeds_the_called_tier():
    from slurmguard.respond.escalation import accumulated_cost_gpu_s, gate
    from slurmguard.respond.tiers import Tier

    a = _job()  # 0.5 s x 8 GPUs per 1.5 s iteration: 8/3 GPU-s per second
    assert accumulated_cost_gpu_s(a, 1.5 * 450) == pytest.approx(1800.0)
    assert gate(a, Tier.REQUEUE, POLICY, 1.5 * 449).tier is Tier.NONE
    assert gate(a, Tier.REQUEUE, POLICY, 1.5 * 450).tier is Tier.DRAIN
    assert gate(a, Tier.REQUEUE, POLICY, 1.5 * 900).tier is Tier.REQUEUE
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 900).tier is Tier.DRAIN  # the impact caps the tier
    assert gate(a, Tier.VERIFY, POLICY, 1e9).tier is Tier.VERIFY
    # a stall makes no progress: the requeue it calls for is not gated
    assert gate(_job(stalled=5.0), Tier.REQUEUE, POLICY, 0.0).tier is Tier.REQUEUE


def test_decide_names_the_costliest_due_in_job_action_once():
    from slurmguard.respond.escalation import InJob, gate
    from slurmguard.respond.tiers import Tier

    a = _job()
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 14).in_job is None
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 15).in_job is None  # not opted in: Slurm tiers only
    d = gate(a, Tier.DRAIN, POLICY, 1.5 * 15, in_job=InJob(pp=2))
    assert d.tier is Tier.NONE and d.in_job is Action.REBALANCE and d.skipped == ()
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 20, in_job=InJob(pp=2), taken=["rebalance"]).in_job is None
    d = gate(a, Tier.DRAIN, POLICY, 1.5 * 150, in_job=InJob(pp=2))
    assert d.in_job is Action.RETOPOLOGY and d.skipped == (Action.REBALANCE,)
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 150, in_job=InJob(pp=3)).in_job is None  # 8 GPUs % 3
    assert gate(a, Tier.DRAIN, POLICY, 1.5 * 450, in_job=InJob(pp=2)).in_job is None  # drain due


def test_iterations_to_pay_is_the_rule_inverted():
    from slurmguard.respond.escalation import due, iterations_to_pay

    assert iterations_to_pay(60.0, 4.0) == 15 and iterations_to_pay(60.0, 0.0) is None
    for cost, per in [(1800.0, 0.1), (600.0, 0.3), (1.0, 3.0)]:
        n = iterations_to_pay(cost, per)
        c = (Candidate(Action.REQUEUE, cost),)
        assert due(n * per, c) and not due((n - 1) * per, c)
