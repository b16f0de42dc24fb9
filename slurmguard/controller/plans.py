"""Mitigation plans the controller serves to opted-in jobs (Greyhound S2), and the
job's opt-ins read from its Slurm comment.

A job opts in with its Slurm comment, `--comment=slurmguard:ITEM[,ITEM...]`:
- `mitigate,microbatches=M[,pp=P]`: in-job mitigation (M = micro-batches in its
  global batch, 1..65536, a multiple of P; P = pipeline stages, 1..1024, default
  1; ranks in Megatron order, stage-major: rank = stage * dp + dp_rank);
- `signal[=NAME]`: when a node under the job is drained, send it NAME (default
  response.tiers.checkpoint_signal) to ask for a checkpoint; NAME is one of
  CHECKPOINT_SIGNALS. A job without it is drained under and left running.
The comment belongs to the job's user, so every value is bounded and checked:
a bad item is ignored and named in `JobOptions.problems` (recorded in the job's
incident), never an exception in the controller. Slurm 22.05 does not report a
job's own `--signal` in squeue or scontrol (checked), so the comment is the way
to ask. In the
ski-rental order of Greyhound Algorithm 1, once its slowdown has cost:
- response.escalation.rebalance_gpu_s (S2, needs dp >= 2): micro-batch counts
  per DP group from each group's measured time per micro-batch
  (slurmguard.mitigate.plan_microbatches, exact; multiples of P);
- response.escalation.retopology_gpu_s (S3, needs pp >= 2): role swaps that
  consolidate the slow ranks into the fewest, interior PP stages
  (slurmguard.mitigate.plan_consolidation);
then drain and requeue at their own prices. Plans are served at
/v1/jobs/<id>/plan for the training loop (slurmguard.mitigate.client) and
kept in the incident's evidence, so a restarted controller serves the same.

An S2 plan is planned from, and judged on, the job's own iterations
(`timings_since`): the first from those since the slowdown's onset only (a
window reaching back before it mixes healthy iterations in and under-states
the slow rank: a plan of 9/7 came out of one, against 12/4 from the slowed
iterations alone, and left the job as slow as before). Every cycle after
PLAN_SETTLE_S, the job's step under the plan is compared with its step
before it (`PlanBook.review`): a split under which the job is not faster is
withdrawn (back to the split before it; from the uniform split a rebalance is
planned afresh after a back-off, PLAN_RETRY_S), so a mitigation that makes a
job slower never stays in force (nor is served again before a back-off);
one that helps is re-planned from
the compute under it (Eq. 1 on per-micro-batch times measured under the
current split, PLAN_MIN_GAIN predicted at least), which follows the slow
rank's fixed per-step work that no split moves (its optimizer step and its
share of the gradient all-reduce, about 20 of its 77 ms of CPU a step in
the ddp workload at 8 micro-batches, 7 ms each), and a node that recovers
gets the uniform split back. What the hooks see as a capped rank's compute
understates it once it no longer holds the others up (the cap throttles it
inside its collectives too, which count as communication): a re-plan from it
can move work back to the slow rank, and the step-time judgement is what
undoes such a move.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurmguard.controller.assess import steps_since, window_stats, window_tail
from slurmguard.mitigate.microbatch import makespan, plan_microbatches
from slurmguard.mitigate.plan import JobPlan
from slurmguard.mitigate.topology import Layout, plan_consolidation
from slurmguard.wire import RankReport

_OPT_IN = re.compile(r"slurmguard:(\S{0,256})")
MAX_MICROBATCHES = 65536
MAX_PP = 1024
#: signals a job may ask to receive; never KILL or STOP, which a job cannot handle
CHECKPOINT_SIGNALS = frozenset({"USR1", "USR2", "TERM", "INT", "HUP", "URG", "CONT"})
#: seconds after a split is served before the iterations that judge it begin:
#: the job picks it up at its next poll (every --plan-every steps) and
#: switches at the step after; a job polling less often than this is judged
#: on iterations of its old split (no faster: withdrawn, a safe miss)
PLAN_SETTLE_S = 2.0
#: iterations of every rank, at least, that a split is planned from or judged on
PLAN_MIN_ITERS = 5
#: predicted gain (fraction of the slowest group's time) below which no new
#: split is served: measured compute scatters by a few percent from window to
#: window, and a split that cannot win more would only chase that noise
PLAN_MIN_GAIN = 0.05
#: seconds after a split is withdrawn to the uniform one before a split is
#: planned again from fresh iterations, doubled at every further withdrawal
#: (PLAN_RETRY_MAX_S at most): a split can fail for a reason that passes (on
#: the shared dev machine, other work starving the healthy rank: 12/4 ran 672
#: ms against 536 ms uniform while the load average rose from 6 to 9), and
#: the back-off bounds what a split that keeps failing costs
PLAN_RETRY_S = 10.0
PLAN_RETRY_MAX_S = 600.0


@dataclass(frozen=True)
class OptIn:
    microbatches: int
    pp: int = 1


@dataclass(frozen=True)
class JobOptions:
    """What a job asked for in its comment. signal: the checkpoint signal name
    (without SIG) or None; problems: items that were ignored, and why."""

    mitigate: OptIn | None = None
    signal: str | None = None
    problems: tuple[str, ...] = ()


def _bounded_int(item: str, value: str, lo: int, hi: int, problems: list[str]) -> int | None:
    if not value.isdigit() or len(value) > 6 or not lo <= int(value) <= hi:
        problems.append(f"{item}: expected an integer {lo}..{hi}")
        return None
    return int(value)


def job_options(comment: str | None, default_signal: str = "USR1") -> JobOptions:
    """The opt-ins of a job from its Slurm comment (see the module docstring)."""
    m = _OPT_IN.search(comment or "")
    if m is None:
        return JobOptions()
    problems: list[str] = []
    mitigate = False
    mb: int | None = None
    pp: int | None = 1
    signal: str | None = None
    for item in filter(None, m.group(1).split(",")):
        key, eq, value = item.partition("=")
        if key == "mitigate" and not eq:
            mitigate = True
        elif key == "microbatches" and eq:
            mb = _bounded_int(item, value, 1, MAX_MICROBATCHES, problems)
        elif key == "pp" and eq:
            pp = _bounded_int(item, value, 1, MAX_PP, problems)
        elif key == "signal":
            name = value.upper().removeprefix("SIG") if eq else default_signal.removeprefix("SIG")
            if name in CHECKPOINT_SIGNALS:
                signal = name
            else:
                problems.append(f"{item}: signal must be one of {', '.join(sorted(CHECKPOINT_SIGNALS))}")
        else:
            problems.append(
                f"{item[:40]}: unknown item (known: mitigate, microbatches=M, pp=P, signal[=NAME])"
            )
    opt = None
    if mitigate:
        if mb is None or pp is None:
            problems.append("mitigate: needs microbatches=M (and a valid pp=P)")
        elif mb % pp:
            problems.append(f"mitigate: microbatches={mb} is not a multiple of pp={pp}")
        else:
            opt = OptIn(microbatches=mb, pp=pp)
    return JobOptions(mitigate=opt, signal=signal, problems=tuple(problems))


def opt_in(comment: str | None) -> OptIn | None:
    """The job's mitigation opt-in from its Slurm comment, or None."""
    return job_options(comment).mitigate


