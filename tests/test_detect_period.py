"""ACF period and iteration times (Greyhound 4.2) on constructed sequences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slurmguard.config import PeriodPolicy
from slurmguard.detect.period import acf, find_period, rank_period, step_times
from slurmguard.detect.records import RankOps
from slurmguard_dev.bench.detect_synth import JobSpec, make_job


def test_acf_is_one_at_the_period_of_a_periodic_symbol_sequence():
    seq = np.tile([3, 1, 1, 2, 0], 40)
    a = acf(seq, 12)
    assert a[5] == pytest.approx(1.0) and a[10] == pytest.approx(1.0)
    assert a[1:5].max() < 0.95


def test_period_of_interleaved_communicators():
    # per iteration: TP allgather/reducescatter on comm 7 interleaved with DP allreduces on comm 9
    it = [(1, 7), (0, 9), (2, 7), (1, 7), (0, 9), (2, 7), (0, 9)]
    sym = np.array([op * 100 + c for op, c in it] * 30)
    period, start, val = find_period(sym)
    assert period == 7 and start == 0 and val == pytest.approx(1.0)


def test_long_runs_of_one_op_do_not_fool_the_period():
    # 100 gradient buckets then one allgather: integer codes would give lag 1 an
    # ACF of ~0.98; one-hot coding scores it near 0 and the true period 1.0
    seq = np.tile([0] * 100 + [1], 12)
    assert acf(seq, 2)[1] < 0.5
    assert find_period(seq, PeriodPolicy(max_period=200))[0] == 101


def test_warmup_is_skipped_and_iteration_time_within_1_percent():
    tr = make_job(JobSpec(iterations=80, warmup_ops=25, step_s=0.8, jitter=0.02, seed=3))
    st = step_times(tr.ops[2])
    assert st.period.period == 7
    truth = tr.iteration_s[1:].mean()
    assert abs(st.mean - truth) / truth < 0.01
    assert st.seconds.size >= 70


def test_phase_change_picks_up_the_new_period():
    tr = make_job(JobSpec(iterations=120, phase2_at=60, seed=4))
    st = step_times(tr.ops[0])
    assert st.period.period == 9  # 6 TP ops + 3 DP buckets after the change
    truth = tr.iteration_s[61:].mean()
    assert abs(st.mean - truth) / truth < 0.01


def test_unordered_interleaving_falls_back_to_one_communicator():
    rng = np.random.default_rng(5)
    rows = []
    t = 0
    for _ in range(60):
        # TP ops keep their order; the DP allreduces come from another thread
        # and land at varying positions between them
        ops = [(1, 7), (2, 7), (1, 7), (2, 7)]
        for _ in range(3):
            ops.insert(int(rng.integers(0, len(ops) + 1)), (0, 9))
        for op, comm in ops:
            rows.append((op, comm, 1024, t, t + 1000))
            t += 10_000_000
        t += 500_000_000
    ro = RankOps.from_rows(0, rows)
    pr = rank_period(ro)
    assert pr is not None and pr.comm in (7, 9)
    st = step_times(ro, period=pr)
    assert st.mean == pytest.approx(0.57, rel=0.02)


def test_no_period_in_random_ops():
    rng = np.random.default_rng(6)
    ro = RankOps.from_rows(
        0, [(int(rng.integers(0, 5)), int(rng.integers(0, 3)), 1, i, i + 1) for i in range(400)]
    )
    assert rank_period(ro) is None


def test_rank_ops_rejects_ragged_columns():
    from slurmguard.errors import InputError

    with pytest.raises(InputError, match="rank 3: column comm has 2 rows"):
        RankOps(3, np.zeros(3), np.zeros(2), np.zeros(3), np.zeros(3), np.zeros(3))


def _recorded(name: str) -> RankOps:
    from pathlib import Path

    z = np.load(Path(__file__).parent / "data" / "period" / name)
    return RankOps(0, z["op"], z["comm"], z["nbytes"], z["start_ns"], z["end_ns"])


def test_a_checkpoint_every_25_iterations_is_not_a_new_iteration_once_a_period_is_kept():
    """Rank 0 of the demo's 2-node DDP job (torch hook, gloo; 13 collectives an
    iteration, a checkpoint every 25 iterations), recorded on the dev cluster.
    With enough history the checkpoint cycle repeats as a whole and, by timing
    alone, looks like an iteration of 25 parts (325 ops). Kept at 13 (what
    the agent does once it has a baseline), the iteration stays 13 ops at
    every point of the run and the step count follows the job."""
    from slurmguard.detect.period import find_iterations

    ops = _recorded("ddp_ckpt25_rank0.npz")
    ends = ops.start_ns / 1e9
    free, kept = set(), set()
    for t in range(10, int(ends[-1]), 5):
        n = int(np.searchsorted(ends, t))
        part = RankOps(0, ops.op[:n], ops.comm[:n], ops.nbytes[:n], ops.start_ns[:n], ops.end_ns[:n])
        free.add(find_iterations(part).period)
        it = find_iterations(part, keep_period=13)
        kept.add(it.period)
    assert 13 in free and any(p % 325 == 0 for p in free), free  # the premise: it flips
    assert kept == {13}
    steps = np.diff(ops.start_ns[it.anchors]) / 1e9
    assert 0.05 < np.median(steps) < 0.5


def test_a_whole_of_two_steps_kept_from_the_start_gives_way_to_the_step():
    """Stage 1 of a hand-written 2-stage GPipe job (blocking send/recv, 4
    micro-batches: 8 collectives a step of about 16 ms), recorded on the dev
    cluster. In its first 4 s its steps alternated (one boundary gap 2.6 ms,
    the next 1.4 ms), which proves a whole of two steps (16 ops); kept, that
    whole fitted for the rest of the run, so its agent counted every iteration
    twice (33 ms against its peer's 17 ms). Once the parts are alike in both
    halves of the window, the kept whole gives way to the step, where the
    caller allows it (no slowdown open); where it does not, the whole stays."""
    from slurmguard.detect.period import find_iterations

    ops = _recorded("gpipe_stage1_rank1.npz")
    secs = ops.start_ns / 1e9

    def upto(t: float) -> RankOps:
        n = int(np.searchsorted(secs, t))
        return RankOps(1, ops.op[:n], ops.comm[:n], ops.nbytes[:n], ops.start_ns[:n], ops.end_ns[:n])

    whole = find_iterations(upto(4.0))
    assert whole.period == 16  # the premise: the start proves two steps
    two = float(np.median(np.diff(ops.start_ns[whole.anchors]))) / 1e6
    for t in (6.0, 10.0, 20.0):
        assert find_iterations(upto(t), keep_period=16).period == 16, t
        it = find_iterations(upto(t), keep_period=16, parts_if_alike=True)
        assert it.period == 8, t
        step = float(np.median(np.diff(ops.start_ns[it.anchors][-100:]))) / 1e6
        assert 12.0 < step < 0.7 * two, (step, two)  # one step, about 16 ms as the job timed it


def test_a_kept_whole_whose_split_shows_is_kept_when_parts_are_allowed():
    """A pipeline stage's real iteration (two identical micro-batches, the
    optimizer step after the second) stays whole with parts_if_alike: its
    split shows in both halves of the window."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(3)
    starts, t = [], 0.0
    for _ in range(400):
        for _mb in range(2):
            for gap in (4e-3, 1e-3):  # forward then send, backward then send
                t += gap * rng.uniform(0.9, 1.1)
                starts.append(t)
        t += 6e-3 * rng.uniform(0.9, 1.1)  # the optimizer step at the boundary
    n = len(starts)
    start_ns = (np.array(starts) * 1e9).astype(np.int64)
    ro = RankOps(0, np.tile([7, 8], n // 2), np.zeros(n, np.int64), np.full(n, 64), start_ns, start_ns + 1000)
    assert find_iterations(ro).period == 4
    assert find_iterations(ro, keep_period=4, parts_if_alike=True).period == 4


def test_a_kept_period_still_finds_the_micro_batches_it_is_made_of():
    """A period kept by the agent before its split could be proven (a pipeline
    stage: two identical micro-batches, the optimizer step after the second)
    still gives way to the whole iteration once the timing proves it."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(3)
    per_micro = [(7, 0, 64), (8, 0, 64)]  # send, recv
    n_iter = 120
    ops, t = [], 0
    for _ in range(n_iter):
        for m in range(2):
            for op, comm, nb in per_micro:
                gap = 0.004 + rng.normal(0, 0.0003)
                if m == 0 and op == 7:
                    gap += 0.03  # forward + optimizer before the first
                t += int(gap * 1e9)
                ops.append((op, comm, nb, t, t + 1000))
    a = np.array(ops, dtype=np.int64)
    ro = RankOps(0, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])
    assert find_iterations(ro).period == 4
    assert find_iterations(ro, keep_period=2).period == 4


@pytest.mark.parametrize("limit", [1 << 62, 7])
def test_op_codes_number_triples_as_unique_over_rows_does(monkeypatch, limit):
    """_op_codes (column by column, for speed) gives the codes np.unique over
    (op, comm, bytes) rows gives, also when the combined key must be
    renumbered on the way (forced here by a small limit), and when columns
    hold one value (one communicator's ops: skipped)."""
    from slurmguard.detect import period

    monkeypatch.setattr(period, "_KEY_LIMIT", limit)
    rng = np.random.default_rng(5)
    for n, const in itertools.product((0, 1, 2, 50, 997), range(8)):
        # const: bit i set = column i holds one value
        cols = [
            np.full(n, int(rng.integers(-(1 << 60), 1 << 60)))
            if const >> i & 1
            else rng.integers(-3, 4, n) * int(rng.integers(1, 1 << 60))
            for i in range(3)
        ]
        ops = RankOps(0, cols[0], cols[1], cols[2], np.zeros(n, np.int64), np.zeros(n, np.int64))
        want = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)[1].ravel()
        assert np.array_equal(period._op_codes(ops), want)


def test_friedman_ranks_are_argsort_of_argsort():
    """_consistent ranks each repetition's gaps by inverting one sort (for
    speed); the decision equals the textbook double argsort's, ties included."""
    from slurmguard.detect import period

    def reference(g):
        n, k = g.shape
        ranks = np.argsort(np.argsort(g, axis=1), axis=1) + 1.0
        r = ranks.sum(axis=0)
        q = 12.0 / (n * k * (k + 1)) * float(np.dot(r, r)) - 3.0 * n * (k + 1)
        return float(period.chdtrc(k - 1, q)) < period.CONSISTENT_P

    rng = np.random.default_rng(1)
    seen = set()
    for trial in range(600):
        n, k = int(rng.integers(1, 70)), int(rng.integers(2, 200))
        if trial % 3 == 0:
            g = rng.integers(0, 3, (n, k)).astype(float)  # many ties
        else:
            g = rng.random((n, k)) + (np.arange(k) % 5 == 0) * (trial % 2)  # a long gap every 5
        assert period._consistent(g) == reference(g)
        seen.add(reference(g))
    assert seen == {True, False}


def _cycled_ops(n_iter: int, cycle_from: int, rng) -> RankOps:
    """A DDP-like rank: 10 all-reduces an iteration after a 30 ms forward pass;
    from iteration `cycle_from` on, every fifth iteration waits 25 ms longer
    at its start (what a CPU cap's throttling does once it locks the steps
    into its period)."""
    ops, t = [], 0
    for i in range(n_iter):
        for b in range(10):
            gap = 0.004 + rng.normal(0, 0.0003)
            if b == 0:
                gap += 0.03 + (0.025 if i >= cycle_from and i % 5 == 0 else 0.0)
            t += int(gap * 1e9)
            ops.append((1, 0, 1 << 20, t, t + 1000))
    a = np.array(ops, dtype=np.int64)
    return RankOps(0, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


def test_a_cycle_that_only_the_newest_ops_show_does_not_replace_a_kept_period():
    """A cycle of iterations that appears with a fault (here every fifth
    iteration slower, over the newest 160 of 300) repeats as a whole and, by
    timing alone, looks like one iteration of five parts. Found afresh it is
    taken; kept at 10 (the agent's baseline period) it is not, as it is not
    in the older half of the window: the baseline the fault is measured
    against stays. Once the cycle fills both halves it is proven and taken,
    and its whole is not split again in the same call."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(5)
    ro = _cycled_ops(300, 140, rng)
    assert find_iterations(ro).period == 50  # the premise: the cycle is there
    assert find_iterations(ro, keep_period=10).period == 10
    everywhere = _cycled_ops(300, 0, rng)
    assert find_iterations(everywhere, keep_period=10).period == 50


def _rotating_ops(n_iter: int, rng) -> RankOps:
    """An iteration of a 0.3 s forward pass, then 98 reduce-scatter/all-gather
    pairs and 4 all-reduces issued on 4 communicators in turn (the agent
    bench's job): each communicator's own ops repeat every 50, the rank's
    interleaved ops every 200."""
    ops, t = [], 0
    for _ in range(n_iter):
        t += int(0.3e9)
        for i in range(200):
            op = 4 if i >= 196 else (3 if i % 2 == 0 else 2)
            t += int((0.0035 + rng.normal(0, 0.0002)) * 1e9)
            ops.append((op, i % 4, 1 << 23, t, t + 1000))
    a = np.array(ops, dtype=np.int64)
    return RankOps(0, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


def test_a_period_kept_on_one_communicator_is_tested_on_that_communicator():
    """A period found on one communicator's ops (Iterations.comm) stays while
    that communicator's ops fit it, also once the interleaved ops show their
    own (longer) period: testing it on the interleaved ops made the agent's
    period flip between the two, every flip a lost baseline."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(7)
    ro = _rotating_ops(70, rng)
    free = find_iterations(ro)
    assert free.comm is None and free.period in (196, 200)  # the premise
    n = int(np.searchsorted(ro.start_ns, ro.start_ns[0] + int(30.5e9)))  # the first 30 iterations
    early = RankOps(0, ro.op[:n], ro.comm[:n], ro.nbytes[:n], ro.start_ns[:n], ro.end_ns[:n])
    first = find_iterations(early)
    assert first.comm is not None and first.period == 49  # the interleaved period not proven yet
    kept = find_iterations(ro, keep_period=first.period, keep_comm=first.comm)
    assert (kept.period, kept.comm) == (first.period, first.comm)
    steps = np.diff(ro.start_ns[kept.anchors]) / 1e9
    assert np.median(steps) == pytest.approx(1.0, rel=0.05)  # one iteration, not one op
    # one op of one communicator, found in the first seconds, is not kept: the
    # whole it is part of is taken once proven
    n3 = int(np.searchsorted(ro.start_ns, ro.start_ns[0] + int(3.5e9)))
    tiny = find_iterations(
        RankOps(0, ro.op[:n3], ro.comm[:n3], ro.nbytes[:n3], ro.start_ns[:n3], ro.end_ns[:n3])
    )
    assert tiny.period == 1 and tiny.comm is not None  # the premise
    assert find_iterations(early, keep_period=1, keep_comm=tiny.comm).period == 49
    # the ops of the kept communicator gone (the job changed): found afresh
    other = ro.comm != first.comm
    rest = RankOps(0, ro.op[other], ro.comm[other], ro.nbytes[other], ro.start_ns[other], ro.end_ns[other])
    assert find_iterations(rest, keep_period=first.period, keep_comm=first.comm).comm != first.comm


#: a Megatron-style TP rank's gaps before each of its 8 equal all-reduces a step
#: (ms, medians by position as recorded from a hand-written job of 4 column/row
#: parallel blocks on the dev cluster: forward, loss, backward, optimizer)
_TP_GAPS_MS = (3.66, 3.84, 4.66, 2.85, 2.52, 2.41, 4.22, 3.96)


def _equal_ops(n_iter: int, gaps_ms, rng, pattern_from: int = 0) -> RankOps:
    """A rank issuing one all-reduce of one size over and over; its gaps follow
    `gaps_ms` by position from iteration `pattern_from` on (the same mean
    gap before), with a scatter of 1.5 ms (as recorded), so no position is the longest in
    most iterations."""
    ops, t, k = [], 0, len(gaps_ms)
    flat = float(np.mean(gaps_ms))
    for i in range(n_iter):
        for b in range(k):
            t += int(max(0.2, (gaps_ms[b] if i >= pattern_from else flat) + rng.normal(0, 1.5)) * 1e6)
            ops.append((1, 0, 32 * 256 * 4, t, t + 900_000))
    a = np.array(ops, dtype=np.int64)
    return RankOps(0, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


def test_equal_all_reduces_make_an_iteration_by_the_pattern_of_their_gaps():
    """Every op the same and no gap the boundary: the iteration is where the
    gaps' pattern repeats (8 ops, one step of 28 ms), not one all-reduce, as the
    agent took it (8,192 "iterations" of 4 ms for 1,024 steps of 34 ms, and its
    compute the gap before one all-reduce). The same rank with gaps alike at
    every position (one all-reduce a step) keeps its one-op iteration."""
    from slurmguard.detect.period import _splits, find_iterations

    rng = np.random.default_rng(3)
    ro = _equal_ops(400, _TP_GAPS_MS, rng)
    gaps = np.diff(ro.start_ns, prepend=ro.start_ns[0]).astype(float)
    assert not any(_splits(gaps, 1, 0, j) for j in range(2, 17))  # the premise: no long gap
    it = find_iterations(ro)
    assert it is not None and it.period == 8
    step = np.diff(ro.start_ns[it.anchors]) / 1e6
    assert abs(float(np.median(step)) - sum(_TP_GAPS_MS)) < 0.05 * sum(_TP_GAPS_MS)
    flat = _equal_ops(400, (3.5,) * 8, rng)
    assert find_iterations(flat).period == 1


def test_a_pattern_of_gaps_the_newest_ops_show_does_not_replace_a_kept_one_op_iteration():
    """Kept at one op (the agent's baseline period), a pattern of gaps that only
    the newer half of the window shows (what a fault can bring) is not taken;
    one that shows throughout is, and its whole is the iteration."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(4)
    late = _equal_ops(800, _TP_GAPS_MS, rng, pattern_from=500)
    assert find_iterations(late).period == 8  # the premise: the pattern is there
    assert find_iterations(late, keep_period=1).period == 1
    throughout = _equal_ops(800, _TP_GAPS_MS, rng)
    assert find_iterations(throughout, keep_period=1).period == 8


def test_an_evaluation_with_collectives_of_its_own_does_not_end_the_iterations():
    """Iterations of 3 ops (10 ms of compute before each, 1 ms between its
    ops, with 5% and 10% jitter), and now and then (no cycle of whole iterations: their spacing
    varies, as epochs of a shuffled dataset end) an evaluation of 7 ops of the
    iteration's kinds: the sequence breaks there, and the trailing phase
    holds only the iterations since the newest evaluation. Those before it
    are iterations too: every iteration is found, each at its own first op."""
    from slurmguard.detect.period import find_iterations

    rng = np.random.default_rng(3)
    rows, t, starts = [], 0, []
    for i in range(300):
        if i in (40, 111, 170, 243):
            for op in (2, 1, 2, 1, 2, 2, 1):  # the evaluation: forward all-gathers and a loss
                t += 2_000_000
                rows.append((op, 7, 4096, t, t + 100_000))
        t += int(rng.normal(10e6, 0.5e6))
        starts.append(len(rows))
        for op in (1, 1, 2):
            rows.append((op, 7, 4096, t, t + 100_000))
            t += int(rng.normal(1e6, 0.1e6))
    ro = RankOps.from_rows(0, rows)
    it = find_iterations(ro, PeriodPolicy())
    assert it is not None and it.period == 3
    assert it.anchors.tolist() == starts


def test_a_checkpoint_every_25_steps_of_one_op_does_not_replace_a_kept_one_op_iteration():
    """One all-reduce a step (a DDP job of one bucket, 30 ms steps) and a
    checkpoint every 25 steps: found afresh the cycle is the iteration (its
    long gap ends 25 ops); kept at one op it stays, as an interruption marks
    one position of the cycle and leaves the others' gaps at random (what a
    TP job's pattern longer than KEPT_SPLIT must not, _shaped)."""
    from slurmguard.detect.period import find_iterations

    ro = _equal_ops(80, (230.0,) + (30.0,) * 24, np.random.default_rng(11))
    assert find_iterations(ro).period == 25  # the premise: the cycle is there
    assert find_iterations(ro, keep_period=1).period == 1
