"""Mitigation planners (Greyhound section 5): cheaper tiers before drain/requeue.

- ``microbatch``: S2, micro-batch redistribution across DP groups (Eq. 1), exact.
- ``reference``: the cvxpy MILP formulation of Eq. 1 the exact planner is checked against.
- ``topology``: S3, straggler consolidation into the fewest PP stages and the DP/PP role swap.
- ``escalation``: the ski-rental rule that picks the tier (Algorithm 1).
- ``client``: what a training loop calls every N steps to fetch its plan.

cvxpy and torch are imported only by the modules that need them.
"""
