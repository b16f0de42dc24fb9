"""From the ranks' reports of one job to a JobAssessment.

Step time is the primary signal (Guard 4.2): the job's current step time
against its healthy baseline (median of the ranks' baselines, learned by the
agents' step detectors), both judged by the step detector itself
(`_judge_steps`), so step patterns, checkpoints and hiccups are read the
same way here as on the node, in the CLI and in the benchmark. Localisation uses each rank's compute time (step minus time inside
collectives): in synchronous training every rank's step stretches when one
rank computes slowly, but only the slow rank's compute stretches, while its
peers wait inside the collective instead (Greyhound's cross-group comparison
applied to the compute phase; Mycroft's late-start rule seen from the rank).
Telemetry flags of the same nodes are attached as supporting evidence.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone

import numpy as np

from slurmguard.config import Policy
from slurmguard.detect.peers import PeerFlag
from slurmguard.detect.steps import DetectorConfig, StepDetector
from slurmguard.reports import RankReport
from slurmguard.respond.tiers import Culprit, JobAssessment

MAX_JUDGED = 8  # ranks whose step series the detector judges per job and cycle
#: iterations whose median compute localises (a wide window: compute is a
#: noisier difference of two times than the step itself)
LOCALISE_RECENT = 9
#: a rank's compute is judged only when its baseline compute is at least this
#: fraction of its baseline step: below it, what the hooks see of its compute
#: is too thin (a pipeline stage whose receives are untimed) to compare
OBSERVABLE_COMPUTE = 0.1
#: share of the job's step-time growth a rank's extra compute must explain to
#: name its node: in synchronous training the others wait for the slow rank,
#: so a straggler's extra compute per iteration is the job's extra step time.
#: The ByteDance study (paper 004, 5.1, Eq. 5) calls workers responsible for a
#: job's slowdown when fixing them alone removes more than half of it.
ATTRIBUTION = 0.5
#: robust s.d. = this x the median absolute deviation; s.e. of a median of m
#: samples ~ MEDIAN_SE x s.d. / sqrt(m)
MAD_SD = 1.4826
MEDIAN_SE = 1.2533


def _recent(r: RankReport, since: float | None, n: int) -> list:
    steps = [s for s in r.steps if since is None or s.end > since]
    return steps[-n:]


def _judge_steps(ranks: list[RankReport], policy: Policy,
                 since: float | None) -> tuple[float | None, float | None, int]:
    """(current step time s, onset Unix s or None, ranks judged) from the step
    detector (slurmguard.detect.steps: the code and thresholds of the agent,
    the CLI and the bench) run over the ranks' report windows, each against the
    baseline its agent learned.

    The current step time is the median over ranks of each rank's verified
    level (seconds per step over one period of its step pattern), so a long
    optimizer step, a checkpoint or a three-step hiccup is not a slowdown and a
    hiccup that returned is over. The onset is the start of the first slow
    iteration of the ranks' open slowdowns (their median), when at least half
    of the judged ranks have one. At most MAX_JUDGED ranks (the longest
    windows) are judged: synchronous ranks share their step time.
    """
    cfg = DetectorConfig.from_policy(policy)
    rows = []
    for r in ranks:
        if not r.baseline_step_s:
            continue
        steps = [s for s in r.steps if since is None or s.end > since]
        if since is None and len(r.steps) == r.total_steps:
            steps = steps[cfg.warmup:]  # the window starts at the job's start: skip its warm-up
        if len(steps) >= 3:
            rows.append((r, steps))
    if not rows:
        return None, None, 0
    rows.sort(key=lambda rs: -len(rs[1]))
    rows = rows[:MAX_JUDGED]
    T = len(rows[0][1])
    x = np.full((len(rows), T), np.nan)
    for i, (_, steps) in enumerate(rows):  # right-aligned: the same column is about the same time
        x[i, T - len(steps):] = [s.step_s for s in steps]
    det = StepDetector(len(rows), cfg, baseline_s=np.array([r.baseline_step_s for r, _ in rows]),
                       warmup=0, learn=min(cfg.learn, len(rows[-1][1])))
    det.run(x)
    levels, onsets = [], []
    for i, (_, steps) in enumerate(rows):
        lv = det.level_s(i)
        if lv is not None:
            levels.append(lv)
        ep = det.open_episode(i)
        if ep is not None:
            first = steps[min(ep.onset, len(steps) - 1)]
            onsets.append(first.end - first.step_s)
    current = float(np.median(levels)) if levels else None
    onset = float(np.median(onsets)) if onsets and 2 * len(onsets) >= len(rows) else None
    return current, onset, len(rows)


def _median_se(xs: list[float]) -> float:
    """Standard error (s) of the median of xs, from their robust spread."""
    a = np.asarray(xs, dtype=np.float64)
    if a.size < 2:
        return float("inf")
    sd = MAD_SD * float(np.median(np.abs(a - np.median(a))))
    return MEDIAN_SE * sd / float(np.sqrt(a.size))


def localise(ranks: list[tuple[str, RankReport]], recents: dict[tuple[str, int], list],
             policy: Policy) -> tuple[dict, dict, dict[str, list], str | None]:
    """Which ranks compute slowly: (compute ratio per (node, rank), recent
    compute per (node, rank), node -> [(rank, compute s, what it was compared
    with)], why no node is named (None when one is, or nothing is slow)).

    A rank's compute (step minus time inside collectives) is compared with
    its own baseline, and its growth with that of the ranks of the same
    role (RankReport.role: the same pipeline stage, the same kind of shard),
    never across roles: a pipeline's last stage computes the loss and is
    slower by design. In synchronous training a slow rank's compute grows
    while its peers wait inside collectives, so only the slow rank's ratio
    rises. A rank alone in its role (a pipeline stage without data
    parallel replicas) is compared with the other ranks' growth, each
    against its own baseline. Ranks still in warm-up (no baseline) are not
    judged. Slow ranks on most of the job's nodes are not one node's fault:
    no node is named then.

    A rank is named only when its extra compute (over its same-role peers',
    or over its baseline scaled by the other ranks' growth) is beyond the
    noise of the window (policy detection.bocd.significance standard errors
    of the two medians) and explains at least ATTRIBUTION of the job's
    step-time growth over the same iterations (median over ranks of the
    recent median step minus the baseline step). Ranks that share a machine
    with other work all slow down together and differ by chance, in either
    direction: such a job-wide slowdown is not one node's, however large.
    The extra compute counts at the rank's observed compute share (its
    baseline compute over its baseline step): where the hooks see only part
    of a rank's work as compute, its step grows by more than that part.
    A rank with no other rank's compute to compare with is never named
    while the job has other ranks (they are in warm-up or hidden): alone,
    its own growth cannot tell a slow node from a slower job.
    """
    ratios: dict[tuple[str, int], float] = {}
    computes: dict[tuple[str, int], float] = {}
    rep_of: dict[tuple[str, int], RankReport] = {}
    spread: dict[tuple[str, int], float] = {}
    roles: dict[tuple[str, int], str] = {}
    growth: list[float] = []
    hidden = []
    for (node, rank), st in recents.items():
        rep = next(r for n, r in ranks if n == node and r.rank == rank)
        if st and rep.baseline_step_s:
            growth.append(float(np.median([s.step_s for s in st])) - rep.baseline_step_s)
        if not st or not rep.baseline_compute_s:
            continue
        if rep.baseline_step_s and rep.baseline_compute_s < OBSERVABLE_COMPUTE * rep.baseline_step_s:
            hidden.append(rank)
            continue
        cs = [s.step_s - s.comm_s for s in st]
        c = float(np.median(cs))
        computes[(node, rank)] = c
        rep_of[(node, rank)] = rep
        spread[(node, rank)] = _median_se(cs)
        ratios[(node, rank)] = c / rep.baseline_compute_s
        roles[(node, rank)] = rep.role or f"rank{rank}"
    excess = policy.detection.cross_group.median_excess
    k_se = policy.detection.bocd.significance
    grown_s = float(np.median(growth)) if growth else 0.0
    slow: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    unseen = (f"; rank(s) {', '.join(map(str, sorted(hidden)))} not judged: their compute is "
              f"under {OBSERVABLE_COMPUTE:.0%} of their step as the hooks see it" if hidden else "")
    if not ratios:
        return ratios, computes, slow, ("no rank has a compute baseline yet (warm-up)" if not hidden
                                        else unseen[2:])
    unexplained: list[str] = []
    for key, ratio in ratios.items():
        if ratio <= 1.0 + excess:
            continue
        peers = [k for k in ratios if k != key and roles[k] == roles[key]]
        others = peers or [k for k in ratios if k != key]
        base = computes[key] / ratio
        if others:
            if ratio <= float(np.median([ratios[k] for k in others])) * (1.0 + excess):
                continue
            if peers and computes[key] <= float(np.median([computes[k] for k in peers])) * (1.0 + excess):
                # ranks of one role do the same work: one that computes no longer
                # than its peers is not their straggler, whatever its own baseline
                # (a baseline learned during a slow spell makes any rank "grow")
                continue
            grown = float(np.median([ratios[k] for k in others]))
            if peers:
                expected = float(np.median([computes[k] for k in peers]))
                noise = float(np.hypot(spread[key], np.median([spread[k] for k in peers])))
                against = f"same-role peers {expected:.3g}s"
            else:
                expected = base * grown
                noise = float(np.hypot(spread[key], base * np.median(
                    [spread[k] / computes[k] * ratios[k] for k in others])))
                against = (f"its baseline {base:.3g}s (no same-role peer; the other "
                           f"ranks grew {grown:.2f}x)")
        elif len(ranks) == 1:
            if ratio <= 1.0 + 2 * excess:
                continue
            # a one-rank job: nothing to compare with but its own baseline,
            # with a wider margin
            expected, noise = base, spread[key]
            against = f"its baseline {base:.3g}s (the job's only rank)"
        else:
            unexplained.append(f"rank {key[1]} computes {ratio:.2f}x its baseline, but no other "
                               f"rank's compute is observable yet to tell a slow node from a "
                               f"slower job")
            continue
        extra = computes[key] - expected
        if extra <= k_se * noise:
            unexplained.append(f"rank {key[1]} computes {extra * 1e3:.3g} ms more than expected, "
                               f"within the noise ({k_se:g} s.e. = {k_se * noise * 1e3:.3g} ms)")
            continue
        # what the hooks see of a rank's compute is a share of its work (DDP
        # runs the backward pass under its in-flight all-reduces): the rank's
        # own step would grow by its extra compute over that share
        seen = min(1.0, base / rep_of[key].baseline_step_s) if rep_of[key].baseline_step_s else 1.0
        explained = extra / seen
        if explained < ATTRIBUTION * grown_s:
            unexplained.append(f"rank {key[1]}'s extra compute {extra * 1e3:.3g} ms ({explained * 1e3:.3g} "
                               f"ms of step at its observed compute share {seen:.0%}) explains "
                               f"{explained / grown_s:.0%} of the job's step growth "
                               f"{grown_s * 1e3:.3g} ms (needs {ATTRIBUTION:.0%}): job-wide")
            continue
        slow[key[0]].append((key[1], computes[key], against))
    if not slow:
        grown = max(ratios.values())
        why = (f"no rank's compute grew more than {excess:.0%} beyond its own baseline and its "
               f"peers' (largest growth {grown:.2f}x): the slowdown is in the collectives or "
               f"job-wide, not one node's compute{unseen}")
        if unexplained:
            why = "no node named: " + "; ".join(unexplained[:3]) + unseen
        return ratios, computes, slow, why
    nodes = {n for n, _ in ratios}
    if len(nodes) > 2 and len(slow) > len(nodes) / 2:
        why = (f"compute grew on {len(slow)} of {len(nodes)} nodes ({', '.join(sorted(slow))}): "
               f"a job-wide slowdown, not one node's")
        return ratios, computes, {}, why
    return ratios, computes, slow, None


def _fmt_flag(f: PeerFlag) -> str:
    dev = f.device if f.device in ("node",) else f.device
    if f.deviations:
        d = f.deviations[0]
        return f"{dev} {d.signal} {d.value:.4g} vs peers {d.median:.4g}"
    return f"{dev} {f.reasons[0] if f.reasons else 'hard failure'}"


def assess_job(job_id: int, job_nodes: tuple[str, ...], ranks: list[tuple[str, RankReport]],
               flags_by_node: dict[str, list[PeerFlag]], policy: Policy, now: float,
               since: float | None = None) -> JobAssessment | None:
    """None while no rank has a baseline yet (warm-up), nothing was reported,
    or a rank's process has exited (a failing job is not a slow node).

    since: ignore iterations that ended before this Unix time (the job's
    previous run, before a requeue).
    """
    if not ranks:
        return None
    if any(r.exited for _, r in ranks):
        # a rank's process is gone: the job is failing or ending (Slurm ends
        # it), which is no node's slowness; judging its silence as a stall
        # would drain the node of whichever rank stopped last
        return None
    tiers = policy.response.tiers
    baselines = [r.baseline_step_s for _, r in ranks if r.baseline_step_s]
    # stall (Mycroft Alg. 1): no rank completed a collective for stall_s while
    # the job runs. Hooks that record only completed ops give no in-flight
    # marker, so progress alone decides; where a hook reports ops in flight,
    # a rank with none in flight is idle, not stalled.
    progress = [r.last_progress for _, r in ranks if r.last_progress is not None]
    marked = [r for _, r in ranks if r.in_flight_since is not None]
    idle = bool(marked) and len(marked) < len(ranks)
    quiet = (now - max(progress)) if progress else 0.0
    stalled = quiet if (quiet >= tiers.stall_s and not idle) else 0.0
    if not baselines:
        return None
    baseline = float(np.median(baselines))
    current, onset, _ = _judge_steps([r for _, r in ranks], policy, since)
    if current is None and stalled <= 0:
        return None
    if stalled > 0 and onset is None:
        onset = max(progress)

    ratios, computes, slow_ranks, why_not = localise(
        ranks, {(n, r.rank): _recent(r, since, LOCALISE_RECENT) for n, r in ranks}, policy)
    if slow_ranks:
        # sustained (Guard 4.2: deviation over consecutive windows): the same
        # node is named by the window of iterations before too; a machine's
        # scheduler can starve one rank for a few seconds, a fault stays
        _, _, before, _ = localise(
            ranks, {(n, r.rank): _recent(r, since, 2 * LOCALISE_RECENT)[:-LOCALISE_RECENT]
                    for n, r in ranks}, policy)
        held = {n: rows for n, rows in slow_ranks.items() if n in before}
        if not held:
            why_not = (f"{', '.join(sorted(slow_ranks))}: slow over the last {LOCALISE_RECENT} "
                       f"iterations but not the {LOCALISE_RECENT} before (not yet sustained)")
        slow_ranks = held
    culprits = []
    for node, rows in sorted(slow_ranks.items()):
        rows.sort()
        rank, c, against = rows[0]
        tel = tuple(_fmt_flag(f) for f in flags_by_node.get(node, ()))
        gpu = next((r.gpu for n, r in ranks if n == node and r.rank == rank), None)
        culprits.append(Culprit(node=node, ranks=tuple(r[0] for r in rows), gpu=gpu,
                                why=f"rank {rank} compute {c:.3g}s vs {against}", telemetry=tel))
    if not culprits and stalled > 0:
        # Mycroft: a stall names the rank with the least progress
        laggard = min(((n, r) for n, r in ranks if r.last_progress is not None),
                      key=lambda nr: nr[1].last_progress)
        culprits.append(Culprit(node=laggard[0], ranks=(laggard[1].rank,), gpu=laggard[1].gpu,
                                why=f"rank {laggard[1].rank} made the least progress "
                                    f"(last collective {now - laggard[1].last_progress:.0f}s ago)",
                                telemetry=tuple(_fmt_flag(f) for f in flags_by_node.get(laggard[0], ()))))
    return JobAssessment(
        job_id=job_id, nodes=job_nodes, gpus=len(ranks), baseline_s=baseline, current_s=current,
        onset=onset, stalled_for_s=stalled, culprits=tuple(culprits),
        evidence={"ranks": len(ranks), "baseline_s": round(baseline, 6),
                  "current_s": None if current is None else round(current, 6),
                  "rank_compute_ratio": {f"{n}/{r}": round(v, 4) for (n, r), v in ratios.items()},
                  "rank_compute_s": {f"{n}/{r}": round(v, 6) for (n, r), v in computes.items()},
                  **({"localisation": why_not} if why_not and not culprits else {})})


def reason_text(a: JobAssessment, culprit: Culprit, tz: timezone | None = None) -> str:
    """Short and specific: 'step +23% since 14:02, gpu3 sm_clock 1380 vs peers 1980'."""
    since = ""
    if a.onset is not None:
        since = " since " + datetime.fromtimestamp(a.onset, tz).strftime("%H:%M")
    head = (f"stall {a.stalled_for_s:.0f}s" if a.stalled_for_s > 0 and a.slowdown <= 0
            else f"step {a.slowdown * 100:+.0f}%{since}")
    detail = culprit.telemetry[0] if culprit.telemetry else culprit.why
    return f"{head}, job {a.job_id}, {detail}"
