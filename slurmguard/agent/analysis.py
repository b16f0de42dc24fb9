"""Per-rank analysis on the node: iterations, step times, role, baseline, changes.

Times are when the ops' work ran: on the GPU where the ring has it (the
NCCL hook's CUDA events, the profiler plugin's kernel timers), else the
host call (gloo, the torch hook). Per-rank compute = iteration time minus
the time the rank may have waited inside collectives (detect.waiting: up to
the last completion before each next call, so a DDP rank's backward pass
under its in-flight all-reduces counts as compute), and the rank that starts
its collectives late (its compute grew) is told from the peers that wait
inside them.
Iteration boundaries come from slurmguard.detect.period.find_iterations
(symbol repeats, as Greyhound 4.2's ACF, with timing deciding between a
period and its fractions: equal DDP buckets, a pipeline stage's
micro-batches). Each iteration's time inside collectives is measured too,
so the controller can tell the rank that computes slowly (its compute time
grows) from the peers that wait for it (their collective time grows); each
rank's role (role_of) says which ranks are its peers. A new iteration
structure restarts the baseline (warm-up never counts as a slowdown), and
samples that make no sense are dropped and counted, never raised.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from dataclasses import dataclass, field, fields

import numpy as np

from slurmguard.agent.rings import TrackedRing
from slurmguard.config import AgentPolicy, DetectionPolicy, PeriodPolicy
from slurmguard.detect.period import KEPT_SPLIT, Iterations, find_iterations, iteration_anchors
from slurmguard.detect.records import RankOps
from slurmguard.detect.steps import DetectorConfig, StepDetector
from slurmguard.detect.waiting import waiting_time
from slurmguard.hook.ring import F_ASYNC, SOURCE_TORCH
from slurmguard.wire import (
    MAX_LINKS,
    ChangeReport,
    LinkReport,
    RankReport,
    StepSample,
)


def rank_ops(tr: TrackedRing) -> RankOps:
    """The rank's collectives in issue order, timed by when their work ran:
    on the GPU where the ring has it (CUDA events of the NCCL hook, kernel
    timers of the profiler plugin), else the host call. On a GPU the host
    call is only the enqueue: iteration boundaries, step and comm times all
    come from the GPU timeline then, never a mix of the two."""
    return RankOps(tr.header.global_rank, tr.op, tr.comm, tr.nbytes, tr.begin_ns, tr.finish_ns)


def iteration_bounds(tr: TrackedRing, detection: DetectionPolicy) -> np.ndarray | None:
    """Monotonic ns at which each iteration started (anchor op starts), or None."""
    return iteration_starts(rank_ops(tr), detection.period)


def role_of(tr: TrackedRing, it: Iterations) -> str:
    """What work this rank does, as a short stable key: ranks with the same
    key issue the same collectives per iteration (op, communicator size,
    bytes, as a multiset, so where the anchor falls does not matter) and
    talk point-to-point in the same directions (peer minus own rank in that
    communicator: a pipeline's first stage sends forward, its last stage
    receives from behind). Data-parallel replicas, FSDP shards and tensor
    parallel positions share a role; pipeline stages do not."""
    sig = sorted((op, tr.comm_sizes.get(comm, 0), nbytes) for op, comm, nbytes in it.signature)
    p2p = np.isin(tr.op, _P2P) & (tr.peer >= 0)
    offsets = sorted(
        {
            int(peer) - tr.comm_ranks.get(int(c), tr.header.global_rank)
            for peer, c in zip(tr.peer[p2p], tr.comm[p2p])
        }
    )
    return hashlib.sha1(repr((sig, offsets)).encode()).hexdigest()[:12]


def waited_until(tr: TrackedRing) -> np.ndarray:
    """End of each op for the comm time: when its work finished (on the GPU
    where known: a rank that waits inside a collective for a slow peer
    shows it there, the late rank a late GPU start), except for
    receives whose end the hook could not time (the torch hook on gloo:
    point-to-point work has no future, so the record ends when the call
    returns and the wait happens after it, unseen). Those count as waiting
    until the rank's next collective: the rank's compute in that span is
    not observable, and taking it for compute would blame a pipeline stage
    for the time it waits on a slow neighbour."""
    end = tr.finish_ns
    if tr.header.source != SOURCE_TORCH or end.size < 2:
        return end
    untimed = (tr.op == _RECV) & ((tr.flags & F_ASYNC) == 0)
    if not untimed.any():
        return end
    nxt = np.concatenate([tr.begin_ns[1:], end[-1:]])
    return np.where(untimed, np.maximum(end, nxt), end)


def link_reports(tr: TrackedRing) -> list[LinkReport]:
    """The rank's links with transfers (profiler plugin), busiest first."""
    rows = sorted(tr.links.items(), key=lambda kv: -kv[1].steps)[:MAX_LINKS]
    return [
        LinkReport(
            comm=comm,
            peer=peer,
            sent=sent,
            steps=lt.steps,
            bytes=lt.bytes,
            net_s=lt.net_ns / 1e9,
            peer_wait_s=lt.peer_wait_ns / 1e9,
            gpu_wait_s=lt.gpu_wait_ns / 1e9,
        )
        for (comm, peer, sent), lt in rows
        if lt.steps > 0 and peer >= 0
    ]


