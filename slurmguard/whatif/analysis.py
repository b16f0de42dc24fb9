"""What-if analysis of one job trace: paper 004 sections 3.2, 3.3, 4, 5.1-5.3 and 6.

All times are seconds. "Original" is the simulated timeline with the recorded
durations (transfer-durations for communication), "ideal" the simulated
timeline with every op at its idealised duration (mean per op type for
computation, median per op type for communication). Then:

* S = T_original / T_ideal (Eq. 1) and per-step slowdowns (4.2);
* S_t = T(only op type t left unfixed) / T_ideal (Eq. 2), PP send+recv merged;
* waste = 1 - 1/S (Eq. 3), also per op type;
* S_w for whole DP ranks and PP stages (Eq. 4) and per worker the smaller of
  its DP rank's and its stage's (the paper's dp + pp approximation);
* M_W = (T_original - T_fix(top workers)) / (T_original - T_ideal) (Eq. 5),
  the top workers being the highest `top_worker_percent` of S_w;
* M_S, the same with the last PP stage fixed (5.2; 0 without PP);
* the simulation discrepancy, recorded vs simulated original step time (6).

Every "what if" is a scenario: a mask choosing, per slot and DP rank, the
original or the ideal duration. Scenarios are simulated together in chunks
that fit `memory_mb`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from slurmguard.whatif import optypes as ot
from slurmguard.whatif.model import DependencyModel, build_model
from slurmguard.whatif.simulate import simulate
from slurmguard.whatif.tensor import OpTensor, median
from slurmguard.whatif_policy import WhatIfPolicy


def simulation_durations(t: OpTensor, model: DependencyModel) -> np.ndarray:
    """(slot, step, dp) durations the simulator uses for the original timeline.

    Group members get their transfer-duration: their end minus the latest start
    among the group's members in the same step (all DP ranks for DP-spanning
    groups). Clock skew can make it slightly negative; it is clamped at 0.
    """
    dur = t.duration.copy()
    end = t.end
    for g, members in enumerate(model.groups):
        latest = t.start[members].max(axis=0)
        if model.group_dp_sync[g]:
            latest = latest.max(axis=-1, keepdims=True)
        dur[members] = np.maximum(end[members] - latest, 0.0)
    return dur


def idealised_durations(t: OpTensor, original: np.ndarray) -> np.ndarray:
    """(slot,) idealised duration: per op type, mean (computation) or median (communication)."""
    ideal = np.empty(t.n_slots)
    for name in sorted(set(t.slot_optype.tolist())):  # np.unique would import numpy.ma
        idx = t.slot_optype == name
        values = original[idx]
        ideal[idx] = median(values) if name in ot.MEDIAN_IDEALISED else values.mean()
    return ideal


@dataclass(frozen=True)
class Counterfactual:
    """Which durations stay original: slot_mask[slot] & worker_mask[stage, dp_rank]."""

    slot_mask: np.ndarray
    worker_mask: np.ndarray


class ScenarioRunner:
    """Simulates scenarios in memory-bounded chunks; returns (scenario, step) step times."""

    def __init__(
        self,
        t: OpTensor,
        model: DependencyModel,
        original: np.ndarray,
        ideal: np.ndarray,
        memory_mb: int,
    ) -> None:
        self.t, self.model = t, model
        self.original, self.ideal = original, ideal
        self.budget = memory_mb * 1024 * 1024
        self.simulations = 0

    def _chunk(self, lanes: int) -> int:
        # end, launch, durations and one temporary per slot, float64
        per = (self.model.n_slots + 1) * len(self.t.steps) * lanes * 8 * 4
        return max(1, self.budget // per)

    def run(self, scenarios: list[Counterfactual]) -> np.ndarray:
        n_steps, dp = self.original.shape[1:]
        out = np.empty((len(scenarios), n_steps))
        size = self._chunk(dp)
        stage = self.t.slot_stage
        for lo in range(0, len(scenarios), size):
            part = scenarios[lo : lo + size]
            # (slot, scenario, dp): keep the original duration there
            mask = np.stack([sc.slot_mask[:, None] & sc.worker_mask[stage] for sc in part], axis=1)
            dur = np.where(
                mask[:, :, None, :],
                self.original[:, None],
                self.ideal[:, None, None, None],
            )
            out[lo : lo + len(part)] = simulate(self.model, dur).step_time
            self.simulations += len(part)
        return out

    def run_dp_ranks(self, ranks: list[int], slot_masks: list[np.ndarray] | None = None) -> np.ndarray:
        """Each DP rank original (others ideal), with two lanes per scenario.

        With every other DP rank at ideal durations those ranks run identical
        timelines, so one lane stands for all of them: the DP-spanning maxima
        and the step time are unchanged, the work drops from dp to 2 lanes.
        `slot_masks[i]` limits scenario i's original durations to some slots
        (one stage: a single worker, Eq. 4 without the approximation).
        """
        n_steps = self.original.shape[1]
        out = np.empty((len(ranks), n_steps))
        size = self._chunk(2)
        for lo in range(0, len(ranks), size):
            part = ranks[lo : lo + size]
            dur = np.empty((self.model.n_slots, len(part), n_steps, 2))
            mine = self.original[:, :, part].transpose(0, 2, 1)
            if slot_masks is None:
                dur[..., 0] = mine
            else:
                sm = np.stack(slot_masks[lo : lo + len(part)], axis=1)[:, :, None]
                dur[..., 0] = np.where(sm, mine, self.ideal[:, None, None])
            dur[..., 1] = self.ideal[:, None, None]
            out[lo : lo + len(part)] = simulate(self.model, dur).step_time
            self.simulations += len(part)
        return out


@dataclass
class Diagnosis:
    """Which pattern of paper 004 section 8 (Fig. 14) the worker slowdowns show."""

    pattern: str
    """none | worker | last-stage | widespread | mixed"""
    detail: str
    affected_workers: int
    affected_fraction: float
    sequence_imbalance_likely: bool
    fidelity_ok: bool
    """False when the simulation discrepancy exceeds max_discrepancy (section 6)."""


@dataclass
class WorkerScore:
    rank: int
    dp_rank: int
    stage: int
    slowdown: float


@dataclass
class WhatIfResult:
    name: str
    dp_size: int
    pp_size: int
    steps: np.ndarray
    step_time_actual: np.ndarray
    """(T,) recorded step time, seconds."""
    step_time_original: np.ndarray
    """(T,) simulated with recorded durations, seconds."""
    step_time_ideal: np.ndarray
    """(T,) simulated with idealised durations, seconds."""
    slowdown: float
    waste: float
    step_slowdown: np.ndarray
    by_optype: dict[str, float]
    waste_by_optype: dict[str, float]
    by_dp_rank: np.ndarray
    """(dp,) S_w of whole DP ranks."""
    by_stage: np.ndarray
    """(pp,) S_w of whole PP stages."""
    by_dp_rank_per_step: np.ndarray
    """(T, dp)"""
    by_stage_per_step: np.ndarray
    """(T, pp)"""
    worker_slowdown: np.ndarray
    """(pp, dp): min(S_dp, S_pp) per worker."""
    rank: np.ndarray
    """(pp, dp) global rank of each worker."""
    top_workers: list[WorkerScore]
    mw: float
    ms: float
    t_fix_top_workers: float
    t_fix_last_stage: float
    discrepancy: float
    """(T_actual - T_original) / T_actual over mean step times."""
    fwd_bwd_correlation: float | None
    diagnosis: Diagnosis
    timings: dict[str, float] = field(default_factory=dict)
    simulations: int = 0
    worker_slowdown_exact: np.ndarray | None = None
    """(pp, dp): Eq. 4 per worker without the approximation, when requested."""

    @property
    def t_original(self) -> float:
        return float(self.step_time_original.mean())

    @property
    def t_ideal(self) -> float:
        return float(self.step_time_ideal.mean())

    @property
    def t_actual(self) -> float:
        return float(self.step_time_actual.mean())


def _share(t_orig: float, t_fixed: float, t_ideal: float) -> float:
    gap = t_orig - t_ideal
    if gap <= 1e-12 * max(t_orig, 1e-30):
        return 0.0
    return (t_orig - t_fixed) / gap


def fwd_bwd_correlation(t: OpTensor) -> float | None:
    """Pearson correlation of forward and backward compute time per microbatch (section 5.3).

    Uses the second stage when pp > 2 (the first and last carry embedding and
    loss), otherwise the first. None when either side has no variance.
    """
    stage = 1 if t.meta.pp_size > 2 else 0
    f = t.slots_of(stage, ot.FORWARD_COMPUTE)
    b = t.slots_of(stage, ot.BACKWARD_COMPUTE)
    k = min(len(f), len(b))
    if k == 0:
        return None
    x = t.duration[f[:k]].ravel()
    y = t.duration[b[:k]].ravel()
    if x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def analyse(
    t: OpTensor,
    policy: WhatIfPolicy | None = None,
    timer: Callable[[], float] = time.perf_counter,
    exact_workers: bool = False,
) -> WhatIfResult:
    """Run the full what-if analysis of one trace (see module docstring).

    exact_workers: also compute S_w of every single worker (dp x pp more
    simulations, two lanes each); M_W still ranks by the paper's approximation.
    """
    policy = policy or WhatIfPolicy()
    timings: dict[str, float] = {}
    c0 = timer()
    model = build_model(t)
    original = simulation_durations(t, model)
    ideal = idealised_durations(t, original)
    timings["model_s"] = timer() - c0
    c1 = timer()
    runner = ScenarioRunner(t, model, original, ideal, policy.memory_mb)
    n, dp, pp = t.n_slots, t.meta.dp_size, t.meta.pp_size
    all_slots = np.ones(n, dtype=bool)
    all_workers = np.ones((pp, dp), dtype=bool)
    no_workers = np.zeros((pp, dp), dtype=bool)
    groups = np.array([ot.attribution_group(x) for x in t.slot_optype], dtype=object)
    group_names = sorted(set(groups.tolist()))
    scenarios = [Counterfactual(all_slots, all_workers), Counterfactual(all_slots, no_workers)]
    for s in range(pp):
        wm = no_workers.copy()
        wm[s] = True
        scenarios.append(Counterfactual(all_slots, wm))
    for g in group_names:
        scenarios.append(Counterfactual(groups == g, all_workers))
    times = runner.run(scenarios)
    step_orig, step_ideal = times[0], times[1]
    by_stage_steps = times[2 : 2 + pp]
    by_type_steps = times[2 + pp :]
    by_dp_steps = runner.run_dp_ranks(list(range(dp))) if dp > 1 else step_orig[None, :]
    t_orig, t_ideal = float(step_orig.mean()), float(step_ideal.mean())
    slowdown = t_orig / t_ideal
    by_dp = by_dp_steps.mean(axis=1) / t_ideal
    by_stage = by_stage_steps.mean(axis=1) / t_ideal
    worker = np.minimum(by_stage[:, None], by_dp[None, :])
    # M_W: fix the top workers (ties: lower global rank first), M_S: fix the last stage.
    k = max(1, math.ceil(t.meta.workers * policy.top_worker_percent / 100.0))
    order = np.lexsort((t.rank.ravel(), -worker.ravel()))[:k]
    top_mask = np.zeros(pp * dp, dtype=bool)
    top_mask[order] = True
    fix = [Counterfactual(all_slots, ~top_mask.reshape(pp, dp))]
    if pp > 1:
        last = all_workers.copy()
        last[pp - 1] = False
        fix.append(Counterfactual(all_slots, last))
    fixed = runner.run(fix).mean(axis=1)
    t_fix_w = float(fixed[0])
    t_fix_s = float(fixed[1]) if pp > 1 else t_orig
    exact = None
    if exact_workers:
        cells = [(s, d) for s in range(pp) for d in range(dp)]
        masks = [t.slot_stage == s for s, _ in cells]
        if dp > 1:
            steps_w = runner.run_dp_ranks([d for _, d in cells], masks)
        else:  # no identical other ranks to fold into one lane
            steps_w = runner.run([Counterfactual(m, all_workers) for m in masks])
        exact = (steps_w.mean(axis=1) / t_ideal).reshape(pp, dp)
    timings["simulate_s"] = timer() - c1
    actual = t.actual_step_times()
    discrepancy = float((actual.mean() - t_orig) / actual.mean())
    by_type = {g: float(v) for g, v in zip(group_names, by_type_steps.mean(axis=1) / t_ideal)}
    tops = []
    for i in order:
        s, d = divmod(int(i), dp)
        tops.append(WorkerScore(int(t.rank[s, d]), d, s, float(worker[s, d])))
    mw = _share(t_orig, t_fix_w, t_ideal)
    ms = _share(t_orig, t_fix_s, t_ideal) if pp > 1 else 0.0
    corr = fwd_bwd_correlation(t)
    diag = diagnose(slowdown, worker, mw, ms, corr, discrepancy, tops, policy)
    return WhatIfResult(
        name=t.meta.name or t.source,
        dp_size=dp,
        pp_size=pp,
        steps=t.steps,
        step_time_actual=actual,
        step_time_original=step_orig,
        step_time_ideal=step_ideal,
        slowdown=slowdown,
        waste=1.0 - 1.0 / slowdown,
        step_slowdown=step_orig / step_ideal,
        by_optype=dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        waste_by_optype={g: 1.0 - 1.0 / v for g, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
        by_dp_rank=by_dp,
        by_stage=by_stage,
        by_dp_rank_per_step=(by_dp_steps / step_ideal).T,
        by_stage_per_step=(by_stage_steps / step_ideal).T,
        worker_slowdown=worker,
        rank=t.rank,
        top_workers=tops,
        mw=mw,
        ms=ms,
        t_fix_top_workers=t_fix_w,
        t_fix_last_stage=t_fix_s,
        discrepancy=discrepancy,
        fwd_bwd_correlation=corr,
        diagnosis=diag,
        timings=timings,
        simulations=runner.simulations,
        worker_slowdown_exact=exact,
    )


def diagnose(
    slowdown: float,
    worker: np.ndarray,
    mw: float,
    ms: float,
    corr: float | None,
    discrepancy: float,
    tops: list[WorkerScore],
    policy: WhatIfPolicy,
) -> Diagnosis:
    """Name the heatmap pattern: one/few workers, the last stage, or everywhere.

    A worker is lit when its S_w - 1 reaches `affected_share` of S - 1. The
    order follows the paper: problematic workers (5.1) first, then the last
    stage (5.2) when only last-stage workers are lit, then widespread.
    """
    pp = worker.shape[0]
    excess = max(slowdown - 1.0, 0.0)
    lit = (worker - 1.0) >= policy.affected_share * excess if excess > 0 else np.zeros_like(worker, bool)
    n_lit = int(lit.sum())
    frac = n_lit / worker.size
    seq = corr is not None and corr >= policy.seq_imbalance_correlation
    fidelity = abs(discrepancy) <= policy.max_discrepancy
    if slowdown < policy.straggling_slowdown:
        pattern, detail = (
            "none",
            f"S={slowdown:.3f} is below {policy.straggling_slowdown}: not straggling",
        )
    elif mw >= policy.dominant_share:
        names = ", ".join(f"rank {w.rank} (dp {w.dp_rank}, pp {w.stage})" for w in tops)
        pattern, detail = (
            "worker",
            f"M_W={mw:.2f}: fixing {names} removes most of the slowdown",
        )
    elif pp > 1 and ms >= policy.dominant_share and n_lit > 0 and lit[: pp - 1].sum() == 0:
        pattern, detail = (
            "last-stage",
            f"M_S={ms:.2f}: the last pipeline stage is slower than the others",
        )
    elif frac >= policy.widespread_fraction:
        pattern = "widespread"
        detail = f"{n_lit}/{worker.size} workers slowed"
        if seq:
            detail += f"; forward/backward correlation {corr:.2f}: sequence-length imbalance likely"
    else:
        pattern, detail = (
            "mixed",
            f"{n_lit}/{worker.size} workers slowed, no single cause dominates",
        )
    return Diagnosis(pattern, detail, n_lit, frac, seq, fidelity)
