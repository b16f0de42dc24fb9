"""detect.waiting: the time a rank may have waited inside its collectives."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmguard.detect.waiting import gap_waits, waiting_time


def _union(start: np.ndarray, end: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Reference: the union of the ops' intervals per iteration, cut at its end."""
    out = np.zeros(bounds.size - 1, dtype=np.int64)
    for i in range(bounds.size - 1):
        lo, hi = bounds[i], bounds[i + 1]
        covered = np.zeros(hi - lo, dtype=bool)
        for s, e in zip(start, end):
            if lo <= s < hi:
                covered[s - lo : min(e, hi) - lo] = True
        out[i] = covered.sum()
    return out


def test_ddp_buckets_in_flight_during_backward_are_compute():
    """Two buckets' all-reduces issued during the backward pass (at 10 and 50)
    and completed at its end (90, 95): the rank computed until it issued the
    second and waited only from then to the last completion before its next
    iteration (at 100). The union of the in-flight intervals would call 85 of
    the 100 ns waiting."""
    start, end, bounds = np.array([10, 50, 110]), np.array([90, 95, 190]), np.array([10, 110, 210])
    assert waiting_time(start, end, bounds).tolist() == [45, 80]
    assert _union(start, end, bounds).tolist() == [85, 80]


def test_a_late_peer_shows_as_waiting_and_the_late_rank_as_compute():
    """One DP step seen from both ranks: the healthy rank issues its buckets at
    0, 20, 40 and they complete only when the late rank issues its own (at 30,
    60, 90; each completes 2 ns later on both). The late rank may have waited
    8 ns (2 after each call), the healthy one 64: 12 up to the first
    completion before its third call and 52 from that call to 92."""
    bounds = np.array([0, 100])
    healthy = waiting_time(np.array([0, 20, 40]), np.array([32, 62, 92]), bounds)
    late = waiting_time(np.array([0, 30, 60, 90]), np.array([2, 32, 62, 92]), bounds)
    assert healthy.tolist() == [64] and late.tolist() == [8]


def test_untimed_and_in_flight_ops_end_nothing():
    """An op still in flight (end 0) or with an end before its start is not a
    completion: the gaps around it are compute."""
    bounds = np.array([0, 100])
    assert waiting_time(np.array([0, 50]), np.array([0, 40]), bounds).tolist() == [0]


def test_gap_waits_stop_at_the_last_completion_inside_the_gap():
    calls = np.array([0, 10, 30])
    assert gap_waits(calls, np.array([5, 25, 28])).tolist() == [5, 18]
    assert gap_waits(np.array([7]), np.array([9])).tolist() == []


_ops = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 60)), min_size=1, max_size=30)


@settings(max_examples=300, deadline=None)
@given(_ops, st.lists(st.integers(1, 150), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_waiting_is_within_the_iteration_order_free_and_the_union_for_serial_ops(ops, steps, rnd):
    start = np.array([s for s, _ in ops], dtype=np.int64)
    end = start + np.array([d for _, d in ops], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)
    w = waiting_time(start, end, bounds)
    assert w.shape == (bounds.size - 1,)
    assert (w >= 0).all() and (w <= np.diff(bounds)).all()
    # never more than the union of the in-flight intervals (a lower bound of compute)
    assert (w <= _union(start, end, bounds) + _tail(start, end, bounds)).all()
    perm = np.array(rnd.sample(range(start.size), start.size))
    assert waiting_time(start[perm], end[perm], bounds).tolist() == w.tolist()
    # serial calls (each ends before the next starts, as one blocking call at a
    # time or kernels on one stream): exactly the union
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    it = np.searchsorted(bounds, s, side="right") - 1
    own_end = bounds[np.clip(it + 1, 0, bounds.size - 1)]
    if (e[:-1] <= s[1:]).all() and (e <= own_end).all():
        assert w.tolist() == _union(s, e, bounds).tolist()


def _tail(start: np.ndarray, end: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Waits of ops started before an iteration that end inside it: the union
    counts them in the iteration they started in, the gap rule in the one
    their completion falls in."""
    out = np.zeros(bounds.size - 1, dtype=np.int64)
    for i in range(bounds.size - 1):
        lo, hi = bounds[i], bounds[i + 1]
        out[i] = sum(min(e, hi) - lo for s, e in zip(start, end) if s < lo < e)
    return out


@settings(max_examples=300, deadline=None)
@given(_ops, st.lists(st.integers(0, 150), min_size=1, max_size=5))
def test_an_iteration_waits_what_the_gaps_starting_in_it_wait(ops, steps):
    """waiting_time adds up gap_waits over the gaps that start in each iteration
    [bounds[i], bounds[i+1]) (a repeated bound: an empty iteration), calls in any order."""
    start = np.array([s for s, _ in ops], dtype=np.int64)[::-1]
    end = start + np.array([d for _, d in ops], dtype=np.int64)[::-1]
    bounds = np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)
    calls = np.unique(np.concatenate([start, bounds]))
    waits = gap_waits(calls, end[end > start])
    gap_start = calls[:-1]
    want = [int(waits[(gap_start >= lo) & (gap_start < hi)].sum()) for lo, hi in zip(bounds[:-1], bounds[1:])]
    got = waiting_time(start, end, bounds)
    assert got.dtype == np.int64 and got.tolist() == want