def iteration_starts(ops: RankOps, period: PeriodPolicy) -> np.ndarray | None:
    """Start times (ns, the ops' clock) of each iteration's anchor op, or None.

    `ops` in issue order (by start time). Pure: the same logic for the
    agent's live rings and for archived traces (see
    slurmguard.detect.period.iteration_anchors).
    """
    idx = iteration_anchors(ops, period)
    return None if idx is None else ops.start_ns[idx].copy()


_P2P = np.array([7, 8])  # send, recv (sg_ring.h)
_RECV = 8

#: longest iteration taken as real (s); a longer "iteration" is a job
#: stopped for a day or a forged record
MAX_STEP_S = 86400.0
#: latest iteration end accepted ahead of the agent's clock (s)
FUTURE_SLACK_S = 300.0
#: while the rank's step is within this fraction of its baseline (mean of its
#: newest agent.baseline_steps iterations, no slowdown open), its compute
#: baseline follows its compute (their median), once a poll: a pipeline stage's
#: compute settles after the start-up while the step, set by the slower stage,
#: stays where it was. Learned in its first second (9.3 ms against 7.5-7.9 ms
#: after), a healthy stage's compute baseline read it as 0.85x, and the other
#: stage's drift over the next 40 s (8.0 to 9.5 ms on a shared host) as 1.2x
#: against that: its node was drained. A fault moves the step beyond this (the
#: moderate tier starts at 10%), which freezes the baseline
COMPUTE_FOLLOW = 0.05
#: ... judged over the rank's newest iterations of this many seconds
#: (agent.baseline_steps of them at least), once it holds that many: the
#: compute of one stage against another's moves with the host's load, in
#: spells of a second or two. Over the newest 20 iterations (0.25 s of a
#: GPipe stage's 13 ms steps), a healthy first stage's baseline followed a
#: dip of its compute to 6.3 ms (7.5-10 ms before and after) while the step
#: touched its baseline; against it, the stage read as 1.5x for the next
#: minute and its node was drained
COMPUTE_FOLLOW_S = 4.0
#: most iterations held for COMPUTE_FOLLOW_S (a job of sub-millisecond steps)
COMPUTE_FOLLOW_MAX = 4096


#: ops of a rank's first look in RankAnalyzer.replay (then twice as many,
#: and so on up to the first report's): 64 hold 3 repetitions of up to 21
FIRST_LOOK_OPS = 64

#: a rank's ring is analysed between two reports as soon as it holds this
#: share of agent.max_ops_per_rank ops its last analysis has not seen (the
#: agent reads its rings every RING_READ_S, agent.daemon.Agent.read_rings):
#: the tracker keeps the newest max_ops_per_rank ops of a rank, and a job that
#: issues more between two reports lost the older ones, never counted nor fed
#: to the detector (a tensor-parallel job of 8 layers and 10-ms steps issues
#: some 32,000 ops in the default 10-s interval)
READ_AHEAD = 0.5
#: seconds between the agent's reads of its rings (at most the report interval)
RING_READ_S = 1.0


