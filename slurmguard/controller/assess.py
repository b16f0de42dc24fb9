"""From the ranks' reports of one job to a JobAssessment.

Step time is the primary signal (Guard 4.2): the job's current step time
against its healthy baseline (median of the ranks' baselines, learned by the
agents' step detectors), both judged by the step detector itself
(`_judge_steps`), so step patterns, checkpoints and hiccups are read the
same way here as on the node, in the CLI and in the benchmark. Localisation
uses each rank's compute time (step minus the time it may have waited inside
collectives, detect.waiting): in synchronous training every rank's step
stretches when one rank computes slowly, but only the slow rank's compute stretches, while its
peers wait inside the collective instead (Greyhound's cross-group comparison
applied to the compute phase; Mycroft's late-start rule seen from the rank).
Telemetry flags of the same nodes are attached as supporting evidence.

What these detectors conclude leaves as typed findings (detect.findings:
step_time, stall, slow_rank, unlocalised, telemetry); controller.decide is the
one place that turns them into the assessment the response acts on.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import warnings
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import numpy as np
from scipy.special import ndtr, stdtrit

from slurmguard.config import Policy
from slurmguard.controller import decide
from slurmguard.controller.links import link_verdict
from slurmguard.detect.bocd import row_medians
from slurmguard.detect.findings import Finding, Kind, Measure, Severity, Subject
from slurmguard.detect.peers import PeerFlag
from slurmguard.detect.steps import DetectorConfig, StepDetector
from slurmguard.respond.tiers import Culprit, JobAssessment, calls_for_a_tier
from slurmguard.wire import RankReport, StepWindow

MAX_JUDGED = 8  # ranks whose step series the detector judges per job and cycle
#: iterations whose (trimmed mean) compute localises, at least (a wide window:
#: compute is a noisier difference of two times than the step itself)
LOCALISE_RECENT = 9
#: ... and at least the iterations of this many seconds (s), up to LOCALISE_MAX of
#: them: a CPU throttle or a scheduler acts in periods of about 100 ms, so a
#: throttled rank's compute is short in some iterations and one period longer in
#: others; a job of fast steps needs a few seconds of them to tell its slow
#: rank's compute from its peers' (9 iterations of 0.2 s left it within the noise)
LOCALISE_S = 4.0
#: (96: at 48, a pipeline stage's window of 30 ms steps held 1.4 s, and a 1.25x CPU
#: cap of its node stayed within the noise for 42-71 s in 2 of 4 runs; at 96,
#: drained 6.6-12.8 s after injection in 4 of 4)
LOCALISE_MAX = 96
#: ... but a job of slow steps is judged over time, not a count of iterations:
#: when its LOCALISE_RECENT iterations span more than this (s, between their
#: ends), the window is those that ended within it of the newest, LOCALISE_FEW
#: at least. A pipeline whose capped stage stretched its step from 0.1 s to 3.5 s
#: needed 9 + 9 iterations (the window and the one before), over 60 s, to be named;
#: such windows pay for their few iterations with Student's t (_multiplier)
LOCALISE_SPAN_S = 8.0
LOCALISE_FEW = 3
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
#: share of a rank's window cut from each end before averaging its compute
#: (a trimmed mean), one iteration at least: one checkpoint or a scheduler
#: hiccup does not move it, and unlike the median it follows a CPU cap that
#: throttles some iterations once, some twice and leaves others alone (the
#: window's compute is then clusters, and its median jumps between them). No
#: more: where the throttle lands in nearly half the iterations, a wider trim
#: cuts the very iterations that carry the fault
TRIM = 0.1
#: a rank without same-role peers (a pipeline stage) is named from the few
#: iterations since a change (_since_change) only when its compute grew by
#: more than this fraction beyond its own baseline and beyond the other ranks'
#: growth; a smaller excess waits for localise's two windows. A load burst
#: moved a healthy stage's compute to 1.18x (benchmark); a stage whose node is
#: capped for a 2.5x slower step computed 1.8-3.3x its baseline against the
#: other stage's 1.1-1.4x and waited 4-8 s for the second window
ALONE_SINCE_CHANGE = 0.5
#: a rank without same-role peers named on localise's two windows (its mean
#: compute against its own baseline scaled by the other ranks' mean growth, a
#: smaller excess than ALONE_SINCE_CHANGE) is acted on only once its node has
#: been named for this long (s), cycle after cycle (a gap of up to
#: LOCALISE_S between two namings does not restart it; controller.loop).
#: The controller holds a rank's newest 256 iterations: at a fast pipeline's
#: 13 ms steps the two windows span 2.5 s, and a spell of uneven load on a
#: shared host moves one stage's compute against the other's by 10-20% for
#: as long (a hand-written GPipe job's first stage, named in one cycle 7 s
#: into a healthy run: its node drained and the job requeued). Peers of one
#: role are compared in the same iterations, so no such wait for them
ALONE_NAMED_S = 2 * LOCALISE_S
#: share of the job's step growth (ATTRIBUTION for the others) the extra
#: compute of a rank without same-role peers must explain. Such a rank is
#: judged by its plain means and their standard errors, every iteration
#: counted: a CPU quota freezes a stage wherever its quota runs out, in a
#: heavy tail of its iterations the trimmed means cut, and inside its own
#: sends and receives too, which count as time in collectives. A hand-written
#: GPipe job's first stage capped for a 3.2x step computed 2.4x its baseline
#: by its mean (its median 1.2x) against the other stage's 1.4x, and its
#: extra compute explained 44% of the step growth. A 2-stage pipeline capped
#: for a 1.4-1.5x step (session 19): the capped stage's compute 1.20x its
#: baseline by its median, 1.45x by its mean, the other stage's 1.16-1.18x
#: (it starts cold after each wait), its extra compute 33-49% of the step
#: growth; named within 5-15 s by the means, flickering out of the trimmed
#: ones cycle to cycle (not named in 240 s in 2 of 3 runs)
ATTRIBUTION_ALONE = 1.0 / 3.0
#: a rank with same-role peers named from the few iterations since a change
#: (_since_change) is acted on at once only when its compute is more than this
#: fraction beyond its peers'; a smaller excess is acted on once named for
#: ALONE_NAMED_S, as a stage's is. A DDP job's ranks on a busy host take turns
#: computing 10-20% longer for 2-4 s at a time: a healthy rank computing 1.19x
#: its peer's over the 3 s since a step change was named and its node drained
#: (a DDP job written apart from the project, session 20); CPU-capped ranks
#: computed 2.9-3.2x their peers' there
PROMPT_EXCESS = 0.3


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Row statistics over windows that may hold fewer than two iterations (a
    NaN or inf row, handled by the callers) without numpy's warnings, which
    numpy.errstate alone does not silence (nanvar's degrees of freedom)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def steps_since(steps: Any, since: float | None) -> Any:
    """The iterations of a rank's window that ended after `since` (all for None)."""
    if hasattr(steps, "since"):  # the controller's compact window (controller.fleet.StepWindow)
        return steps.since(since)
    return steps if since is None else [s for s in steps if s.end > since]


