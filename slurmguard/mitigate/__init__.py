"""Mitigation planners (Greyhound section 5): cheaper tiers before drain/requeue.

- ``microbatch``: S2, micro-batch redistribution across DP groups (Eq. 1), exact.
- ``reference``: the cvxpy MILP formulation of Eq. 1 the exact planner is checked against.
- ``topology``: S3, straggler consolidation into the fewest PP stages and the DP/PP role swap.
- ``client``: what a training loop calls every N steps to fetch its plan.

The ski-rental rule that says when each tier is due lives with the other
responses, in ``slurmguard.respond.escalation``. cvxpy and torch are imported only by the modules that need them.
"""

from slurmguard.mitigate.client import PlanClient, PlanPoller
from slurmguard.mitigate.microbatch import MicrobatchPlan, makespan, plan_microbatches
from slurmguard.mitigate.plan import JobPlan, RankShare, rank_share
from slurmguard.mitigate.topology import (
    ConsolidationPlan,
    Layout,
    RoleSwapPlan,
    Swap,
    hybrid_comm_bytes,
    plan_consolidation,
    plan_role_swap,
)

__all__ = [
    "ConsolidationPlan",
    "JobPlan",
    "Layout",
    "MicrobatchPlan",
    "PlanClient",
    "PlanPoller",
    "RankShare",
    "RoleSwapPlan",
    "Swap",
    "hybrid_comm_bytes",
    "makespan",
    "plan_consolidation",
    "plan_microbatches",
    "plan_role_swap",
    "rank_share",
]
