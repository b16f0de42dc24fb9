"""ACF period and iteration times (Greyhound 4.2) on constructed sequences."""

from __future__ import annotations

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
    assert st.period.period == 9           # 6 TP ops + 3 DP buckets after the change
    truth = tr.iteration_s[61:].mean()
    assert abs(st.mean - truth) / truth < 0.01


def test_unordered_interleaving_falls_back_to_one_communicator():
    rng = np.random.default_rng(5)
    rows = []
    t = 0
    for i in range(60):
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
    ro = RankOps.from_rows(0, [(int(rng.integers(0, 5)), int(rng.integers(0, 3)), 1, i, i + 1)
                               for i in range(400)])
    assert rank_period(ro) is None


def test_rank_ops_rejects_ragged_columns():
    from slurmguard.errors import InputError

    with pytest.raises(InputError, match="rank 3: column comm has 2 rows"):
        RankOps(3, np.zeros(3), np.zeros(2), np.zeros(3), np.zeros(3), np.zeros(3))