def _localise_window(r: RankReport, since: float | None, skip: int = 0) -> Any:
    """The rank's iterations that localise now (skip=0), or the same span just
    before the newest `skip` (the sustained check), ended after `since`: its
    last LOCALISE_RECENT iterations or, when more ended within LOCALISE_S of
    the newest, those (LOCALISE_MAX at most)."""
    steps = steps_since(r.steps[-(skip + LOCALISE_MAX) :], since)
    return window_tail(steps[: max(0, len(steps) - skip)])


def window_tail(steps: Any, most: int = LOCALISE_MAX) -> Any:
    """The iterations of `steps` (oldest first) that localise, see _localise_window
    (and LOCALISE_SPAN_S for slow steps), `most` of them at most."""
    n = len(steps)
    if n <= LOCALISE_FEW:
        return steps
    ends = _ends(steps)

    def within(s: float) -> int:
        return n - int(np.searchsorted(ends, ends[-1] - s, side="right"))

    k = max(within(LOCALISE_S), min(LOCALISE_RECENT, n))
    if ends[-1] - ends[n - k] > LOCALISE_SPAN_S:
        k = max(within(LOCALISE_SPAN_S), LOCALISE_FEW)
    return steps[n - min(k, most) :]


def _ends(steps: Any) -> np.ndarray:
    """End times (Unix s) of a window's iterations (a StepWindow's column or a list's)."""
    return steps.end if hasattr(steps, "end") else np.array([s.end for s in steps])


def _keep(steps: Any, mask: np.ndarray) -> Any:
    """The iterations of a window where mask is true, as the same kind of window."""
    if hasattr(steps, "columns"):
        return StepWindow(steps.columns[:, mask])
    return [s for s, m in zip(steps, mask.tolist()) if m]


def _phase_start(ranks: list[tuple[str, RankReport]], since: float | None) -> float | None:
    """Where the iterations comparable with the ranks' baselines begin (Unix
    s): after `since` (a restart) and after the job's newest faster change
    (the median of the ranks' newest, when half have one), since when their
    agents' baselines follow the faster level (agent.analysis._feed_bocd). A
    job's start-up is slower than its steady state: a pipeline stage that
    computed 55 ms a step there against its later baseline of 36 ms made a
    localisation window reaching into the start-up "slow", and with a burst
    in the newest window its node was drained 6 s into a healthy job."""
    faster = [
        max(c.at for c in r.changes if c.direction == "faster")
        for _, r in ranks
        if any(c.direction == "faster" for c in r.changes)
    ]
    if not faster or 2 * len(faster) < len(ranks):
        return since
    t = float(np.median(faster))
    return t if since is None else max(since, t)


def _latest_change(ranks: list[tuple[str, RankReport]], onset: float) -> float:
    """The start of the job's newest step change (Unix s): the median of the
    ranks' newest verified slower change (RankReport.changes, as their agents
    located it) where at least half the ranks have one after `onset`, else
    `onset` (the first slow iteration of the job's open slowdown). A job
    already slower than its baseline (learned in a faster phase) whose node
    then fails is in one slowdown since the first: its iterations since the
    newest change are the fault's, those before would dilute them."""
    newest = [
        max(c.at for c in r.changes if c.direction == "slower" and c.at > onset)
        for _, r in ranks
        if any(c.direction == "slower" and c.at > onset for c in r.changes)
    ]
    return float(np.median(newest)) if newest and 2 * len(newest) >= len(ranks) else onset