def sane_steps(
    step_s: np.ndarray, comm_s: np.ndarray, end: np.ndarray, now: float | None = None
) -> np.ndarray:
    """Mask of iteration samples that make sense: finite, 0 < step <=
    MAX_STEP_S, 0 <= comm <= step, end (Unix s) not after now + FUTURE_SLACK_S.
    Ring records come from the job, so anything else is dropped (and
    counted by the caller), never raised."""
    now = time.time() if now is None else now
    with np.errstate(invalid="ignore"):
        return (
            np.isfinite(step_s)
            & np.isfinite(comm_s)
            & np.isfinite(end)
            & (step_s > 0)
            & (step_s <= MAX_STEP_S)
            & (comm_s >= 0)
            & (comm_s <= step_s)
            & (end > 0)
            & (end <= now + FUTURE_SLACK_S)
        )


@dataclass
class RankAnalyzer:
    """Keeps one rank's derived state between polls."""

    agent: AgentPolicy
    detection: DetectionPolicy
    baseline_s: float | None = None
    baseline_compute_s: float | None = None
    baseline_compute_mean_s: float | None = None
    """Plain mean compute (s) of the iterations baseline_compute_s is the median of."""
    baseline_compute_at: float | None = None
    """End (Unix s) of the newest of those iterations."""
    baseline_mean_s: float | None = None
    """Healthy mean step (s), outliers and checkpoints counted (StepDetector.baseline_mean_s)."""
    total_steps: int = 0
    dropped: int = 0
    """Derived samples dropped as nonsense (see sane_steps), since the rank was first seen."""
    structure: tuple[int, str] | None = None
    """(ops per iteration, role) the baseline was measured under."""
    _comm: int | None = None  # the communicator the period was found on (Iterations.comm)
    _last_anchor_ns: int = -(1 << 62)
    _det: StepDetector | None = None
    _fed_until_ns: int = 0
    _fed_ends: list[float] = field(default_factory=list)
    _fed_base: int = 0  # detector index of _fed_ends[0]
    _fed_compute: list[float] = field(default_factory=list)
    """Compute (s) of the newest iterations fed, after the warm-up: those of the newest
    COMPUTE_FOLLOW_S, agent.baseline_steps at least, COMPUTE_FOLLOW_MAX at most."""
    _fed_step: list[float] = field(default_factory=list)
    """Step (s) of the same iterations as _fed_compute."""
    _fed_cend: list[float] = field(default_factory=list)
    """End (Unix s) of the same iterations as _fed_compute."""
    _compute_for: float | None = None  # the step baseline (s) baseline_compute_s was taken with
    _replayed: bool = (
        False  # derive() has made the first look's replay (once: it searches the ring many times)
    )
    changes: list[ChangeReport] = field(default_factory=list)

    def replay(self, tr: TrackedRing) -> list[StepSample]:
        """Every iteration the ring holds (oldest first), derived as the node
        agent derives them while the job runs: report() on the ring's ops as
        they stood every agent.report_interval_s (and between reports, as the
        agent reads its rings, after every READ_AHEAD of
        agent.max_ops_per_rank ops), the newest agent.max_ops_per_rank of
        them, from its oldest op on. The period the
        agent learns first is kept once its baseline is (see _steps); one
        search over the whole ring at once cannot do that and takes a cycle
        of many iterations that timing alone cannot tell from one iteration
        of many parts (a checkpoint every 25 iterations; a host cycle of 4 s
        read as a TP x DP rank's 405-op "iteration", its peers at their 9).
        Once the baseline is learned the cadence no longer changes what is
        found, so the replay then moves window_ops / 4 ops at a time at least
        (a ring of 65,536 ops takes some 30 searches, not one a report)."""
        if tr.begin_ns.size == 0:
            return self._steps(tr)
        # when each op's work began (the GPU's time where the ring has it, as
        # the iterations are timed), as a running maximum: the prefixes are
        # of the ops in issue order
        begin = np.maximum.accumulate(tr.begin_ns)
        every_ns = int(self.agent.report_interval_s * 1e9)
        stride = max(1, self.detection.period.window_ops // 4)
        out: list[StepSample] = []

        def look(n: int) -> None:
            nonlocal out
            out = self._report_look(tr.ops_slice(0, n), out)

        # ... and between reports, when the ops not yet looked at pass READ_AHEAD
        ahead = max(1, int(READ_AHEAD * self.agent.max_ops_per_rank))
        t = int(begin[0]) + every_ns
        # the first report's ops, as from an agent that looked at once: growing
        # by halves until a baseline is learned, so that the rank's step is
        # found before a cycle of steps can be (an evaluation every 40 steps of
        # a 23-ms DDP step: 10 s of it hold 11 such cycles, read as one 160-op
        # iteration; its first 64 ops hold 16 steps and no cycle)
        first, n = min(int(np.searchsorted(begin, t, side="right")), ahead), FIRST_LOOK_OPS
        while n < first and self.baseline_s is None:
            look(n)
            n *= 2
        n = 0
        while n < begin.size:
            upto = int(np.searchsorted(begin, t, side="right"))
            if self.baseline_s is not None:
                upto = max(upto, min(n + stride, begin.size))
            read = upto > n + ahead  # the agent looks before the report
            upto = min(upto, n + ahead)
            if upto > n:
                n = upto
                look(n)
            if read:
                continue
            t = int(begin[min(n, begin.size - 1)]) + every_ns if self.baseline_s is not None else t + every_ns
        return out

    def _report_look(self, tr: TrackedRing, out: list[StepSample]) -> list[StepSample]:
        """`out` with the iterations of a report of the ring as it stands:
        under a kept period every op since the newest iteration fed
        (_since_fed), else one look at the ring's newest ops."""
        if self.structure is not None and self.baseline_s is not None:
            return self._since_fed(tr, out)
        return self._look(tr, tr.begin_ns.size, out)

    def _look(self, tr: TrackedRing, n: int, out: list[StepSample]) -> list[StepSample]:
        """`out` (iterations derived so far, oldest first) with those of a
        look at the ring's first n ops, as a report of them derives and feeds
        them."""
        view = tr.ops_slice(max(0, n - self.agent.max_ops_per_rank), n)
        was = self.structure
        steps = self._steps(view)
        self._feed_bocd(view, steps)
        if self.structure != was:
            # a new structure: what was derived under the old one is
            # not this rank's iterations (its first seconds, read
            # before the real period showed), all of the window's are
            return steps
        # the newest look's iterations stand for the span they cover (its
        # anchors may have moved with more history, as a live agent's do
        # from one report to the next); older looks' only before it
        first_end = steps[0].end if steps else float("inf")
        return [s for s in out if s.end < first_end] + steps

    def _since_fed(self, tr: TrackedRing, out: list[StepSample]) -> list[StepSample]:
        """A report's look under a kept period (a baseline learned), over
        every op since the newest iteration fed: one search takes the
        newest period.window_ops ops only, and a job that issues more
        between two reports would lose the iterations before them (not
        counted, never fed to the detector): a 2-stage GPipe job of 16
        micro-batches issues 12,500 ops in the default 10-s interval. The
        looks' windows begin window_ops / 4 before the first op not yet fed
        and overlap by half, the last at the ring's end: one look (the
        search of every report) while that is within the window."""
        size = tr.begin_ns.size
        window = self.detection.period.window_ops
        begin = np.maximum.accumulate(tr.begin_ns)
        first = int(np.searchsorted(begin, self._fed_until_ns, side="right"))
        end = first - window // 4 + window
        while end < size:
            out = self._look(tr, end, out)
            end += max(1, window // 2)
        return self._look(tr, size, out)

    def derive(self, tr: TrackedRing) -> list[StepSample]:
        """The ring's iterations as this rank's state stands (oldest first):
        on the rank's first look, its replay (replay(): the period found on
        its first ops, kept) where it finds the iteration one search over
        what the ring holds finds, or one of fewer than 1/KEPT_SPLIT of its
        ops; else that search. After the first look, one search that keeps
        the period. The search gives the iterations of the newest
        period.window_ops ops only: a ring of a 2-stage GPipe job (16
        micro-batches, 32 ops a step) archived with 2,045 iterations read
        as 256 by `slurmguard iterations`; the replay's cover the ring, and
        an agent restarted mid-job learns the baseline from the ring's
        oldest iterations, as one that had looked from the start, not from
        the window's (under a fault begun while it was down). The replay is made once: a
        rank whose ops show no iteration yet would replay its whole ring at
        every report (6.9 s a report for 16,000 ops of no pattern spanning 11
        minutes at a 1-s interval).

        A first look over many steps (the agent's first report under the
        default 10-s interval, an agent restarted mid-job, `slurmguard
        iterations`) can take a cycle of steps for the iteration: 10 s of a
        23-ms DDP step with an evaluation every 40 steps hold 11 such cycles,
        read as an 80-op iteration and kept from then on. The replay finds
        the step first. A whole of KEPT_SPLIT parts or fewer is the search's
        to keep (a pipeline stage's micro-batches, which a replay's first
        ops can read as the iteration: kept so, a fault that blurs them
        makes the stage find its whole again, and learn its baseline again
        under the fault), as is a replay's longer period (a multiple of the
        step read on the first ops of a loaded start: an async 2-rank job's
        4 steps, in one of three full-suite runs)."""
        if self.structure is not None or self._replayed or tr.begin_ns.size <= FIRST_LOOK_OPS:
            return self._report_look(tr, [])
        replayed = RankAnalyzer(self.agent, self.detection)
        steps_r = replayed.replay(tr)
        steps = self._steps(tr)
        self._feed_bocd(tr, steps)
        if replayed.structure is not None and (
            self.structure is None
            or replayed.structure == self.structure
            or replayed.structure[0] * KEPT_SPLIT < self.structure[0]
        ):
            for f in fields(self):
                setattr(self, f.name, getattr(replayed, f.name))
            steps = steps_r
        self._replayed = True
        return steps

    def report(self, tr: TrackedRing) -> RankReport:
        steps = self.derive(tr)
        h = tr.header
        last_end = int(tr.finish_ns.max()) if tr.finish_ns.size else None
        return RankReport(
            rank=h.global_rank,
            local_rank=h.local_rank if h.local_rank >= 0 else None,
            gpu=h.local_rank if h.local_rank >= 0 else None,
            source=h.source_name,
            period_ops=self.structure[0] if self.structure else None,
            role=self.structure[1] if self.structure else None,
            baseline_step_s=self.baseline_s,
            baseline_mean_s=self.baseline_mean_s,
            baseline_compute_s=self.baseline_compute_s,
            baseline_compute_mean_s=self.baseline_compute_mean_s,
            baseline_compute_at=self.baseline_compute_at,
            steps=steps[-self.agent.report_steps :],
            total_steps=self.total_steps,
            last_progress=tr.to_unix_s(last_end) if last_end else None,
            in_flight_since=(
                tr.to_unix_s(tr.in_flight_since_ns) if tr.in_flight_since_ns is not None else None
            ),
            in_flight_known=tr.in_flight_known,
            lost_records=tr.lost,
            changes=self.changes[-8:],
            exited=tr.writer_exited,
            stopped=tr.writer_stopped,
            last_io=tr.io_active_at,
            links=link_reports(tr),
        )

    def _steps(self, tr: TrackedRing) -> list[StepSample]:
        # once a baseline is learned, its period holds while the ops still fit it
        # (a checkpoint every N iterations is not a new iteration structure)
        kept = self.structure[0] if self.structure and self.baseline_s is not None else None
        # ... and may give way to its parts while no slowdown is open: a
        # whole of two steps proven by a start-up's alternating steps fits for
        # good, while a fault can blur a real split (a pipeline's micro-batches)
        # for a whole window and must not halve the iteration under it
        parts = kept is not None and self._det is not None and self._det.open_episode(0) is None
        it = find_iterations(
            rank_ops(tr), self.detection.period, keep_period=kept, keep_comm=self._comm, parts_if_alike=parts
        )
        if it is None:
            return []
        self._comm = it.comm
        structure = (it.period, role_of(tr, it))
        if structure != self.structure:
            # a new iteration structure (first seen, or the job changed phase,
            # or more history showed the real period): what was measured under
            # the old one is not a baseline for the new one
            if self.structure is not None:
                self._reset_baseline()
            self.structure = structure
            # and recount the iterations seen under the new structure
            self.total_steps, self._last_anchor_ns = 0, -(1 << 62)
        bounds = tr.begin_ns[it.anchors]
        bounds = bounds[np.concatenate([[True], np.diff(bounds) > 0])]  # equal starts: one anchor
        if bounds.size < 2:
            return []
        comm = waiting_time(tr.begin_ns, waited_until(tr), bounds)
        step = np.diff(bounds).astype(np.float64)
        ends = (bounds[1:].astype(np.float64) + tr.header.clock_offset_ns) / 1e9
        good = sane_steps(step / 1e9, comm / 1e9, ends)
        self.dropped += int(np.count_nonzero(~good))
        # iterations seen to start (anchors): all of them while the window
        # still holds the rank's whole history; after that, the new ones (an
        # anchor less than half an iteration after the last counted one is
        # that one again, moved within its iteration by more history). The
        # anchors come from the newest period.window_ops ops only: once the
        # tracker holds more, they are not the whole history however short
        # of max_ops_per_rank it is (a GPipe stage's count stood at 1,024 for
        # its next 1,024 iterations, 8,192 to 16,384 ops)
        whole = tr.begin_ns.size <= min(self.agent.max_ops_per_rank - 1, self.detection.period.window_ops)
        if whole and tr.cursor is not None and tr.lost == 0:
            self.total_steps = max(self.total_steps, int(bounds.size))
        else:
            guard = self._last_anchor_ns + 0.5 * float(np.median(step))
            self.total_steps += int(np.count_nonzero(bounds > guard))
        self._last_anchor_ns = max(self._last_anchor_ns, int(bounds[-1]))
        ends, step, comm = ends[good], step[good], comm[good]
        # samples only for what is used (the window holds up to thousands):
        # the newest report_steps, and those _feed_bocd may feed (it feeds
        # none that ends by _fed_until_ns; same arithmetic as there)
        used = ((ends - tr.header.clock_offset_ns / 1e9) * 1e9).astype(np.int64) > self._fed_until_ns
        used[-self.agent.report_steps :] = True
        return [
            StepSample(end=float(e), step_s=float(s) / 1e9, comm_s=float(c) / 1e9)
            for e, s, c in zip(ends[used], step[used], comm[used])
        ]

    def _reset_baseline(self) -> None:
        self.baseline_s = self.baseline_compute_s = self.baseline_compute_mean_s = self.baseline_mean_s = None
        self.baseline_compute_at = None
        self._det = None
        self._fed_until_ns = 0
        self._fed_ends = []
        self._fed_base = 0
        self._fed_compute = []
        self._fed_step = []
        self._fed_cend = []
        self._compute_for = None

    def _feed_bocd(self, tr: TrackedRing, steps: list[StepSample]) -> None:
        """Feed new iterations to the step detector (slurmguard.detect.steps, the
        same code and thresholds as the controller, the CLI and the bench).

        The rank's baseline is the detector's: once it has learned the rank's
        step pattern (after agent.warmup_steps + agent.baseline_steps
        iterations), the mean step over one period, and the median compute time
        of the agent.baseline_steps iterations before it was learned or last
        moved (a job's first iterations after its warm-up can still be slower
        than its steady state: one DDP rank computed 0.027 s there and 0.019 s
        after, which hid a 1.25x CPU cap of its node behind "no growth"), and
        of the newest ones while the step stays at its baseline (COMPUTE_FOLLOW,
        over COMPUTE_FOLLOW_S of them).
        Every verified change becomes a ChangeReport:
        `at` is the end of the last iteration before it (the located onset),
        `detected_at` the end of the iteration at which the detector knew.
        """
        if self._det is None:
            cfg = DetectorConfig.from_parts(
                self.detection.bocd, self.agent.warmup_steps, self.agent.baseline_steps
            )
            self._det = StepDetector(1, cfg)
        det = self._det
        off_s = tr.header.clock_offset_ns / 1e9
        for s in steps:
            end_ns = int((s.end - off_s) * 1e9)
            if end_ns <= self._fed_until_ns:
                continue
            self._fed_until_ns = end_ns
            self._fed_ends.append(s.end)
            if len(self._fed_ends) + self._fed_base > det.cfg.warmup:
                self._fed_compute.append(s.step_s - s.comm_s)
                self._fed_step.append(s.step_s)
                self._fed_cend.append(s.end)
            for cp in det.update(np.array([s.step_s])):
                self.changes.append(
                    ChangeReport(
                        at=self._fed_end(cp.index - 1),
                        direction=cp.direction,
                        before_s=cp.level_before,
                        after_s=cp.level_after,
                        detected_at=self._fed_end(cp.detected_at),
                    )
                )
            if det.learned(0):
                # follows the detector: learned again after a long warm-up, or
                # moved when the job got faster
                self.baseline_s = det.baseline_s(0)
                self.baseline_mean_s = det.baseline_mean_s(0)
                if self._fed_compute and (
                    self.baseline_compute_s is None or self.baseline_s != self._compute_for
                ):
                    self._set_compute_baseline(self._fed_compute[-det.cfg.learn :], self._fed_cend[-1])
                    self._compute_for = self.baseline_s
        # the newest COMPUTE_FOLLOW_S of iterations (and the one before, so
        # that they span it), baseline_steps at least
        ends = self._fed_cend
        if ends:
            within = len(ends) - bisect.bisect_left(ends, ends[-1] - COMPUTE_FOLLOW_S)
            keep = min(max(det.cfg.learn, within + 1), COMPUTE_FOLLOW_MAX)
            del self._fed_compute[:-keep], self._fed_step[:-keep], self._fed_cend[:-keep]
        if (
            self.baseline_s is not None
            and len(self._fed_compute) >= det.cfg.learn
            and (ends[-1] - ends[0] >= COMPUTE_FOLLOW_S or len(ends) >= COMPUTE_FOLLOW_MAX)
            and det.open_episode(0) is None
            and float(np.mean(self._fed_step)) <= self.baseline_s * (1.0 + COMPUTE_FOLLOW)
        ):
            self._set_compute_baseline(self._fed_compute, ends[-1])
        # the detector's indices are positions in this list: keep it, but only
        # as far back as a change can be located (the detector's history)
        drop = len(self._fed_ends) - 2 * det.hcap
        if drop > 0:
            del self._fed_ends[:drop]
            self._fed_base += drop

    def _set_compute_baseline(self, compute: list[float], at: float) -> None:
        """The compute baseline from these iterations' compute (s), the newest of
        them ended at `at` (Unix s): their median, and their plain mean for what
        is judged on plain means (a busy host's freezes skew compute to the
        right: a pipeline stage's mean ran 10-20% above its median, so its plain
        mean against a median baseline "grew" where the other stage's did not)."""
        self.baseline_compute_s = float(np.median(compute))
        self.baseline_compute_mean_s = float(np.mean(compute))
        self.baseline_compute_at = at

    def _fed_end(self, k: int) -> float:
        """End time (Unix s) of the k-th iteration fed to the detector, clamped
        to the iterations still kept (k = -1, a change at the very first
        iteration: the end of the first)."""
        j = min(max(k - self._fed_base, 0), len(self._fed_ends) - 1)
        return self._fed_ends[j]