@dataclass(frozen=True)
class Timings:
    """What a job's ranks did over one span of iterations. step_s: the job's
    step (s; median over ranks of each rank's trimmed-mean step); compute_s:
    rank -> its trimmed-mean compute (step minus time inside collectives, s);
    iterations: the fewest any rank has in the span."""

    step_s: float
    compute_s: dict[int, float]
    iterations: int


def timings_since(ranks: list[tuple[str, RankReport]], since: float | None) -> Timings | None:
    """Each rank's recent iterations that ended after `since` (Unix s; the
    localisation window of controller.assess, trimmed means as there), or None
    when a rank has none."""
    windows = [window_tail(steps_since(r.steps, since)) for _, r in ranks]
    if not windows or min(len(w) for w in windows) == 0:
        return None
    step, compute, _, _ = window_stats(windows, 1.0)
    return Timings(
        step_s=float(np.median(step)),
        compute_s={r.rank: float(c) for (_, r), c in zip(ranks, compute.tolist())},
        iterations=min(len(w) for w in windows),
    )


def _back_off(n: int) -> float:
    """Seconds a split withdrawn for the n-th time waits before it is served
    again (PLAN_RETRY_S doubled per withdrawal, PLAN_RETRY_MAX_S at most)."""
    return min(PLAN_RETRY_S * 2 ** (n - 1), PLAN_RETRY_MAX_S)


def uniform_counts(total: int, dp: int, pp: int = 1) -> tuple[int, ...]:
    """The split a job runs without a plan (multiples of pp, remainder to the first groups)."""
    base = total // (dp * pp) * pp
    extra = (total - base * dp) // pp
    return tuple(base + (pp if d < extra else 0) for d in range(dp))


