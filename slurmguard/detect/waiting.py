"""How long a rank may have waited inside its collectives, and so how long it computed.

A rank's collective calls are evidence of its own progress: it issues a
call only when its compute has reached it. Between two consecutive calls
the rank may have been blocked on an earlier collective only up to the last
completion (of any call) before the later call; after that completion there
was nothing left to wait for, so it was computing. Each gap between calls
therefore splits into a part the rank may have waited (up to that last
completion) and a part it must have computed.

This is a bound, and the right one for asynchronous collectives: a DDP rank
issues its gradient buckets' all-reduces during its backward pass and keeps
computing while they are in flight. Counting every in-flight interval as
waiting (their union) hides that backward pass, and with it most of the
extra compute of a throttled rank: on the development cluster a DDP rank
under a 1.25x CPU cap computed 2.4 ms more per 42 ms step by the union and
5.2 ms more by this rule, while its healthy peer's estimate stayed within
0.6 ms under both. For synchronous collectives (one blocking call at a
time, or GPU kernels serialised on one communication stream) both rules
give the same time.

Used by the node agent (per-iteration compute, agent.analysis) and the
what-if analysis of rings (whatif.rings), so both read a rank's waits alike.
"""

from __future__ import annotations

import numpy as np


def completions(start_ns: np.ndarray, end_ns: np.ndarray) -> np.ndarray:
    """The end times (ns) that can have ended a wait: those of ops that ended
    after they started. An op still in flight (no end yet) or one recorded
    ending where, or before, it started made no one wait."""
    start = np.asarray(start_ns, dtype=np.int64)
    end = np.asarray(end_ns, dtype=np.int64)
    return end[end > start]


def gap_waits(calls_ns: np.ndarray, ends_ns: np.ndarray) -> np.ndarray:
    """Per gap between consecutive calls (calls_ns ascending, n calls, n - 1
    gaps), ns the rank may have been waiting in it: from the gap's start up
    to the last completion (any value of ends_ns, in any order) at or before
    the gap's end, 0 when none falls inside the gap."""
    calls = np.asarray(calls_ns, dtype=np.int64)
    if calls.size < 2:
        return np.zeros(0, dtype=np.int64)
    # stable: timsort, fastest on the nearly sorted ends of a ring
    ends = np.sort(np.asarray(ends_ns, dtype=np.int64), kind="stable")
    if ends.size == 0:
        return np.zeros(calls.size - 1, dtype=np.int64)
    lo, hi = calls[:-1], calls[1:]
    k = np.searchsorted(ends, hi, side="right") - 1
    last = np.where(k >= 0, ends[np.clip(k, 0, None)], lo)
    return np.clip(last - lo, 0, hi - lo)


def waiting_time(start_ns: np.ndarray, end_ns: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per iteration [bounds[i], bounds[i+1]) (ns, ascending; each bound is a
    call's start), ns the rank may have been waiting inside collectives
    (gap_waits summed over the gaps that start in the iteration; the last
    gap ends at the next iteration's first call). Calls in any order (a hook
    that writes records in completion order); only `completions` end a wait."""
    b = np.asarray(bounds, dtype=np.int64)
    n = b.size - 1
    if n <= 0:
        return np.zeros(max(n, 0), dtype=np.int64)
    calls = _sorted_unique(np.concatenate([np.asarray(start_ns, dtype=np.int64), b]))
    waits = gap_waits(calls, completions(start_ns, end_ns))
    # each bound is one of the calls: an iteration's gaps run from its bound's
    # call to the next bound's, a difference of running sums (in int64: exact)
    total = np.concatenate([np.zeros(1, np.int64), np.cumsum(waits)])
    return np.diff(total[np.searchsorted(calls, b)])


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique(a) of a 1-D int64 array, by a stable sort (timsort: the calls
    of a ring come nearly sorted); np.unique hashes the values first, which
    took the node agent 16 times as long for a rank's 16,384 calls (issue 17.5)."""
    s = np.sort(a, kind="stable")
    if s.size < 2:
        return s
    return s[np.concatenate([[True], s[1:] != s[:-1]])]
