"""The cvxpy reference formulation of Greyhound Eq. 1 (min-max form), a MILP.

    minimise z  s.t.  m_i * t_i <= z,  sum_i m_i = M,  m_i = pp * k_i,  k_i >= 1 integer

Greyhound solves Eq. 1 with cvxpy; we keep the same modelling route as the
reference that the exact algorithm in ``microbatch.py`` is checked against. The
paper's variance form is an integer *quadratic* program that the free solvers
shipped with cvxpy either cannot take or do not solve to optimality, so the
min-max form (equivalent objective at the optimum) is the reference.

cvxpy is an optional dependency (extra ``plan``); it is imported on first use.
"""

from __future__ import annotations

from collections.abc import Sequence

from slurmguard.errors import SlurmguardError
from slurmguard.mitigate.microbatch import MicrobatchPlan, makespan, validate_problem

DEFAULT_SOLVER = "HIGHS"


class SolverError(SlurmguardError):
    """The MILP solver is missing or did not return an optimal solution."""


def plan_microbatches_milp(
    times: Sequence[float], total: int, pp: int = 1, solver: str = DEFAULT_SOLVER
) -> MicrobatchPlan:
    """Solve Eq. 1 (min-max form) with cvxpy and a MILP solver (default HiGHS).

    The relative MIP gap is set to 0: HiGHS' default (1e-4) may stop at a plan
    one micro-batch away from the optimum on large instances.
    """
    ts = validate_problem(times, total, pp)
    try:
        import cvxpy as cp
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SolverError("cvxpy is not installed (pip install 'slurmguard[plan]')") from exc
    if solver not in cp.installed_solvers():
        raise SolverError(f"cvxpy solver {solver} is not installed")
    pp = int(pp)
    d = len(ts)
    k = cp.Variable(d, integer=True)
    z = cp.Variable()
    scaled = ts * pp
    cons = [k >= 1, cp.sum(k) == int(total) // pp, cp.multiply(scaled, k) <= z]
    prob = cp.Problem(cp.Minimize(z), cons)
    opts: dict[str, object] = {}
    if solver == "HIGHS":
        opts = {"mip_rel_gap": 0.0, "mip_abs_gap": 0.0}
    try:
        prob.solve(solver=solver, **opts)
    except cp.error.SolverError as exc:
        raise SolverError(f"cvxpy/{solver} failed: {exc}") from exc
    if prob.status != cp.OPTIMAL or k.value is None:
        raise SolverError(f"cvxpy/{solver} returned status {prob.status}")
    m = tuple(round(float(v)) * pp for v in k.value)
    if sum(m) != total:  # rounding of an integral solution must not lose units
        raise SolverError(f"cvxpy/{solver} returned counts summing to {sum(m)}, not {total}")
    return MicrobatchPlan(m=m, makespan=makespan(m, ts))