def _since_change(
    ranks: list[tuple[str, RankReport]], recent: dict[tuple[str, int], Any], onset: float, policy: Policy
) -> dict[str, list]:
    """Nodes named on the evidence since the job's newest step change (onset,
    Unix s: the step detector's change point, or a newer one the agents
    report, _latest_change). A fault that makes a rank compute
    far longer than its peers, against the scatter of a few iterations, need
    not wait for two disjoint windows of LOCALISE_S: the windows are each
    rank's recent iterations that ended after the onset (none from before
    the change, which would dilute it), from localise's window without its
    LOCALISE_MAX, so a job of fast steps has all the iterations of LOCALISE_S
    (a DDP rank under a 1.25x CPU cap computed 5 ms more than its peer per
    45 ms step, within the noise of 48 iterations in some runs), judged
    with Student's t at every length (_multiplier), so a small excess stays
    within the t of a few iterations and waits for localise's long windows. The evidence must not hang on one
    report interval (agent.report_interval_s) of it: cut into such slices
    back from the newest iteration, the node must be named with each slice
    left out too, LOCALISE_FEW iterations left at least. That is the node
    named over 3 iterations since the change and confirmed by the next
    report's; a scheduler or load burst that puts one rank ahead within one
    interval is named by none of the windows that leave it out (and the
    job's slowdown must still pay the tier's price before any drain).
    A rank alone in its role (a pipeline stage) is compared with its own
    baseline scaled by the other ranks' growth, which a burst of load moves
    as much as a fault: on the benchmark a healthy pipeline's stage, its
    compute 1.18x its baseline while its job's step was +93% for a few
    seconds, was named this way and its node drained. Such a rank is named
    here only when its compute grew more than ALONE_SINCE_CHANGE beyond both
    (a severe fault); a smaller excess waits for localise's two windows."""
    onset = _latest_change(ranks, onset)
    now_w = {k: steps_since(w, onset) for k, w in recent.items()}
    if min((len(w) for w in now_w.values()), default=0) < LOCALISE_FEW:
        return {}
    _, _, named, _ = localise(ranks, now_w, policy, t_below=1 << 30, alone_excess=ALONE_SINCE_CHANGE)
    if not named:
        return {}
    gap = policy.agent.report_interval_s
    ends = {k: _ends(w) for k, w in now_w.items()}
    newest = max(float(e[-1]) for e in ends.values())
    # each iteration's slice: how many report intervals before the newest it ended
    part = {k: np.floor((newest - e) / gap).astype(int) for k, e in ends.items()}
    for j in np.unique(np.concatenate(list(part.values()))).tolist():
        left = {k: _keep(w, part[k] != j) for k, w in now_w.items()}
        if min(len(w) for w in left.values()) < LOCALISE_FEW:
            return {}
        _, _, held, _ = localise(ranks, left, policy, t_below=1 << 30, alone_excess=ALONE_SINCE_CHANGE)
        named = {n: rows for n, rows in named.items() if n in held}
        if not named:
            break
    return named


def _columns(windows: list) -> tuple[np.ndarray, np.ndarray]:
    """(step_s, comm_s) of the windows as (ranks, longest) arrays, right-aligned
    (the same column is about the same time) and NaN-padded; the controller's
    compact windows of one length are stacked without a Python loop."""
    arrays = [getattr(w, "columns", None) for w in windows]
    packed = [a for a in arrays if a is not None]
    if len(packed) == len(arrays) and len({a.shape for a in packed}) == 1:
        a = np.stack(packed)  # (ranks, 3, n): end, step_s, comm_s
        return a[:, 1, :], a[:, 2, :]
    width = max(len(w) for w in windows)
    step = np.full((len(windows), width), np.nan)
    comm = np.full((len(windows), width), np.nan)
    for i, w in enumerate(windows):
        if hasattr(w, "step_s"):
            step[i, width - len(w) :], comm[i, width - len(w) :] = w.step_s, w.comm_s
        else:
            step[i, width - len(w) :] = [s.step_s for s in w]
            comm[i, width - len(w) :] = [s.comm_s for s in w]
    return step, comm


def _grown_since(rep: RankReport) -> float:
    """Since when (Unix s) this rank's growth over its compute baseline is
    measured: the newest iteration of that baseline or, where its agent
    reports a slower step since (its newest change), that change's located
    onset. Another rank's baseline set before it was set on the level this
    rank slowed from; one set after it, under the slowdown. A baseline
    follows a rank's compute while its step stays at its baseline
    (agent.analysis COMPUTE_FOLLOW), so one stage's can be seconds newer than
    the other's before any fault. Measured from the baseline's newest
    iteration alone, a stage whose node was capped (2.3-2.9x its baseline,
    the job's step +160-200%) stayed "not comparable" for 120 s in a CI run,
    the other stage's baseline newer, and was never named."""
    at = rep.baseline_compute_at if rep.baseline_compute_at is not None else -math.inf
    if not rep.changes:
        return at
    newest = max(rep.changes, key=lambda c: c.at)
    return max(at, newest.at) if newest.direction == "slower" else at


def _median_without_self(v: np.ndarray) -> np.ndarray:
    """out[i] = median of v without v[i], for every i at once (O(n log n), not O(n^2))."""
    n = len(v)
    order = np.argsort(v, kind="stable")
    sv = v[order]
    pos = np.empty(n, dtype=np.intp)
    pos[order] = np.arange(n)
    m = n - 1
    k1, k2 = (m - 1) // 2, m // 2
    # index k of the list without element at sorted position p is k (k < p) or k + 1
    i1 = k1 + (k1 >= pos)
    i2 = k2 + (k2 >= pos)
    return (sv[i1] + sv[i2]) / 2.0


def _judge_steps(
    ranks: list[RankReport], policy: Policy, since: float | None
) -> tuple[float | None, float | None, int]:
    """(current step time s, onset Unix s or None, ranks judged) from the step
    detector (slurmguard.detect.steps: the code and thresholds of the agent,
    the CLI and the bench) run over the ranks' report windows, each against the
    baseline its agent learned (and the healthy mean step it learned, which an
    intermittent slowdown is measured against).

    The current step time is the median over ranks of each rank's verified
    level (seconds per step over one period of its step pattern; for an
    intermittent slowdown, the mean step), so a long
    optimizer step, a checkpoint or a three-step hiccup is not a slowdown and a
    hiccup that returned is over. The onset is the start of the first slow
    iteration of the ranks' open slowdowns (their median), when at least half
    of the judged ranks have one. At most MAX_JUDGED ranks (the longest
    windows) are judged: synchronous ranks share their step time.
    """
    cfg = DetectorConfig.from_policy(policy)

    def window(r: RankReport) -> Any:
        steps = steps_since(r.steps, since)
        if since is None and _from_start(r):
            steps = steps[cfg.warmup :]  # the window starts at the job's start: skip its warm-up
        return steps

    if since is None:
        # the window's length without building it (it is built for the chosen ranks only):
        # at thousands of ranks a job, slicing every window costs more than judging
        sized = [
            (r, len(r.steps) - (min(cfg.warmup, len(r.steps)) if _from_start(r) else 0))
            for r in ranks
            if r.baseline_step_s
        ]
        chosen = heapq.nsmallest(MAX_JUDGED, [x for x in sized if x[1] >= 3], key=lambda x: -x[1])
        rows = [(r, window(r)) for r, _ in chosen]
    else:
        rows = [(r, w) for r in ranks if r.baseline_step_s for w in (window(r),) if len(w) >= 3]
        rows.sort(key=lambda rs: -len(rs[1]))
        rows = rows[:MAX_JUDGED]
    if not rows:
        return None, None, 0
    x, _ = _columns([steps for _, steps in rows])
    quick = _within_baseline(x, [float(r.baseline_step_s or 0.0) for r, _ in rows], policy)
    if quick is not None:
        return quick, None, len(rows)
    det = StepDetector(
        len(rows),
        cfg,
        baseline_s=np.array([r.baseline_step_s for r, _ in rows]),
        baseline_mean_s=np.array([r.baseline_mean_s or np.nan for r, _ in rows]),
        warmup=0,
        learn=min(cfg.learn, len(rows[-1][1])),
    )
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