def propose(
    compute_s: dict[int, float], counts: tuple[int, ...], total: int, pp: int = 1
) -> tuple[tuple[int, ...], float] | None:
    """Greyhound Eq. 1 from each rank's compute per step (s) under `counts`
    (micro-batches per DP group): (new counts, predicted time of the slowest
    group, s), or None when no split is predicted to beat `counts` by
    PLAN_MIN_GAIN. A DP group's time per micro-batch is that of its slowest
    stage (a pipeline runs at the pace of its slowest stage); ranks are in
    Megatron order (rank = stage * dp + dp_rank)."""
    dp = len(counts)
    per_mb = [max(max(compute_s[s * dp + d] for s in range(pp)), 1e-6) / counts[d] for d in range(dp)]
    plan = plan_microbatches(per_mb, total, pp)
    now = makespan(counts, per_mb)
    if plan.m == counts or plan.makespan > now * (1.0 - PLAN_MIN_GAIN):
        return None
    return plan.m, plan.makespan


@dataclass
class _Review:
    """How the split in force is judged. before_s: the job's step under the
    split it replaced (s; inf: nothing to compare with, a split restored by a
    withdrawal or by a restarted controller); previous: that split (None:
    uniform); rejected: split -> (Unix s before which it is not served again,
    times it was withdrawn), see PlanBook.review; withdrawals: to the uniform
    split so far; retry_at: Unix s from which a withdrawn rebalance is planned
    afresh (None: none)."""

    version: int
    issued_at: float
    before_s: float = math.inf
    previous: tuple[int, ...] | None = None
    rejected: dict[tuple[int, ...], tuple[float, int]] = field(default_factory=dict)
    withdrawals: int = 0
    retry_at: float | None = None


