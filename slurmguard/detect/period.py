"""Iteration period and step times from a rank's op sequence (Greyhound 4.2).

Where the iterations are (find_iterations, used by the agent, step_times
and the what-if traces): see its docstring; the ACF below (find_period,
rank_period) finds the period of a symbol sequence as the paper does.

The op sequence of a training rank repeats once per iteration. The period is
the first lag k whose autocorrelation reaches M = 0.95; the iteration time is
the time between an op and its occurrence one period earlier.

Choices where the paper is silent:
- Symbols are (op type, communicator) pairs, one-hot encoded; the ACF is the
  sum of the per-symbol autocovariances over the sum of the variances, so it is
  exactly 1 at the period of a strictly periodic sequence whatever the coding.
- Each lag is normalised over its overlap (a Pearson correlation of the lagged
  subsequences). The biased textbook estimator caps ACF_k at 1 - k/L, so a
  period longer than 5% of the window could never reach 0.95.
- One-hot coding also keeps long runs of one op (100 gradient-bucket
  AllReduces, then one AllGather) from scoring lag 1 near 1, as integer codes
  would. "First lag reaching M" is refined to the first lag reaching
  max(M, best - acf_tolerance), so a half-iteration that almost repeats (two
  micro-batches differing in one op) does not beat the real period.
- Warm-up and phase changes: the ACF runs on the most recent ops; if no lag
  qualifies, the oldest half is dropped and it retries, down to min_repeats
  periods. The current phase is then extended backwards while ops keep
  matching one period earlier, and the ACF is re-run on that phase alone, so
  warm-up ops and an earlier phase are left out.
- Several communicators: if the interleaving of communicators is not itself
  periodic (ops issued from several threads), each communicator's own
  sequence is tried, busiest first. A communicator alone often repeats the same
  op (three DP AllReduces), so its symbols also mark whether an op follows a
  long gap (over 4x the communicator's median gap: the compute between
  iterations); that puts the iteration boundary into the sequence.
- One op repeated (a Megatron-style TP job's equal all-reduces, nothing
  else): the symbols repeat at every lag, and where no gap is consistently
  the longest, the iteration is the smallest number of ops over which the
  gaps repeat as a pattern (Friedman's test, Kendall's W; _pattern_period).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

# the distribution functions themselves, not scipy.stats: that import alone
# costs the node agent about 50 MB of RSS (issue 17.5)
from scipy.special import bdtrc, chdtrc

from slurmguard.config import PeriodPolicy
from slurmguard.detect.bocd import row_medians
from slurmguard.detect.records import RankOps

#: an op more than this many median gaps after the previous one of its
#: communicator starts a new iteration (per-communicator fallback only)
LONG_GAP = 4.0


@dataclass(frozen=True)
class PeriodResult:
    """period: ops per iteration (in the sequence used); start: first op index of
    the current periodic phase (in the rank's full sequence); comm: None when
    the full interleaved sequence was periodic, else the communicator used;
    acf: the ACF at the period."""

    period: int
    start: int
    acf: float
    comm: int | None = None


def acf(symbols: np.ndarray, max_lag: int) -> np.ndarray:
    """Overlap-normalised ACF of a categorical sequence for lags 0..max_lag."""
    s = np.asarray(symbols)
    n = s.size
    max_lag = min(max_lag, n - 1)
    _, codes = np.unique(s, return_inverse=True)
    k = int(codes.max()) + 1 if n else 0
    out = np.zeros(max_lag + 1)
    if n < 2 or k < 2:
        out[:] = 1.0 if k == 1 else 0.0
        return out
    onehot = np.zeros((k, n))
    onehot[codes, np.arange(n)] = 1.0
    # per symbol, centred on its mean over the window
    z = onehot - onehot.mean(axis=1, keepdims=True)
    m = 1 << int(np.ceil(np.log2(2 * n)))
    f = np.fft.rfft(z, m, axis=1)
    cov = np.fft.irfft(f * np.conj(f), m, axis=1)[:, : max_lag + 1].sum(axis=0)
    # variances of the two overlapping parts, via cumulative sums of z^2
    sq = (z * z).sum(axis=0)
    cs = np.concatenate([[0.0], np.cumsum(sq)])
    lags = np.arange(max_lag + 1)
    head = cs[n - lags]  # sum over t < n-k
    tail = cs[n] - cs[lags]  # sum over t >= k
    denom = np.sqrt(np.maximum(head * tail, 1e-300))
    out = cov / denom
    out[0] = 1.0
    return np.clip(out, -1.0, 1.0)


def _first_period(symbols: np.ndarray, policy: PeriodPolicy) -> tuple[int, float] | None:
    n = symbols.size
    max_lag = min(policy.max_period, n // policy.min_repeats)
    if max_lag < policy.min_period:
        return None
    a = acf(symbols, max_lag)
    cand = a[policy.min_period :]
    best = float(cand.max()) if cand.size else 0.0
    bar = max(policy.acf_threshold, best - policy.acf_tolerance)
    hits = np.nonzero(cand >= bar)[0]
    if hits.size == 0:
        return None
    k = int(hits[0]) + policy.min_period
    return k, float(a[k])


def _phase_start(symbols: np.ndarray, period: int, tolerance: int) -> int:
    """First index of the trailing stretch where x[t] == x[t + period] holds,
    allowing `tolerance` isolated mismatches (an op from a stray thread)."""
    n = symbols.size
    match = symbols[:-period] == symbols[period:]
    bad = np.nonzero(~match)[0]
    if bad.size == 0:
        return 0
    # walk back from the end; stop at a cluster of mismatches
    allowed = tolerance
    start = 0
    for i in bad[::-1]:
        later = bad[(bad > i) & (bad <= i + period)]
        if later.size or allowed <= 0:
            start = int(i) + 1
            break
        allowed -= 1
    return min(start, max(n - 2 * period, 0))


def find_period(symbols: np.ndarray, policy: PeriodPolicy | None = None) -> tuple[int, int, float] | None:
    """(period, phase start, acf) of a symbol sequence, or None if not periodic."""
    p = policy or PeriodPolicy()
    s = np.asarray(symbols)[-p.window_ops :]
    offset = np.asarray(symbols).size - s.size
    window = s
    while window.size >= max(2 * p.min_period, p.min_repeats * p.min_period):
        got = _first_period(window, p)
        if got is not None:
            k, val = got
            start = _phase_start(s, k, tolerance=max(1, s.size // (50 * k)))
            if start > 0:
                # re-run on the periodic phase alone (warm-up / old phase dropped)
                again = _first_period(s[start:], p)
                if again is not None:
                    k, val = again
                    start = max(start, _phase_start(s, k, tolerance=max(1, s.size // (50 * k))))
            return k, offset + start, val
        window = window[window.size // 2 :]
    return None


def rank_period(ops: RankOps, policy: PeriodPolicy | None = None) -> PeriodResult | None:
    """Period of a rank's op sequence: the interleaved (op, comm) sequence
    first, then each communicator alone, busiest first."""
    p = policy or PeriodPolicy()
    if len(ops) < 2 * p.min_period:
        return None
    sym = ops.op * np.int64(1 << 32) + (ops.comm & 0xFFFFFFFF)
    got = find_period(sym, p)
    if got is not None:
        return PeriodResult(got[0], got[1], got[2], None)
    comms, counts = np.unique(ops.comm, return_counts=True)
    for c in comms[np.argsort(-counts)]:
        idx = np.nonzero(ops.comm == c)[0]
        if idx.size < 2 * p.min_repeats:
            continue
        gaps = np.diff(ops.start_ns[idx], prepend=ops.start_ns[idx[0]])
        big = gaps > LONG_GAP * max(float(np.median(gaps[1:])), 1.0)
        got = find_period(ops.op[idx] * 2 + big, p)
        if got is not None:
            return PeriodResult(got[0], int(idx[got[1]]), got[2], int(c))
    return None


@dataclass(frozen=True)
class StepTimes:
    """Per-iteration times of one rank: end_ns[i] is when iteration i ended
    (the anchor op's start), seconds[i] its duration."""

    rank: int
    period: PeriodResult
    end_ns: np.ndarray
    seconds: np.ndarray

    @property
    def mean(self) -> float:
        return float(np.mean(self.seconds)) if self.seconds.size else float("nan")


def step_times(
    ops: RankOps, policy: PeriodPolicy | None = None, period: PeriodResult | None = None
) -> StepTimes | None:
    """Iteration times of a rank (Greyhound: the time between an op and its
    occurrence one period earlier), from find_iterations: the one place that
    places iteration boundaries. `period` (e.g. from rank_period) is only
    carried into the result. None when no iteration is found."""
    p = policy or PeriodPolicy()
    it = find_iterations(ops, p)
    if it is None:
        return None
    ts = ops.start_ns[it.anchors]
    if ts.size < 2:
        return None
    pr = period or PeriodResult(it.period, int(it.anchors[0]), 1.0, None)
    return StepTimes(ops.rank, pr, ts[1:], np.diff(ts).astype(np.float64) / 1e9)


#: a symbol (op, communicator, bytes) this many times rarer than the commonest
#: one is not part of every iteration (start-up broadcasts, a checkpoint
#: barrier, the last small DDP bucket): left out when finding the boundaries
RARE_RATIO = 8.0
#: occurrences a symbol may miss at the window's two edges and still not be
#: rare: an op once per iteration beside 8 of the commonest (a TP job's flags
#: all-reduce) sits exactly at RARE_RATIO, and without this slack it was in or
#: out by where the window began, changing the iteration's length with it
RARE_SLACK = 2
#: a candidate k splits real iterations when, over j*k ops, one of its j
#: anchor gaps is the longest of them in more repetitions than chance
#: (1/j each) explains at this significance (binomial test), and its
#: median is at least SPLIT_RATIO times the shortest one's
SPLIT_P = 1e-3
SPLIT_RATIO = 1.2
#: significance at which the gaps of k ops must repeat (see _consistent)
CONSISTENT_P = 1e-6
#: largest multiple j tested
MAX_SPLIT = 128
#: largest multiple j still tested against a period kept by the caller
#: (find_iterations' keep_period): a split into this many parts or fewer
#: (a pipeline's micro-batches, a few equal buckets) can take longer to prove
#: than the agent takes to learn a baseline, and is still found; a longer
#: cycle is an interruption every N iterations (a checkpoint, an evaluation)
KEPT_SPLIT = 8


_KEY_LIMIT = 1 << 62


def _op_codes(ops: RankOps) -> np.ndarray:
    """One integer per (op, communicator, bytes): the rank of the triple in
    lexicographic order (as np.unique over rows numbers them), from each
    column's own ranks: sorting three int64 columns and one combined key is
    several times cheaper than np.unique(axis=0)'s sort of rows, which was a
    third of the agent's period finding (issue 17.5)."""
    key = np.zeros(len(ops), dtype=np.int64)
    span = 1  # key < span
    varied = 0  # columns holding more than one value
    for col in (ops.op, ops.comm, ops.nbytes):
        if col.size and col.min() == col.max():
            # one value, rank 0 throughout: the key stays as it is (one
            # communicator's ops, as the agent tests a kept period on, have
            # a single comm and often a single size), and no sort is needed
            continue
        values, rank = np.unique(col, return_inverse=True)
        if span * values.size >= _KEY_LIMIT:  # renumber densely first (span <= ops): never overflows
            key = np.unique(key, return_inverse=True)[1].ravel()
            span = len(ops)
        key = key * values.size + rank.ravel()
        span *= values.size
        varied += 1
    # the ranks of one column (or none) are already the triples' ranks
    return key if varied <= 1 else np.unique(key, return_inverse=True)[1].ravel()


#: most recent repetitions looked at when placing and testing boundaries
MAX_ROWS = 64


def _gap_rows(gaps: np.ndarray, k: int) -> np.ndarray | None:
    """The most recent gaps reshaped to (repetitions, k), aligned on the
    first gap; the first (partial-history) row and rows beyond MAX_ROWS dropped."""
    rows = gaps.size // k
    if rows < 5:
        return None
    return gaps[: rows * k].reshape(rows, k)[max(1, rows - MAX_ROWS) :]


def _consistent(g: np.ndarray) -> bool:
    """The gaps repeat every k ops (k = g's columns): Friedman's test that
    the positions' gaps differ consistently across repetitions (ranks
    within each repetition, so slow drifts of the whole job do not matter).
    A k that is not an iteration length (nor a fraction of one) shifts the
    pattern from one repetition to the next and ranks the positions at random."""
    return g.shape[1] < 2 or _concordance(g)[1] < CONSISTENT_P


#: a pattern of gaps every j ops (_pattern_period) must agree across its
#: repetitions at least this share as well as the best j tested does
#: (Kendall's W): a multiple of the real period agrees about as well as the
#: period (a Megatron-style TP job's 8 all-reduces: W at 8 ops 0.8-1.0 of
#: the best), while a j that straddles two parts of it mixes two patterns (4
#: of those 8: 0.3 as recorded, 0.5-0.65 with gaps of a crisper pattern)
PATTERN_SHARE = 0.7


def _concordance(g: np.ndarray) -> tuple[float, float]:
    """(Kendall's W, Friedman's p) of the gaps in rows of k positions: how far
    the positions' gaps rank alike in every repetition (W: 0 at random, 1
    the same order in every row; p: the chance of so much agreement at random)."""
    n, k = g.shape
    # each position's rank sum over the repetitions: the p-th smallest gap of a
    # repetition adds rank p + 1 to the position it sits at (whole numbers, so
    # the sums are exact in any order; without the (n, k) array of ranks, a
    # third of this test's cost in the agent's period search)
    order = np.argsort(g, axis=1)
    rank = np.empty((n, k))
    rank[:] = np.arange(1.0, k + 1.0)
    r = np.bincount(order.ravel(), weights=rank.ravel(), minlength=k)
    q = 12.0 / (n * k * (k + 1)) * float(np.dot(r, r)) - 3.0 * n * (k + 1)
    return q / (n * (k - 1)), float(chdtrc(k - 1, q))  # chi2.sf(q, k - 1)


#: newest gaps _pattern_period looks at: rows of j ops each, as many as fit
#: (64 rows, as _splits takes, left a TP job's 8-op pattern of W 0.09 short of
#: CONSISTENT_P under a CPU cap, and 16 ops, twice the rows' worth of
#: positions, passed: a two-step "iteration")
PATTERN_OPS = 2048
#: repetitions a pattern needs at least (so j <= PATTERN_OPS / PATTERN_ROWS):
#: a pattern over a few rows agrees by chance (a second of a TP job's 8-op
#: steps read as 16, 40, 56 or 112 ops with 5 rows)
PATTERN_ROWS = 24


def _pattern_rows(gaps: np.ndarray, j: int) -> np.ndarray:
    """The newest PATTERN_OPS gaps as whole rows of j, aligned on the newest."""
    tail = gaps[-PATTERN_OPS:]
    rows = tail.size // j
    return tail[tail.size - rows * j :].reshape(rows, j)


def _pattern_period(gaps: np.ndarray, most: int) -> int | None:
    """The ops per iteration (2..most) of a rank whose every op is the same
    (one all-reduce of one size: the symbols mark no boundary) when no gap
    is the iteration's longest (_splits): the smallest j whose gaps repeat as
    a pattern every j ops (Friedman's test at CONSISTENT_P over the newest
    PATTERN_OPS gaps) with a concordance of PATTERN_SHARE of the best j's. A
    Megatron-style TP job of 4 blocks issues 8 equal all-reduces a step,
    their gaps 2.4-4.7 ms by position, the optimizer's among them and no
    longer: W 0.16-0.17 at 8 ops, 0.2 at 16 and 24, 0.0-0.08 at 2-7. A job of
    one all-reduce a step (one DDP bucket) has gaps alike at every position,
    consistent at no j: None. Gaps in ns (>= 1 ns, as _splits)."""
    best, first = 0.0, []
    for j in range(2, most + 1):
        g = _pattern_rows(gaps, j)
        rows = g.shape[0]
        if rows < PATTERN_ROWS:
            break
        w, p = _concordance(g)
        # W of random gaps is 1/rows on average: fewer rows (a longer j) would
        # agree better by chance alone
        w = (w - 1.0 / rows) / (1.0 - 1.0 / rows)
        if p < CONSISTENT_P:
            # ... and the positions' typical gaps differ by SPLIT_RATIO, as a
            # boundary's must (_splits): equal gaps tie, and ties ranked by
            # position agree at every j
            med = row_medians(g.T)
            if float(med.max()) >= SPLIT_RATIO * max(float(med.min()), 1.0):
                first.append((j, w))
        best = max(best, w)
    return next((j for j, w in first if w >= PATTERN_SHARE * best), None)


def _shaped(gaps: np.ndarray, j: int) -> bool:
    """The gaps' pattern every j ops (_pattern_period's rows of the newest
    PATTERN_OPS gaps) holds beyond its longest gap: the other positions still
    rank alike in every repetition (Friedman's test at CONSISTENT_P). A
    tensor-parallel job's equal all-reduces are shaped throughout by the
    layers' forward and backward compute between them (15 a step: p 1e-8 to
    1e-38 without the optimizer's gap), while an interruption every j
    iterations of one all-reduce each (a checkpoint every 25 steps of a DDP
    job of one bucket) marks one position and leaves the rest at random
    (p 0.27), and kept iterations of one op must not give way to that cycle."""
    g = _pattern_rows(gaps, j)
    rest = np.argsort(row_medians(g.T))[:-1]
    return _concordance(g[:, rest])[1] < CONSISTENT_P


def _splits(gaps: np.ndarray, k: int, anchor: int, j: int) -> bool:
    """True if k ops are a fraction (1/j) of an iteration: over j*k ops,
    the j gaps at one position of the k are not alike (one is consistently
    the longest: the real boundary, with the forward pass, the optimizer
    step or a pipeline bubble in it). The position tested is the one
    holding the longest typical gap over the j*k ops (the anchor of a k that
    splits iterations may fall anywhere; the boundary is where that gap is)."""
    g = _gap_rows(gaps, j * k)
    if g is None:
        return False
    # (row_medians: np.median partitions each column, half of a kept period's test)
    med = row_medians(g.T).reshape(j, k)  # [which of the j, position]
    pos = int(np.argmax(med.max(axis=0)))  # where the longest typical gap is
    if med[:, pos].max() < SPLIT_RATIO * max(float(med[:, pos].min()), 1.0):
        return False
    cols = g[:, pos::k][:, :j]
    hi = int(np.argmax(med[:, pos]))
    wins = int(np.count_nonzero(np.argmax(cols, axis=1) == hi))
    # consistently: in most repetitions, not merely more often than chance (an
    # interruption every few iterations, a checkpoint every 25 with j = 5, wins
    # a fifth of the rows on its own and passes the binomial test alone)
    if 2 * wins <= cols.shape[0]:
        return False
    # the winner is the one of j with the longest median, chosen after the fact:
    # j chances at SPLIT_P (Bonferroni), or a window of a few repetitions of a
    # long j splits by chance (a TP job's 8-op step read as 104-160 ops over 1,000)
    return float(bdtrc(wins - 1, cols.shape[0], 1.0 / j)) < SPLIT_P / j  # binom.sf


def _splits_throughout(gaps: np.ndarray, k: int, anchor: int, j: int) -> bool:
    """_splits on the older and on the newer half of the gaps, each on its
    own (halves of whole j*k-op rows, so both stay aligned on the first gap)."""
    half = gaps.size // (2 * j * k) * j * k
    return half > 0 and _splits(gaps[:half], k, anchor, j) and _splits(gaps[half:], k, anchor, j)


@dataclass(frozen=True)
class Iterations:
    """anchors: indices into the rank's ops (issue order) of each iteration's
    first op; period: ops per iteration (of the ops kept, see
    iteration_anchors); signature: the (op, communicator, bytes) codes of one
    iteration from its anchor, as tuples (the rank's role in the job: ranks
    that issue the same sequence do the same work); comm: the communicator
    whose ops alone gave them (see _per_communicator), None: all the rank's
    ops interleaved."""

    anchors: np.ndarray
    period: int
    signature: tuple[tuple[int, int, int], ...]
    comm: int | None = None


def iteration_anchors(ops: RankOps, policy: PeriodPolicy | None = None) -> np.ndarray | None:
    """Indices into `ops` of the first op of each iteration, or None (see find_iterations)."""
    it = find_iterations(ops, policy)
    return None if it is None else it.anchors


def _one_communicator(ops: RankOps, c: int) -> tuple[np.ndarray, RankOps]:
    """The indices of communicator c's ops among the rank's, and those ops."""
    idx = np.flatnonzero(ops.comm == c)
    return idx, RankOps(
        ops.rank, ops.op[idx], ops.comm[idx], ops.nbytes[idx], ops.start_ns[idx], ops.end_ns[idx]
    )


def _per_communicator(ops: RankOps, p: PeriodPolicy) -> Iterations | None:
    """Iterations from one communicator's ops alone, busiest first: ops
    issued from several threads (a DP all-reduce thread beside the TP ops)
    interleave differently every iteration, while each communicator's own
    sequence still repeats."""
    comms, counts = np.unique(ops.comm, return_counts=True)
    if comms.size < 2:
        return None
    for c in comms[np.argsort(-counts, kind="stable")]:
        idx, sub = _one_communicator(ops, int(c))
        it = _find(sub, p, int(c), None, kept_only=False)
        if it is not None:
            return Iterations(idx[it.anchors], it.period, it.signature, int(c))
    return None


def find_iterations(
    ops: RankOps,
    policy: PeriodPolicy | None = None,
    keep_period: int | None = None,
    keep_comm: int | None = None,
    parts_if_alike: bool = False,
) -> Iterations | None:
    """The iterations of one rank from its ops in issue order, or None.

    parts_if_alike: the kept period may also give way to its parts (k/j, j
    <= KEPT_SPLIT) when they are alike throughout the window (see
    _find.alike_parts). The caller allows it only while the rank runs at
    its baseline: a fault can blur a real split for a whole window.

    keep_comm: the communicator keep_period was found on (Iterations.comm;
    None: all the rank's ops). The kept period is tested on that
    communicator's ops first; had it been tested on the interleaved ops (or
    on another communicator's), it would never fit, and the rank's period
    would flip between its interleaved and its per-communicator form (196
    and 49 ops on the agent bench's job), each flip a lost baseline. When it
    no longer fits there the search starts afresh.
    keep_period: a period the caller has already measured the rank under (the
    agent, once it has learned a baseline). While the ops still repeat
    every `keep_period` ops with gaps that repeat too, it stays the
    iteration, and only splits into up to KEPT_SPLIT parts that show in the
    older and the newer half of the window alike are still taken (a
    pipeline's micro-batches can take longer to prove than a baseline takes
    to learn; the whole they make is then kept; a cycle a fault brings is in
    the newer ops only). A checkpoint or an
    evaluation every N iterations makes N iterations repeat as a whole, and
    by timing alone that cycle cannot be told from an iteration made of N
    equal parts; taking it for the iteration once a baseline exists would
    throw the baseline away and flip between near-multiples of the period
    as the interruptions' timing varies.

    Greyhound's ACF finds a period in ops, but the symbols of real jobs
    often repeat within an iteration (DDP's equal-sized buckets, a pipeline
    stage's micro-batches, one all-reduce per parameter), so the smallest
    symbol period is not always the iteration. Here every lag k at which
    the symbol sequence repeats (x[t] == x[t+k] for at least acf_threshold
    of the ops) is a candidate, smallest first, and timing decides: the
    anchor of k ops is the position after the longest typical gap (where
    forward and backward compute sit), and k is the iteration unless some
    multiple j*k shows its j anchors are not alike (_splits). Rare symbols
    are left out first (RARE_RATIO), and the trailing periodic phase is
    used, so warm-up and one-off ops neither shift nor break the boundaries;
    the iterations before it are found from it, across interruptions such as
    an evaluation that issues collectives of its own (_anchors_across).
    """
    p = policy or PeriodPolicy()
    if keep_period == 1 and keep_comm is not None:
        # one op of one communicator is too little to keep: no gap within it
        # confirms a boundary, and the other communicators' ops fall between
        # (the agent bench's job gives one op a communicator in its first
        # seconds, before its 49-op whole can be proven); searched afresh
        keep_period = keep_comm = None
    if keep_period is not None and keep_comm is not None:
        idx, sub = _one_communicator(ops, keep_comm)
        it = _find(sub, p, keep_comm, keep_period, kept_only=True, parts=parts_if_alike) if idx.size else None
        if it is not None:
            return Iterations(idx[it.anchors], it.period, it.signature, keep_comm)
        keep_period = None
    return _find(ops, p, None, keep_period, kept_only=False, parts=parts_if_alike)


def _anchors_across(s: np.ndarray, dt: np.ndarray, first: int, k: int, reach: int) -> np.ndarray:
    """Anchors (positions in s, oldest first) of the iterations before `first`,
    the first anchor of the trailing periodic phase: stepping back k codes at
    a time while each block is one iteration (the same k codes as the one at
    `first`) and, where a block is not, the nearest earlier one that is and
    ends by the next anchor, within `reach` codes, after a gap as long as half
    the phase's anchor gap at least (dt: gaps before each code but the first).
    An evaluation every N steps that issues collectives of its own (an FSDP
    job's forward all-gathers) breaks the phase every N steps; the iterations
    before the newest one are still iterations, the interruption counted in
    the step it falls in, as the job's own step time counts it."""
    if first < k:
        return np.empty(0, dtype=np.intp)
    sig = s[first : first + k]
    phase_gaps = dt[first - 1 :: k][: (s.size - first) // k]
    boundary = 0.5 * float(np.median(phase_gaps)) if phase_gaps.size else 0.0
    cols = np.arange(k)

    def iterations(starts: np.ndarray) -> np.ndarray:
        """Which of these block starts begin one iteration."""
        same = (s[starts[:, None] + cols] == sig).all(axis=1)
        return same & ((starts == 0) | (dt[np.maximum(starts - 1, 0)] >= boundary))

    out: list[np.ndarray] = []
    nxt = first
    while nxt >= k:
        # the unbroken run of iterations just before nxt
        starts = np.arange(nxt % k, nxt, k)
        bad = np.flatnonzero(~iterations(starts))
        run = starts[bad[-1] + 1 :] if bad.size else starts
        out.append(run)
        nxt = int(run[0]) if run.size else nxt
        if nxt < k:
            break
        # an interruption: the nearest earlier iteration that ends by nxt
        near = np.arange(max(nxt - k - reach, 0), nxt - k)
        found = near[iterations(near)] if near.size else near
        if not found.size:
            break
        nxt = int(found[-1])
        out.append(found[-1:])
    return np.concatenate(out[::-1]) if out else np.empty(0, dtype=np.intp)


def _find(
    ops: RankOps,
    p: PeriodPolicy,
    comm: int | None,
    keep_period: int | None,
    kept_only: bool,
    parts: bool = False,
) -> Iterations | None:
    """find_iterations on `ops`, which are communicator `comm`'s alone when
    it is set (then no per-communicator fallback); kept_only: the kept
    period (or its whole) or None, no search afresh; parts: find_iterations'
    parts_if_alike."""
    n = len(ops)
    if n < 4:
        return None
    code = _op_codes(ops)
    counts = np.bincount(code)
    keep = np.flatnonzero(counts[code] + RARE_SLACK >= max(p.min_repeats, counts.max() / RARE_RATIO))
    keep = keep[-p.window_ops :]
    # int32 codes (there are fewer than ops): the lag comparisons below, run
    # for every lag a search tries, take half as long as on intp codes
    s, t = code[keep].astype(np.int32), ops.start_ns[keep]
    m = s.size
    # gaps between consecutive kept ops, once for every k tried (place)
    dt = np.diff(t).astype(np.float64)
    kmax = min(p.max_period, m // p.min_repeats)
    repeats: dict[int, bool] = {}

    # the recent half decides which lags repeat: an older phase (warm-up, a
    # period before a phase change) would only let a common multiple pass
    recent = s[m // 2 :] if m // 2 >= 2 * p.min_repeats else s

    def is_candidate(k: int) -> bool:
        if k not in repeats:
            r = recent if recent.size > p.min_repeats * k else s
            repeats[k] = bool(np.count_nonzero(r[:-k] == r[k:]) >= p.acf_threshold * (r.size - k))
        return repeats[k]

    def place(k: int) -> tuple[int, int, np.ndarray] | Literal[False] | None:
        """(phase start, anchor position, gaps) for k ops per iteration; None
        if the gaps do not repeat every k ops; False if too few ops to tell."""
        start = _phase_start(s, k, tolerance=max(1, m // (50 * k)))
        gaps = np.concatenate([[0.0], dt[start:]])  # the same as np.diff(t[start:], prepend=t[start])
        g = _gap_rows(gaps, k)
        if g is None:
            return False
        if not _consistent(g):
            return None  # the gaps do not repeat every k ops: not an iteration length
        return start, int(np.argmax(row_medians(g.T))), gaps

    def accept(
        k: int, max_split: int = MAX_SPLIT, throughout: bool = False
    ) -> tuple[int, int] | int | Literal[False] | None:
        """(k, first anchor) if k ops are one iteration; None if the gaps do
        not repeat every k ops; j*k (an int, j <= max_split) if k is a
        fraction of an iteration that repeats every j*k ops; False if there
        are too few ops to tell for k or any longer period.
        throughout: the split must also show in the older and the newer half
        of the ops each on its own (see kept)."""
        got = place(k)
        if got is None or got is False:
            return got
        start, anchor, gaps = got
        split: int | None = None
        for j in range(2, max_split + 1):
            if j * k <= kmax and is_candidate(j * k) and _splits(gaps, k, anchor, j):
                if throughout and not _splits_throughout(gaps, k, anchor, j):
                    continue
                split = j * k
                break
        # a kept one-op iteration may give way to a pattern of any length (a
        # first look of 64 ops of a TP job of 15 all-reduces a step could
        # prove none of it), once shaped by more than its longest gap
        most = kmax if throughout and k == 1 else k * max_split
        whole = pattern(gaps, most, throughout)
        if whole is not None and whole > k and whole % k == 0 and (split is None or whole % split == 0):
            # one op repeated, the symbols mark no boundary: the gaps' pattern
            # is the iteration where it holds k and the split found (a TP job's
            # 8 all-reduces: their longest gap every 4 ops, a half-step)
            return whole
        return (k, start + anchor) if split is None else split

    def pattern(gaps: np.ndarray, most: int, throughout: bool = False) -> int | None:
        """_pattern_period of the gaps when the ops are one op repeated (None
        otherwise), at most `most` ops; throughout: the same in both halves of
        the window too, as a kept period's splits must show."""
        if not is_candidate(1):
            return None
        most = min(most, kmax)
        whole = _pattern_period(gaps, most)
        if whole is not None and throughout:
            half = gaps.size // 2
            if _pattern_period(gaps[:half], most) != whole or _pattern_period(gaps[half:], most) != whole:
                return None
            if whole > KEPT_SPLIT and not _shaped(gaps, whole):
                return None
        return whole

    def kept() -> tuple[int, int] | None:
        """The caller's period while the ops still fit it, or the whole of a
        few parts of it, once the split shows throughout the window: in its
        older half as well as its newer one. A structure of the job (a
        pipeline stage's micro-batches) is there all along; a cycle of
        iterations that a fault brings (a CPU cap's throttling locks the
        steps into a pattern repeating every few of them) is only in the
        ops since the fault, and taking it would throw away the baseline the
        fault is to be measured against. The whole is not split again in
        the same call: a split of a split is a new period first, and its own
        split is tested under it (when the caller keeps it)."""
        k = keep_period
        if k is None or not 1 <= k <= kmax or not is_candidate(k):
            return None
        got = accept(k, KEPT_SPLIT, throughout=True)
        if isinstance(got, tuple):
            return (alike_parts(k) if parts else None) or got
        if got is None or got is False:
            return None
        whole = accept(got, 1)  # a few parts of one iteration: their whole
        return whole if isinstance(whole, tuple) else None

    def alike_parts(k: int) -> tuple[int, int] | None:
        """The iteration, when the kept period k is j (<= KEPT_SPLIT) of them
        that are alike throughout the window: no split of its parts shows in
        the older half nor in the newer one. A pattern of the job's first
        seconds (a GPipe stage whose steps alternated in its warm-up, a
        boundary gap of 2.6 ms, then 1.4 ms) can prove a whole of two steps,
        which fits for good once kept: every iteration counted twice for the
        rest of the run. The smallest part first."""
        for j in range(KEPT_SPLIT, 1, -1):
            if k % j or not is_candidate(k // j):
                continue
            d = k // j
            got = accept(d, j)
            placed = place(d)
            if not isinstance(got, tuple) or not placed:
                continue
            _, anchor, gaps = placed
            whole = pattern(gaps, k)
            if whole is not None and whole > d and whole % d == 0:
                continue  # the parts of one op repeated differ in the pattern of their gaps
            half = gaps.size // (2 * j * d) * j * d
            if half and not _splits(gaps[:half], d, anchor, j) and not _splits(gaps[half:], d, anchor, j):
                return got
        return None

    def smallest_first() -> tuple[int, int] | None:
        # A k found to be a fraction of an iteration that repeats every u ops
        # makes u a unit: the iteration is a multiple of it, so lags that are
        # not (a 6 beside a pipeline stage's 8 ops: consistent at the
        # micro-batch level, never a boundary) are not taken when too few ops
        # exist yet to prove them wrong directly.
        unit = 1
        for k in range(1, kmax + 1):
            if k % unit or not is_candidate(k):
                continue
            got = accept(k)
            if got is False:
                return None
            if isinstance(got, tuple):
                return got
            if isinstance(got, int):
                unit = unit * got // math.gcd(unit, got)
        return None

    chosen = kept() if kept_only else kept() or smallest_first()
    if chosen is None:
        return _per_communicator(ops, p) if comm is None and not kept_only else None
    k, first = chosen
    one = keep[first : first + k]
    earlier = (
        np.empty(0, dtype=np.intp) if is_candidate(1) else _anchors_across(s, dt, first, k, p.max_period)
    )
    anchors = np.concatenate([keep[earlier], keep[first::k]])
    sig = tuple((int(ops.op[i]), int(ops.comm[i]), int(ops.nbytes[i])) for i in one)
    return Iterations(anchors, k, sig, comm)