def _from_start(r: RankReport) -> bool:
    """Whether the rank's window still holds its first iteration: total_steps
    counts the iterations seen to start, the window their completed ones, so
    a window of the whole history is one shorter (the newest iteration is
    still running)."""
    return len(r.steps) >= r.total_steps - 1


def _within_baseline(x: np.ndarray, baselines: list[float], policy: Policy) -> float | None:
    """A job whose every judged iteration (x: the ranks' step times, s, one row
    a rank, NaN-padded) is within response.tiers.moderate_slowdown of the job's
    baseline cannot be judged slow by the detector (its level is an average of
    such iterations): the median of the ranks' window medians then stands for
    the current step, and the detector is not run (at 1,000 jobs a cycle,
    running it over every healthy window costs tens of seconds). None: the
    detector must judge."""
    limit = (1.0 + policy.response.tiers.moderate_slowdown) * float(np.median(baselines))
    if np.nanmax(x) >= limit:
        return None
    return float(np.median(row_medians(x)))


def window_stats(
    windows: list, k_se: float, t_below: int = LOCALISE_RECENT
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per window (a rank's recent iterations): trimmed mean step (s), trimmed
    mean compute (step - comm, s), the standard error of the latter (s:
    winsorized s.d. / ((1 - 2 g/m) sqrt(m)), Tukey and McLaughlin; inf under
    3 iterations) and how many standard errors are significant for it
    (_multiplier of k_se, Student's t under t_below iterations), as arrays in
    one pass over all ranks (O(ranks x window))."""
    step, comm = _columns(windows)
    return (_trimmed_mean(step), *_compute_stats(step - comm, k_se, t_below))


def _compute_stats(comp: np.ndarray, k_se: float, t_below: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """window_stats' compute part from the windows' compute columns (ranks x
    iterations, NaN-padded): trimmed mean, its standard error, the multiplier."""
    mean_comp, se, m, kept = _trimmed(comp)
    return mean_comp, se, _multiplier(k_se, m, kept, t_below)


def _multiplier(k_se: float, m: np.ndarray, kept: np.ndarray, t_below: int = LOCALISE_RECENT) -> np.ndarray:
    """Standard errors a difference must clear, per window of m iterations of
    which `kept` remain after trimming: k_se (policy detection.bocd.significance)
    for windows of LOCALISE_RECENT iterations or more, as always; a shorter
    window (a job of slow steps, LOCALISE_SPAN_S) estimates its spread from a
    handful of iterations, so its difference must clear Student's t at the same
    one-sided level with kept - 1 degrees of freedom (Yuen's trimmed t: 2
    iterations left of 3 would need 4.5 s.e., not 2). t_below: the window
    length from which k_se is used (the windows since a change point pay
    Student's t at every length, see _since_change)."""
    df = np.maximum(kept - 1, 1).astype(float)
    return np.where(m >= t_below, k_se, np.maximum(stdtrit(df, ndtr(k_se)), k_se))


def _trimmed_mean(x: np.ndarray) -> np.ndarray:
    """Row-wise TRIM-trimmed mean of a NaN-padded array."""
    return _trim(x)[0]


def _trimmed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise TRIM-trimmed mean of a NaN-padded array, its standard error,
    the values per row and those the mean kept."""
    mean, m, g, srt = _trim(x)
    rows = np.arange(x.shape[0])
    lo = srt[rows, np.minimum(g, x.shape[1] - 1)]
    hi = srt[rows, np.clip(m - g - 1, 0, x.shape[1] - 1)]
    with _quiet():
        w = np.clip(x, lo[:, None], hi[:, None])
        var = np.nanvar(w, axis=1, ddof=1)
        se = np.sqrt(var) / ((1.0 - 2.0 * g / np.maximum(m, 1)) * np.sqrt(np.maximum(m, 1)))
    return mean, np.where(m >= 3, se, np.inf), m, m - 2 * g


def _trim(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(trimmed mean, values per row, cut from each end, the rows sorted, NaN last).
    Windows under 5 iterations are not trimmed: cutting one from each end of 3
    or 4 leaves too few to estimate their spread (Student's t pays for them)."""
    m = np.sum(~np.isnan(x), axis=1)
    g = np.where(m >= 5, np.maximum(np.floor(TRIM * m), 1), 0).astype(int)
    srt = np.sort(x, axis=1)  # NaN last
    col = np.arange(x.shape[1])[None, :]
    inner = (col >= g[:, None]) & (col < (m - g)[:, None])
    kept = np.maximum(m - 2 * g, 1)
    mean = np.where(m > 0, np.where(inner, srt, 0.0).sum(axis=1) / kept, np.nan)
    return mean, m, g, srt


def localise(
    ranks: list[tuple[str, RankReport]],
    recents: dict[tuple[str, int], list],
    policy: Policy,
    t_below: int = LOCALISE_RECENT,
    alone_excess: float | None = None,
) -> tuple[dict, dict, dict[str, list], str | None]:
    """Which ranks compute slowly: (compute ratio per (node, rank), recent
    compute per (node, rank), node -> [(rank, compute s, what it was compared
    with, judged without same-role peers, its compute over what was expected
    (a factor))], why no node is named (None when
    one is, or nothing is slow)).

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
    of the two trimmed means, see window_stats; Student's t for the short
    windows of slow steps, _multiplier) and explains at least ATTRIBUTION of the job's
    step-time growth over the same iterations (median over ranks of the
    recent mean step minus the baseline step; the attribution is a share of
    lost time, so both are plain means). Ranks that share a machine
    with other work all slow down together and differ by chance, in either
    direction: such a job-wide slowdown is not one node's, however large.
    The extra compute counts at the rank's observed compute share (its
    baseline compute over its baseline step): where the hooks see only part
    of a rank's work as compute, its step grows by more than that part.
    A rank with no other rank's compute to compare with is never named
    while the job has other ranks (they are in warm-up or hidden): alone,
    its own growth cannot tell a slow node from a slower job. t_below: see
    _multiplier. alone_excess: the growth (fraction) a rank without
    same-role peers must exceed, over its own baseline and the other ranks'
    growth (default: policy detection.cross_group.median_excess, as for all).
    A rank without same-role peers is judged on plain means and their
    standard errors instead, against its baseline scaled by the other ranks'
    plain growth, and must explain ATTRIBUTION_ALONE of the step growth (a
    CPU quota's frozen iterations are a heavy tail the trimmed means cut).
    """
    ratios: dict[tuple[str, int], float] = {}
    computes: dict[tuple[str, int], float] = {}
    by_key = {(n, r.rank): r for n, r in ranks}
    hidden = []
    keyed = [(key, st) for key, st in recents.items() if len(st)]
    growth: list[float] = []  # per rank: mean step minus baseline step (s)
    judged: list[tuple[tuple[str, int], RankReport, float, float]] = []
    k_se = policy.detection.bocd.significance
    needs: list[float] = []  # per judged rank: standard errors its difference must clear
    plain: list[float] = []  # per judged rank: mean compute (s), for the attribution
    plain_se: list[float] = []  # ... and its standard error (s)
    if keyed:
        # the noise test on trimmed means (window_stats' compute part); the
        # attribution on plain means of step and compute, every iteration counted
        step, comm = _columns([st for _, st in keyed])
        comp = step - comm
        med_comp, se, mult = _compute_stats(comp, k_se, t_below)
        with _quiet():
            mean_step, mean_comp = np.nanmean(step, axis=1), np.nanmean(comp, axis=1)
            counted = np.sum(~np.isnan(comp), axis=1)
            mean_se = np.where(counted >= 3, np.nanstd(comp, axis=1, ddof=1) / np.sqrt(counted), np.inf)
        for (key, _), ms, c, e, k, mc, me in zip(
            keyed,
            mean_step.tolist(),
            med_comp.tolist(),
            se.tolist(),
            mult.tolist(),
            mean_comp.tolist(),
            mean_se.tolist(),
        ):
            rep = by_key[key]
            if rep.baseline_step_s:
                growth.append(ms - rep.baseline_step_s)
            if not rep.baseline_compute_s:
                continue
            if rep.baseline_step_s and rep.baseline_compute_s < OBSERVABLE_COMPUTE * rep.baseline_step_s:
                hidden.append(key[1])
                continue
            computes[key] = c
            ratios[key] = c / rep.baseline_compute_s
            judged.append((key, rep, c, e))
            needs.append(k)
            plain.append(mc)
            plain_se.append(me)
    excess = policy.detection.cross_group.median_excess
    alone = excess if alone_excess is None else alone_excess
    grown_s = float(np.median(growth)) if growth else 0.0
    slow: dict[str, list[tuple[int, float, str, bool, float]]] = defaultdict(list)
    unseen = (
        f"; rank(s) {', '.join(map(str, sorted(hidden)))} not judged: their compute is "
        f"under {OBSERVABLE_COMPUTE:.0%} of their step as the hooks see it"
        if hidden
        else ""
    )
    if not ratios:
        return (
            ratios,
            computes,
            slow,
            ("no rank has a compute baseline yet (warm-up)" if not hidden else unseen[2:]),
        )
    # every rank's same-role peers' medians (compute, s.e., t, plain mean) and the other
    # ranks' medians, for all ranks at once: one sort per role, O(n log n)
    n = len(judged)
    cv = np.array([c for *_, c, _ in judged])
    sv = np.array([e for *_, e in judged])
    kv = np.array(needs)
    pv = np.array(plain)
    # plain means are compared with the baseline's plain mean (its median from an older agent)
    bv = np.array([rep.baseline_compute_mean_s or rep.baseline_compute_s for _, rep, _, _ in judged])
    with _quiet():
        prv = pv / bv
        pqv = np.array(plain_se) / bv
    by_role: dict[str, list[int]] = defaultdict(list)
    for i, (key, rep, _, _) in enumerate(judged):
        by_role[rep.role or f"rank{key[1]}"].append(i)
    peer = np.zeros(n, dtype=bool)
    peer_comp, peer_se, peer_k, peer_plain = (np.full(n, np.nan) for _ in range(4))
    for idx in by_role.values():
        if len(idx) > 1:
            ix = np.array(idx)
            peer[ix] = True
            peer_comp[ix] = _median_without_self(cv[ix])
            peer_se[ix] = _median_without_self(sv[ix])
            peer_k[ix] = _median_without_self(kv[ix])
            peer_plain[ix] = _median_without_self(pv[ix])
    if n > 1:
        all_k = _median_without_self(kv)
        all_plain, all_plain_q = _median_without_self(prv), _median_without_self(pqv)
        # ... and their extra compute in seconds, with its standard error
        all_added, all_added_se = _median_without_self(pv - bv), _median_without_self(np.array(plain_se))
        # ... and the newest compute baseline among the other ranks (Unix s; -inf unknown)
        at = np.array([rep.baseline_compute_at or -np.inf for _, rep, _, _ in judged])
        top = int(np.argmax(at))
        second = int(np.argmax(np.where(np.arange(n) == top, -np.inf, at)))
        # ... and whose it is (index into judged)
        newest_by = np.full(n, top)
        newest_by[top] = second
        newest_other = at[newest_by]
    unexplained: list[str] = []
    for i, (key, rep, c, e) in enumerate(judged):
        ratio = ratios[key]
        # a rank without same-role peers is judged by its plain means, every
        # iteration counted (ATTRIBUTION_ALONE): a CPU quota freezes such a stage
        # in a heavy tail of its iterations, which the trimmed means cut
        lone = not peer[i] and n > 1
        if lone:
            ratio = float(prv[i])
        if ratio <= 1.0 + excess:
            continue
        base = c / ratios[key]  # its baseline compute (s)
        if not peer[i] and ratio <= 1.0 + alone:
            continue
        if lone:
            # what a job-wide slowdown makes of this stage's compute: the other
            # ranks' growth as a factor (a slower clock scales all work) or as
            # seconds (a busy host takes about as long from every process per
            # iteration, which is a larger factor on a stage that computes
            # less), whichever expects more. A hand-written GPipe job's first
            # stage (8.5 ms of compute against the other's 16.5 ms) under a
            # busy host computed 1.55x its baseline against the other's 1.27x,
            # 4.6 ms more against 4.4 ms: named for 8 s by the factor, and its
            # healthy node drained. Never less than its own baseline: the others
            # computing less than theirs excuses nothing
            base = float(bv[i])
            grown, added = max(1.0, float(all_plain[i])), max(0.0, float(all_added[i]))
            expected = max(base * grown, base + added)
            if float(pv[i]) <= expected * (1.0 + alone):
                continue
            since = _grown_since(rep)
            if rep.baseline_compute_at is not None and newest_other[i] > since + LOCALISE_S:
                # another rank's baseline was learned (again) since this one's
                # slowdown began: its growth is measured from a later level, not
                # comparable. A GPipe job's stage 0 learned its baseline again (a
                # new iteration structure) while a busy host slowed the job: it
                # "grew" 1.00x, and stage 1, 1.2x its own older baseline, was
                # named and its node drained
                unexplained.append(
                    f"rank {key[1]} computes {float(pv[i]) / base:.2f}x its baseline, but another "
                    f"rank's baseline is newer: their growth is not comparable yet (rank "
                    f"{judged[int(newest_by[i])][0][1]}'s is {newest_other[i] - since:.1f}s newer than "
                    f"this rank's {'slowdown' if since > rep.baseline_compute_at else 'baseline'})"
                )
                continue
            by_factor = base * grown >= base + added
            noise = float(np.hypot(plain_se[i], base * all_plain_q[i] if by_factor else all_added_se[i]))
            need = max(float(kv[i]), float(all_k[i]))
            against = (
                f"its baseline {base:.3g}s (no same-role peer; the other ranks grew {grown:.2f}x, "
                f"{added * 1e3:+.3g} ms, by their means)"
            )
            c = float(pv[i])
        elif n > 1:
            # ranks of one role do the same work: their compute is compared
            # directly. A rank that computes no longer than its peers is not
            # their straggler, whatever its own baseline (a baseline learned
            # during a slow spell makes any rank "grow"), and one that computes
            # longer is, even when its own baseline was learned after the
            # fault began (its growth against that baseline understates it)
            if c <= float(peer_comp[i]) * (1.0 + excess):
                continue
            expected = float(peer_comp[i])
            noise = float(np.hypot(e, peer_se[i]))
            need = max(float(kv[i]), float(peer_k[i]))
            against = f"same-role peers {expected:.3g}s"
        elif len(ranks) == 1:
            if ratio <= 1.0 + 2 * excess:
                continue
            # a one-rank job: nothing to compare with but its own baseline,
            # with a wider margin
            expected, noise, need = base, e, float(kv[i])
            against = f"its baseline {base:.3g}s (the job's only rank)"
        else:
            unexplained.append(
                f"rank {key[1]} computes {ratio:.2f}x its baseline, but no other "
                f"rank's compute is observable yet to tell a slow node from a "
                f"slower job"
            )
            continue
        extra = c - expected
        if extra <= need * noise:
            unexplained.append(
                f"rank {key[1]} computes {extra * 1e3:.3g} ms more than expected, "
                f"within the noise ({need:.3g} s.e. = {need * noise * 1e3:.3g} ms)"
            )
            continue
        # what the hooks see of a rank's compute is a share of its work (DDP
        # runs the backward pass under its in-flight all-reduces): the rank's
        # own step would grow by its extra compute over that share. The share of
        # the job's lost time is judged on plain means, every iteration counted:
        # a CPU cap freezes a rank for part of some iterations and not others,
        # and the trimmed means cut the most frozen (a capped pipeline stage's
        # extra compute explained 31-50% of the step growth by them, 60-100% by
        # the means); the difference above has already cleared the noise
        if lone:
            mean_expected = expected
        elif n == 1:
            mean_expected = base  # the job's only rank: its own baseline
        else:
            mean_expected = float(peer_plain[i])
        extra = float(pv[i]) - mean_expected
        seen = min(1.0, base / rep.baseline_step_s) if rep.baseline_step_s else 1.0
        explained = extra / seen
        share = ATTRIBUTION_ALONE if lone else ATTRIBUTION
        if explained < share * grown_s:
            unexplained.append(
                f"rank {key[1]}'s extra compute {extra * 1e3:.3g} ms ({explained * 1e3:.3g} "
                f"ms of step at its observed compute share {seen:.0%}) explains "
                f"{explained / grown_s:.0%} of the job's step growth "
                f"{grown_s * 1e3:.3g} ms (needs {share:.0%}): job-wide"
            )
            continue
        # judged without same-role peers, in a role its agent found (an unknown
        # role, None, is no evidence of being alone in it)
        slow[key[0]].append((key[1], c, against, bool(not peer[i] and rep.role is not None), c / expected))
    if not slow:
        grown = max(ratios.values())
        why = (
            f"no rank's compute grew more than {excess:.0%} beyond its own baseline and its "
            f"peers' (largest growth {grown:.2f}x): the slowdown is in the collectives or "
            f"job-wide, not one node's compute{unseen}"
        )
        if unexplained:
            why = "no node named: " + "; ".join(unexplained[:3]) + unseen
        return ratios, computes, slow, why
    nodes = {n for n, _ in ratios}
    if len(nodes) > 2 and len(slow) > len(nodes) / 2:
        why = (
            f"compute grew on {len(slow)} of {len(nodes)} nodes ({', '.join(sorted(slow))}): "
            f"a job-wide slowdown, not one node's"
        )
        return ratios, computes, {}, why
    return ratios, computes, slow, None


def _stalled_for(ranks: list[tuple[str, RankReport]], now: float, resumed: float | None = None) -> float:
    """How long the job has been stalled (s; Mycroft Alg. 1: no rank completed
    a collective). Where every rank's hook says what it has in flight
    (RankReport.in_flight_known), a stall is ranks waiting
    inside a collective: none in flight anywhere is every rank between
    collectives (an evaluation, a checkpoint save, data loading), a quiet
    job, 0; else the time since the longest waiter entered its wait, or
    since the last progress if that is later (a rank that finished an
    evaluation of minutes first and waits for the others has waited only
    since then). Where a hook does not say (the NCCL hook with host times
    only), the time since the last completed collective. Never from before
    `resumed` (Unix s, JobInfo.resumed_at): a job Slurm suspended made no
    progress because it was stopped, and its agents' reports may predate the
    resume by a report interval.

    A rank busy with I/O (RankReport.last_io) is progressing too: rank 0
    saving a checkpoint alone while the others wait in a barrier (plain DDP's
    torch.save on rank 0) takes minutes for a large model. Where the hooks say
    what is in flight, only the I/O of the ranks the others wait for (none in
    flight) counts; else any rank's. The stall then counts from the agents'
    last look at that I/O: a save that ends in a hang is a stall stall_s later."""
    progress = [r.last_progress for _, r in ranks if r.last_progress is not None]
    if not progress or all(r.stopped for _, r in ranks):
        # every rank stopped is a job paused on purpose (its user's SIGSTOP, or a
        # Slurm suspension the cycle's view does not show yet), not a node's fault
        return 0.0
    last = max(max(progress), resumed or 0.0)
    known = all(r.in_flight_known for _, r in ranks)
    busy = [
        r.last_io
        for _, r in ranks
        if r.last_io is not None and not r.stopped and not (known and r.in_flight_since is not None)
    ]
    last = max(last, max(busy, default=last))
    if not known:
        return now - last
    waits = [r.in_flight_since for _, r in ranks if r.in_flight_since is not None]
    if not waits:
        return 0.0
    return now - max(last, min(waits))


def _resume_cut(ranks: list[tuple[str, RankReport]], resumed: float | None) -> float | None:
    """After Slurm resumed a suspended job: the iterations that count are those
    after each rank's iteration spanning the suspension (which ended after the
    resume and lasted the whole suspension: no slowdown of a node). Unix s:
    the latest end of those spanning iterations, or the resume itself while a
    rank has none yet."""
    if resumed is None:
        return None
    cut = resumed
    for _, r in ranks:
        after = steps_since(r.steps, resumed)
        if len(after) == 0:
            continue
        cut = max(cut, after[0].end)
    return cut


def _held_up_by(ranks: list[tuple[str, RankReport]]) -> list[tuple[str, RankReport]]:
    """The ranks a stalled job waits for: those whose process is stopped (the
    agent saw it; a rank frozen inside a collective is in flight like the ranks
    waiting for it, and its last progress is theirs to within a millisecond);
    else those with no call in flight while others wait inside one (a rank
    frozen, or stuck outside its collectives), where every hook says; else all
    of them."""
    stopped = [(n, r) for n, r in ranks if r.stopped and r.last_progress is not None]
    if stopped:
        return stopped
    if not all(r.in_flight_known for _, r in ranks):
        return ranks
    free = [(n, r) for n, r in ranks if r.in_flight_since is None and r.last_progress is not None]
    return free or ranks


def assess_job(
    job_id: int,
    job_nodes: tuple[str, ...],
    ranks: list[tuple[str, RankReport]],
    flags_by_node: dict[str, list[PeerFlag]],
    policy: Policy,
    now: float,
    since: float | None = None,
    resumed: float | None = None,
) -> JobAssessment | None:
    """None while no rank has a baseline yet (warm-up), nothing was reported,
    or a rank's process has exited (a failing job is not a slow node).

    since: ignore iterations that ended before this Unix time (the job's
    previous run, before a requeue). resumed: when Slurm last resumed the job
    from a suspension (Unix s, JobInfo.resumed_at; None: never): the stall is
    counted from it at the earliest, and the iterations up to the one spanning
    the suspension are ignored.
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
    resume_cut = _resume_cut(ranks, resumed)
    if resume_cut is not None:
        since = resume_cut if since is None else max(since, resume_cut)
    stalled = _stalled_for(ranks, now, resumed)
    stalled = stalled if stalled >= tiers.stall_s else 0.0
    progress = [r.last_progress for _, r in ranks if r.last_progress is not None]
    if not baselines:
        return None
    baseline = float(np.median(baselines))
    current, onset, _ = _judge_steps([r for _, r in ranks], policy, since)
    if current is None and stalled <= 0:
        return None

    ratios: dict = {}
    computes: dict = {}
    slow_ranks: dict[str, list] = {}
    why_not: str | None = None
    if (
        stalled > 0
        or onset is not None
        or (current is not None and calls_for_a_tier(current / baseline - 1.0, tiers))
    ):
        # a job that is neither slow enough for a tier (response.tiers.classify) nor
        # in a slowdown episode needs no node named: at 10,000 nodes, localising
        # every healthy job was a third of the cycle
        cut = _phase_start(ranks, since)
        recent = {(n, r.rank): _localise_window(r, cut) for n, r in ranks}
        ratios, computes, slow_ranks, why_not = localise(ranks, recent, policy)
    held: dict[str, list] = {}
    prompt = False  # named from the iterations since the change (a large excess): acted on at once
    if slow_ranks:
        # sustained (Guard 4.2: deviation over consecutive windows): the same
        # node is named by the window of iterations before too; a machine's
        # scheduler can starve one rank for a few seconds, a fault stays
        before_windows = {(n, r.rank): _localise_window(r, cut, len(recent[(n, r.rank)])) for n, r in ranks}
        _, _, before, _ = localise(ranks, before_windows, policy)
        held = {n: rows for n, rows in slow_ranks.items() if n in before}
    if not held and onset is not None:
        # a large excess since the change point is named sooner (_since_change)
        # localise's window without its LOCALISE_MAX: all the iterations of the
        # last LOCALISE_S, so a moderate fault's excess in a job of fast steps,
        # within the noise of 48 iterations, is judged over seconds of them
        wide = {(n, r.rank): window_tail(steps_since(r.steps, cut), most=1 << 30) for n, r in ranks}
        held = _since_change(ranks, wide, onset, policy)
        if held:
            why_not = None
            prompt = True
    if slow_ranks and not held:
        why_not = (
            f"{', '.join(sorted(slow_ranks))}: slow over its last iterations "
            f"but not those before (not yet sustained)"
        )
    slow_ranks = held
    # the detectors' output: typed findings; controller.decide turns them into the assessment
    found: list[Finding] = []
    if current is not None:
        slower = current / baseline - 1.0
        found.append(
            Finding(
                Kind.STEP_TIME,
                Subject(job_id=job_id),
                "steps",
                now,
                Severity.WARNING if onset is not None and slower > 0 else Severity.INFO,
                (
                    Measure("baseline_s", baseline, "s/step"),
                    Measure("current_s", current, "s/step", baseline),
                    Measure("slowdown", slower, "fraction"),
                ),
                onset=onset,
                text=f"step {current:.3g}s vs baseline {baseline:.3g}s ({slower:+.0%})",
            )
        )
    if stalled > 0:
        # Mycroft: a stall names the rank with the least progress, among those
        # the others wait for (no call in flight) where the hooks say
        n, r, last = min(
            ((n, r, r.last_progress) for n, r in _held_up_by(ranks) if r.last_progress is not None),
            key=lambda x: x[2],
        )
        found.append(
            Finding(
                Kind.STALL,
                Subject(job_id=job_id, node=n, rank=r.rank, gpu=r.gpu),
                "stall",
                now,
                Severity.CRITICAL,
                (
                    Measure("quiet_s", stalled, "s", tiers.stall_s),
                    Measure("baseline_s", baseline, "s/step"),
                    Measure("least_progress_age_s", now - last, "s"),
                ),
                onset=max(progress),
                text=(
                    f"rank {r.rank}'s process is stopped (last collective {now - last:.0f}s ago)"
                    if r.stopped
                    else f"rank {r.rank} made the least progress (last collective {now - last:.0f}s ago)"
                ),
            )
        )
    by_key = {(n, r.rank): r for n, r in ranks}
    for node, rows in slow_ranks.items():
        for rank, c, against, alone, beyond in rows:
            rep = by_key.get((node, rank))
            gpu = rep.gpu if rep is not None else None
            # a rank localise judged without same-role peers (alone in its role,
            # or its peers still in warm-up), named against its own baseline:
            # not before ALONE_NAMED_S; nor one named since the change by a small
            # excess over its peers (PROMPT_EXCESS)
            slight = prompt and not alone and beyond <= 1.0 + PROMPT_EXCESS
            wait = ALONE_NAMED_S if (alone and not prompt) or slight else 0.0
            found.append(
                Finding(
                    Kind.SLOW_RANK,
                    Subject(job_id=job_id, node=node, rank=rank, gpu=gpu),
                    "localise",
                    now,
                    Severity.WARNING,
                    (
                        Measure("compute_s", c, "s/step"),
                        Measure("compute_ratio", ratios[(node, rank)], "x"),
                        Measure("named_for_s", wait, "s"),
                    ),
                    text=f"rank {rank} compute {c:.3g}s vs {against}",
                )
            )
    links = link_verdict(ranks, policy)
    if links is not None:
        # per-link network times (NCCL profiler plugin; Mycroft, Table 4): the
        # node common to the slow links, or none (said, never blamed)
        for rank in links.ranks or (None,):
            found.append(
                Finding(
                    Kind.SLOW_LINK,
                    Subject(job_id=job_id, node=links.node, rank=rank),
                    "links",
                    now,
                    Severity.WARNING if links.node is not None else Severity.INFO,
                    text=links.why,
                )
            )
    if why_not and not slow_ranks:
        found.append(Finding(Kind.UNLOCALISED, Subject(job_id=job_id), "localise", now, text=why_not))
    for node in job_nodes:
        found.extend(f.finding(now) for f in flags_by_node.get(node, ()))
    return decide.decide(
        decide.JobFindings(
            job_id,
            job_nodes,
            len(ranks),
            tuple(found),
            rank_compute_s={f"{n}/{r}": v for (n, r), v in computes.items()},
            rank_compute_ratio={f"{n}/{r}": v for (n, r), v in ratios.items()},
            slow_links=links.links if links is not None else (),
        )
    )


def reason_text(a: JobAssessment, culprit: Culprit, tz: timezone | None = None) -> str:
    """Short and specific: 'step +23% since 14:02, gpu3 sm_clock 1380 vs peers 1980'."""
    since = ""
    if a.onset is not None:
        since = " since " + datetime.fromtimestamp(a.onset, tz).strftime("%H:%M")
    head = (
        f"stall {a.stalled_for_s:.0f}s"
        if a.stalled_for_s > 0 and a.slowdown <= 0
        else f"step {a.slowdown * 100:+.0f}%{since}"
    )
    detail = culprit.telemetry[0] if culprit.telemetry else culprit.why
    return f"{head}, job {a.job_id}, {detail}"