class PlanBook:
    def __init__(self) -> None:
        self._plans: dict[int, JobPlan] = {}
        self._reviews: dict[int, _Review] = {}
        self._lock = threading.Lock()

    def get(self, job_id: int) -> JobPlan | None:
        with self._lock:
            return self._plans.get(job_id)

    def put(self, plan: JobPlan) -> None:
        with self._lock:
            self._plans[int(plan.job_id)] = plan

    def served(self, job_id: int) -> dict | None:
        p = self.get(job_id)
        return None if p is None else p.model_dump(mode="json")

    def rebalance(
        self,
        job_id: int,
        compute_s: dict[int, float],
        total: int,
        pp: int = 1,
        *,
        before_s: float = math.inf,
        now: float = 0.0,
    ) -> JobPlan | None:
        """S2 plan from each rank's compute time per step (s) under the current
        split (`propose`); None when none is predicted to help. before_s: the
        job's step under the current split (s), which the plan is judged
        against from `now` (Unix s) on (`review`)."""
        ranks = sorted(compute_s)
        world = len(ranks)
        if ranks != list(range(world)) or world % pp:
            return None
        dp = world // pp
        if dp < 2 or total < dp * pp:
            return None
        current = self.get(job_id)
        if current is not None and current.microbatches is not None and len(current.microbatches) == dp:
            counts = tuple(current.microbatches)
        else:
            counts = uniform_counts(total, dp, pp)
        best = propose(compute_s, counts, total, pp)
        if best is None:
            return None  # the current split is already (about) the best one: nothing to serve
        new = self._next(job_id, current, action="rebalance", microbatches=best[0], pp=pp, makespan_s=best[1])
        with self._lock:
            self._reviews[job_id] = _Review(new.version, now, before_s, counts)
        return new

    def judged_from(self, job_id: int) -> float | None:
        """Unix s from which the iterations judge the split in force, or plan a
        withdrawn one afresh (None: nothing to judge)."""
        plan, st = self.get(job_id), self._reviews.get(job_id)
        if plan is None or st is None or st.version != plan.version:
            return None
        if plan.microbatches is None and st.retry_at is None:
            return None
        return st.issued_at + PLAN_SETTLE_S

    def review(
        self, job_id: int, t: Timings | None, total: int, pp: int = 1, now: float = 0.0
    ) -> tuple[JobPlan | None, str]:
        """Judge the split in force on `t` (the job's iterations since
        `judged_from`): (the plan that replaces it, why), or (None, "") to keep
        it. Not faster than before it (t.step_s >= before_s): withdrawn, back
        to the split before it (uniform when there was none). Faster: re-planned
        from the compute under it when that is predicted to gain PLAN_MIN_GAIN,
        but not to a split withdrawn within its back-off (`_back_off`: PLAN_RETRY_S
        after its first withdrawal, doubled at each further one). A withdrawal
        can be noise (one step of a few ms judged against another), and a split
        barred for good held a job whose node had recovered on 13/3 for good
        (re-planned to 10/6, withdrawn on noise, 10/6 never served again: the
        CI failure of session 10). A re-plan that comes out uniform ends the
        rebalance. Withdrawn to the uniform split: planned
        afresh from the iterations since, PLAN_RETRY_S after (doubled at each
        further withdrawal), when they still predict PLAN_MIN_GAIN."""
        plan = self.get(job_id)
        if plan is None:
            return None, ""
        st = self._reviews.get(job_id)
        if plan.microbatches is None:
            return self._retry(job_id, plan, st, t, total, pp, now)
        if st is None or st.version != plan.version:
            # restored by a restarted controller: nothing measured to compare it with yet
            with self._lock:
                self._reviews[job_id] = _Review(plan.version, now)
            return None, ""
        if t is None or t.iterations < PLAN_MIN_ITERS or now < st.issued_at + PLAN_SETTLE_S:
            return None, ""
        counts = tuple(plan.microbatches)
        rejected = st.rejected
        if t.step_s >= st.before_s:
            back = st.previous if st.previous != uniform_counts(total, len(counts), pp) else None
            new = self._next(job_id, plan, action="rebalance", microbatches=back, pp=pp)
            n, retry = st.withdrawals, None
            if back is None:
                n += 1
                retry = now + _back_off(n)
            times = rejected.get(counts, (0.0, 0))[1] + 1
            with self._lock:
                self._reviews[job_id] = _Review(
                    new.version,
                    now,
                    rejected={**rejected, counts: (now + _back_off(times), times)},
                    withdrawals=n,
                    retry_at=retry,
                )
            return new, (
                f"withdrew micro-batches {list(counts)}: step {t.step_s * 1e3:.0f} ms under them, "
                f"{st.before_s * 1e3:.0f} ms before; back to {list(back) if back else 'the uniform split'}"
                + (f", planned afresh from {retry - now:.0f} s on" if retry is not None else "")
            )
        if sorted(t.compute_s) != list(range(len(counts) * pp)):
            return None, ""
        best = propose(t.compute_s, counts, total, pp)
        if best is None or rejected.get(best[0], (0.0, 0))[0] > now:
            return None, ""
        uniform = best[0] == uniform_counts(total, len(counts), pp)
        new = self._next(
            job_id,
            plan,
            action="rebalance",
            microbatches=None if uniform else best[0],
            pp=pp,
            makespan_s=None if uniform else best[1],
        )
        with self._lock:
            self._reviews[job_id] = _Review(new.version, now, t.step_s, counts, rejected, st.withdrawals)
        return new, (
            f"micro-batches {list(best[0])} (from {list(counts)}: step {t.step_s * 1e3:.0f} ms, "
            f"compute {', '.join(f'{c * 1e3:.0f}' for _, c in sorted(t.compute_s.items()))} ms per rank)"
            + ("; the uniform split again" if uniform else "")
        )

    def _retry(
        self,
        job_id: int,
        plan: JobPlan,
        st: _Review | None,
        t: Timings | None,
        total: int,
        pp: int,
        now: float,
    ) -> tuple[JobPlan | None, str]:
        """A withdrawn rebalance planned afresh (see review)."""
        if st is None or st.version != plan.version or st.retry_at is None or now < st.retry_at:
            return None, ""
        if t is None or t.iterations < PLAN_MIN_ITERS:
            return None, ""
        world = len(t.compute_s)
        if sorted(t.compute_s) != list(range(world)) or world % pp or world // pp < 2:
            return None, ""
        counts = uniform_counts(total, world // pp, pp)
        best = propose(t.compute_s, counts, total, pp)
        if best is None:
            return None, ""  # nothing to gain now (the node recovered): the uniform split stays
        new = self._next(job_id, plan, action="rebalance", microbatches=best[0], pp=pp, makespan_s=best[1])
        with self._lock:
            self._reviews[job_id] = _Review(
                new.version, now, t.step_s, None, rejected=st.rejected, withdrawals=st.withdrawals
            )
        return new, (
            f"micro-batches {list(best[0])} planned afresh after withdrawal {st.withdrawals} (uniform: step "
            f"{t.step_s * 1e3:.0f} ms, compute "
            f"{', '.join(f'{c * 1e3:.0f}' for _, c in sorted(t.compute_s.items()))} ms per rank)"
        )

    def retopology(self, job_id: int, slow_ranks: list[int], world: int, pp: int) -> JobPlan | None:
        """S3 plan: swaps that put the slow ranks into the fewest interior stages."""
        if pp < 2 or world % pp or not slow_ranks:
            return None
        layout = Layout.grid(pp, world // pp)
        plan = plan_consolidation(layout, [f"w{r}" for r in slow_ranks])
        if not plan.improves:
            return None
        current = self.get(job_id)
        return self._next(
            job_id,
            current,
            action="retopology",
            microbatches=current.microbatches if current else None,
            pp=pp,
            swaps=tuple((s.a, s.b) for s in plan.swaps),
            makespan_s=current.makespan_s if current else None,
        )

    def _next(self, job_id: int, current: JobPlan | None, **fields: Any) -> JobPlan:
        new = JobPlan(job_id=str(job_id), version=(current.version + 1) if current else 1, **fields)
        self.put(new)
        return new
