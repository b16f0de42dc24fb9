"""From the ranks' reports of one job to a JobAssessment.

Step time is the primary signal (Guard 4.2): the job's current step time
(median over ranks of each rank's recent median) against its healthy baseline
(median of the ranks' baselines, measured by the agents on the first stable
window). Localisation uses each rank's compute time (step minus time inside
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
from slurmguard.reports import RankReport
from slurmguard.respond.tiers import Culprit, JobAssessment

RECENT = 5  # iterations in the "current" window of a rank
#: iterations whose median compute localises (wider than RECENT: compute is
#: a noisier difference of two times than the step itself)
LOCALISE_RECENT = 9
#: a rank's compute is judged only when its baseline compute is at least this
#: fraction of its baseline step: below it, what the hooks see of its compute
#: is too thin (a pipeline stage whose receives are untimed) to compare
OBSERVABLE_COMPUTE = 0.1


def _recent(r: RankReport, since: float | None, n: int = RECENT) -> list:
    steps = [s for s in r.steps if since is None or s.end > since]
    return steps[-n:]


def _onset(ranks: list[RankReport], baseline: float, threshold: float, since: float | None) -> float | None:
    """End time of the last healthy iteration before the current slow run."""
    longest = max(ranks, key=lambda r: len(r.steps))
    steps = [s for s in longest.steps if since is None or s.end > since]
    if not steps:
        return None
    x = np.array([s.step_s for s in steps])
    ends = np.array([s.end for s in steps])
    # median of 3 so one GC pause or checkpoint neither starts nor ends a run
    if x.size >= 3:
        x = np.median(np.lib.stride_tricks.sliding_window_view(np.pad(x, 1, mode="edge"), 3), axis=1)
    slow = x > baseline * (1.0 + threshold)
    if not slow[-1]:
        return None
    healthy = np.nonzero(~slow)[0]
    if healthy.size == 0:
        # slow for the whole window: the run began before it; its first step's start
        return float(ends[0] - steps[0].step_s)
    return float(ends[healthy[-1]])


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
    """
    ratios: dict[tuple[str, int], float] = {}
    computes: dict[tuple[str, int], float] = {}
    roles: dict[tuple[str, int], str] = {}
    hidden = []
    for (node, rank), st in recents.items():
        rep = next(r for n, r in ranks if n == node and r.rank == rank)
        if not st or not rep.baseline_compute_s:
            continue
        if rep.baseline_step_s and rep.baseline_compute_s < OBSERVABLE_COMPUTE * rep.baseline_step_s:
            hidden.append(rank)
            continue
        c = float(np.median([s.step_s - s.comm_s for s in st]))
        computes[(node, rank)] = c
        ratios[(node, rank)] = c / rep.baseline_compute_s
        roles[(node, rank)] = rep.role or f"rank{rank}"
    excess = policy.detection.cross_group.median_excess
    slow: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    unseen = (f"; rank(s) {', '.join(map(str, sorted(hidden)))} not judged: their compute is "
              f"under {OBSERVABLE_COMPUTE:.0%} of their step as the hooks see it" if hidden else "")
    if not ratios:
        return ratios, computes, slow, ("no rank has a compute baseline yet (warm-up)" if not hidden
                                        else unseen[2:])
    for key, ratio in ratios.items():
        if ratio <= 1.0 + excess:
            continue
        peers = [k for k in ratios if k != key and roles[k] == roles[key]]
        others = peers or [k for k in ratios if k != key]
        base = computes[key] / ratio
        if others:
            if ratio <= float(np.median([ratios[k] for k in others])) * (1.0 + excess):
                continue
            grown = float(np.median([ratios[k] for k in others]))
            against = (f"same-role peers {float(np.median([computes[k] for k in peers])):.3g}s"
                       if peers else f"its baseline {base:.3g}s (no same-role peer; the other "
                                     f"ranks grew {grown:.2f}x)")
        elif ratio > 1.0 + 2 * excess:
            # nothing to compare with: its own baseline, with a wider margin
            against = f"its baseline {base:.3g}s (no other rank's compute is observable)"
        else:
            continue
        slow[key[0]].append((key[1], computes[key], against))
    if not slow:
        grown = max(ratios.values())
        why = (f"no rank's compute grew more than {excess:.0%} beyond its own baseline and its "
               f"peers' (largest growth {grown:.2f}x): the slowdown is in the collectives or "
               f"job-wide, not one node's compute{unseen}")
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
    recents = {(n, r.rank): _recent(r, since) for n, r in ranks}
    currents = [float(np.median([s.step_s for s in st])) for st in recents.values() if st]
    # stall (Mycroft Alg. 1): no rank completed a collective for stall_s while
    # the job runs. Hooks that record only completed ops give no in-flight
    # marker, so progress alone decides; where a hook reports ops in flight,
    # a rank with none in flight is idle, not stalled.
    progress = [r.last_progress for _, r in ranks if r.last_progress is not None]
    marked = [r for _, r in ranks if r.in_flight_since is not None]
    idle = bool(marked) and len(marked) < len(ranks)
    quiet = (now - max(progress)) if progress else 0.0
    stalled = quiet if (quiet >= tiers.stall_s and not idle) else 0.0
    if not baselines or (not currents and stalled <= 0):
        return None
    baseline = float(np.median(baselines))
    current = float(np.median(currents)) if currents else None
    onset = _onset([r for _, r in ranks], baseline, tiers.moderate_slowdown / 2, since)
    if stalled > 0 and onset is None:
        onset = max(progress)

    ratios, computes, slow_ranks, why_not = localise(
        ranks, {(n, r.rank): _recent(r, since, LOCALISE_RECENT) for n, r in ranks}, policy)
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
