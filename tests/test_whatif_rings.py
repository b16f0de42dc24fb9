"""`slurmguard whatif --rings`: what-if analysis of slurmguard's own ring traces.

The synthetic jobs are written with the real RingWriter, timed like a
synchronous data-parallel job: every rank computes, launches the all-reduce
when done, and all ranks' all-reduce ends together at max(arrival) + transfer;
the next iteration's compute starts there. Node clocks differ (each ring's
monotonic clock has its own offset to wall-clock, and node-b's clock is 2 ms
off), as on a real cluster.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from slurmguard.cli import cli, main
from slurmguard.config import PeriodPolicy
from slurmguard.detect.records import RankOps
from slurmguard.errors import InputError
from slurmguard.hook.ring import OP, SOURCE_TORCH, RingReader, RingWriter, comm_id_of
from slurmguard.whatif.rings import RankIterations, load_ring_job, match_steps, rank_iterations
from slurmguard.whatif.trace import JobMeta

JOB = 4242
WORLD = 4
NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
NODE_CLOCK_ERROR_NS = {"node-a": 0, "node-b": 2_000_000}
COMPUTE_S = 0.100
TRANSFER_S = 0.020
WORLD_COMM = comm_id_of("0")
GRAD_BYTES = 4160 * 4


@dataclass
class Job:
    compute: np.ndarray
    """(iteration, rank) seconds."""
    transfer: np.ndarray
    """(iteration,) seconds."""
    end_ns: np.ndarray
    """(iteration,) wall-clock ns at which the all-reduce ended."""


def write_job(
    root: Path,
    *,
    slow: dict[int, float] | None = None,
    iters: int = 40,
    buckets: int = 1,
    job: int = JOB,
    ranks=range(WORLD),
    seed: int = 0,
    archive: bool = True,
) -> Job:
    """A DDP job: broadcast at start-up, `iters` iterations of compute + `buckets`
    gradient all-reduces (+ one small loss all-reduce when buckets > 1), a final
    barrier. Rank r computes slow.get(r, 1) times longer."""
    slow = slow or {}
    rng = np.random.default_rng(seed)
    compute = COMPUTE_S * (1 + 0.02 * rng.uniform(-1, 1, (iters, WORLD)))
    compute *= np.array([slow.get(r, 1.0) for r in range(WORLD)])
    transfer = TRANSFER_S * (1 + 0.05 * rng.uniform(-1, 1, iters))
    lag = rng.integers(0, 50_000, (iters, WORLD, buckets + 1))  # completion callbacks, ns
    # wall-clock times in the recent past, so every node's monotonic clock reads >= 0
    t0 = time.time_ns() - 30 * 10**9
    t = t0 + 5_000_000  # after the start-up broadcast
    rows: dict[int, list[tuple]] = {r: [(OP["broadcast"], 1000, t0, t)] for r in range(WORLD)}
    ends = []
    for k in range(iters):
        arrive = t + (compute[k] * 1e9).astype(np.int64)
        end = int(arrive.max() + transfer[k] * 1e9)
        for r in range(WORLD):
            if buckets == 1:
                rows[r].append((OP["allreduce"], GRAD_BYTES, int(arrive[r]), end + int(lag[k, r, 0])))
                continue
            # buckets launched during backward, 2 ms apart; the last one at the end of it
            for b in range(buckets):
                start = int(arrive[r]) - (buckets - 1 - b) * 2_000_000
                rows[r].append((OP["allreduce"], GRAD_BYTES // buckets, start, end + int(lag[k, r, b])))
            rows[r].append((OP["allreduce"], 8, end + 100_000, end + 300_000 + int(lag[k, r, -1])))
        ends.append(end)
        t = end + (300_000 if buckets > 1 else 0)
    for r in range(WORLD):
        rows[r].append((OP["barrier"], 0, t + 1_000_000, t + 2_000_000))
    for r in ranks:
        node = NODES[r]
        d = root / str(job) / node if archive else root / str(job)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank-{r}.step-0.torch.ring"
        w = RingWriter(
            str(path),
            capacity=1024,
            job_id=job,
            step_id=0,
            global_rank=r,
            local_rank=r % 2,
            world_size=WORLD,
            source=SOURCE_TORCH,
            node_name=node,
        )
        with RingReader(str(path)) as rd:
            # the ring's monotonic ns = wall-clock - its offset, plus this node's clock error
            shift = rd.header.clock_offset_ns - NODE_CLOCK_ERROR_NS[node]
        w.append(OP["comm_init"], comm_id=WORLD_COMM, count=WORLD, peer=r)
        for op, nbytes, s, e in rows[r]:
            w.append(
                op, comm_id=WORLD_COMM, nbytes=nbytes, count=nbytes // 4, start_ns=s - shift, end_ns=e - shift
            )
        w.close()
    return Job(compute, transfer, np.array(ends, dtype=np.int64))


def expected_slowdown(job: Job, its: np.ndarray) -> float:
    """Paper 004 Eq. 1 by hand for this job: a step is the slowest rank's compute plus
    the transfer (the others wait inside the all-reduce); ideal = mean compute + median
    transfer."""
    c, tr = job.compute[its], job.transfer[its]
    return float((c.max(axis=1) + tr).mean() / (c.mean() + np.median(tr)))


def run_json(*args: str) -> dict:
    res = CliRunner().invoke(cli, ["whatif", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def matched_iterations(rj, job: Job) -> np.ndarray:
    """Which generated iterations the analysis kept (by rank 0's all-reduce end)."""
    t = rj.table
    ends = t[(t["rank"] == 0) & (t["op"] == "dp-collectives")].sort_values("step")["end_ns"]
    # the iteration ends with the gradient all-reduce (+ callback lag), or with the
    # loss all-reduce 0.3 ms later
    diff = ends.to_numpy()[:, None] - job.end_ns[None, :]
    its = np.argmin(np.abs(diff), axis=1)
    assert np.all((diff[np.arange(len(its)), its] >= 0) & (diff[np.arange(len(its)), its] < 400_000))
    return its


def test_slow_rank_is_the_top_worker_and_S_matches_the_hand_computation(tmp_path):
    job = write_job(tmp_path, slow={2: 1.3})
    rj = load_ring_job(tmp_path / str(JOB))
    assert rj.meta == JobMeta(dp_size=4, pp_size=1, name=f"job {JOB}")
    assert rj.nodes == NODES and rj.steps == 39  # the first all-reduce has no compute before it
    its = matched_iterations(rj, job)
    assert list(its) == list(range(1, 40))
    # node-b's 2 ms clock error is found from the all-reduce ends and removed
    assert abs(rj.clock_skew_ns[2] - 2_000_000) < 60_000 and rj.clock_skew_ns[1] == 0
    want = expected_slowdown(job, its)
    assert want == pytest.approx(150 / 127.5, abs=0.02)  # 1.176 without the jitter
    out = run_json("--rings", str(tmp_path / str(JOB)))
    assert out["slowdown"] == pytest.approx(want, rel=2e-3)
    by_dp = {int(k): v for k, v in out["by_dp_rank"].items()}
    assert max(by_dp, key=by_dp.get) == 2
    assert by_dp[2] == pytest.approx(want, rel=5e-3)
    assert all(by_dp[r] < 1.02 for r in (0, 1, 3))
    assert out["mw_detail"]["top_workers"][0]["rank"] == 2
    assert out["mw"] > 0.9
    assert out["diagnosis"]["pattern"] == "worker"
    assert abs(out["discrepancy"]) < 0.01  # the inferred ops replay the recorded steps
    assert out["by_optype"]["forward-compute"] > out["by_optype"]["grads-reduce-scatter"]
    assert out["input"]["job_id"] == JOB and out["input"]["steps_matched"] == 39


def test_healthy_job_has_no_slowdown(tmp_path):
    job = write_job(tmp_path, seed=1)
    rj = load_ring_job(tmp_path / str(JOB))
    want = expected_slowdown(job, matched_iterations(rj, job))
    out = run_json("--rings", str(tmp_path / str(JOB)))
    assert out["slowdown"] == pytest.approx(want, rel=2e-3)
    assert out["slowdown"] < 1.03
    assert out["diagnosis"]["pattern"] == "none"


def test_several_collectives_per_iteration_and_a_live_ring_dir(tmp_path):
    # two gradient buckets and a loss all-reduce per iteration: the ACF period is 3
    job = write_job(tmp_path, slow={1: 1.5}, buckets=2, archive=False, iters=30)
    rj = load_ring_job(tmp_path / str(JOB))
    its = matched_iterations(rj, job)
    assert len(its) >= 27
    out = run_json("--rings", str(tmp_path / str(JOB)))
    assert out["mw_detail"]["top_workers"][0]["rank"] == 1
    # the first bucket launches 2 ms before backward ends: that much of the slow rank's
    # compute counts as communication, so S lands a little under the compute-only answer
    assert expected_slowdown(job, its) - 0.03 < out["slowdown"] < expected_slowdown(job, its) + 0.005


def test_text_output_names_the_job_and_the_op_mapping(tmp_path):
    write_job(tmp_path, slow={2: 1.3}, iters=12)
    res = CliRunner().invoke(cli, ["whatif", "--rings", str(tmp_path / str(JOB))])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert f"job {JOB}" in first and "4 ranks on 2 node(s)" in first and "forward-compute" in first


def test_the_latest_restart_is_analysed(tmp_path):
    write_job(tmp_path, slow={3: 1.4}, iters=12)
    # the run before the requeue was healthy; its archive sits next to the new one
    old = tmp_path / "old"
    write_job(old, iters=12)
    for node in ("node-a", "node-b"):
        (old / str(JOB) / node).rename(tmp_path / str(JOB) / f"{node}.restart-0")
        (tmp_path / str(JOB) / node).rename(tmp_path / str(JOB) / f"{node}.restart-1")
    rj = load_ring_job(tmp_path / str(JOB))
    assert rj.restart == 1 and "analysed restart 1" in rj.notes[0]
    out = run_json("--rings", str(tmp_path / str(JOB)))
    assert out["mw_detail"]["top_workers"][0]["rank"] == 3


def test_time_inside_one_off_collectives_is_not_compute():
    # one all-reduce per 150 ms iteration (100 ms compute, 50 ms in the all-reduce);
    # before iteration 5's all-reduce the rank waits 40 ms in a one-off broadcast
    ms = 1_000_000
    rows = []
    for k in range(10):
        if k == 5:
            rows.append((OP["broadcast"], 7, 20, 150 * k + 30, 0))
        rows.append((OP["allreduce"], 7, GRAD_BYTES, 150 * k + 100, 150 * k + 150))
    op, comm, nbytes, start, end = (np.array(c, dtype=np.int64) for c in zip(*rows))
    start, end = start * ms, end * ms
    b = np.flatnonzero(op == OP["broadcast"])
    end[b] = start[b] + 40 * ms
    it = rank_iterations(RankOps(0, op, comm, nbytes, start, end), PeriodPolicy(), "r0")
    compute_ms = (it.comm_start - it.compute_start) / ms
    assert list(it.n_ops) == [1] * 9  # the broadcast is no part of any iteration
    assert list(compute_ms) == [100] * 4 + [60] + [100] * 4
    assert list((it.comm_end - it.comm_start) / ms) == [50] * 9


def test_overlapped_buckets_backward_is_compute_and_only_the_wait_is_communication():
    """A DDP iteration of 3 gradient buckets issued during the backward pass
    and a small synchronous all-reduce after the optimizer step (100 ms an
    iteration). The fast rank calls its buckets at 2, 3, 4 ms and waits for
    the slow one until 50; the slow rank calls them at 10, 25, 40, each
    done 1 ms later; both call the small one at 55. Compute between the
    calls: the fast rank's 2 + 1 + 1 + 5 ms (forward, backward, optimizer),
    the slow one's 10 + 14 + 14 + 14 ms; the rest, up to the small
    all-reduce's end, is waiting."""
    ms = 1_000_000

    def rank(calls: list[tuple[int, int]], ranknum: int):
        rows = []
        for k in range(12):
            for size, (s, e) in zip([GRAD_BYTES, GRAD_BYTES + 8, GRAD_BYTES + 16, 16], calls):
                rows.append((OP["allreduce"], 7, size, 100 * k + s, 100 * k + e))
        op, comm, nbytes, start, end = (np.array(c, dtype=np.int64) for c in zip(*rows))
        return rank_iterations(RankOps(ranknum, op, comm, nbytes, start * ms, end * ms), PeriodPolicy(), "r")

    fast = rank([(2, 50), (3, 50), (4, 50), (55, 56)], 0)
    slow = rank([(10, 11), (25, 26), (40, 41), (55, 56)], 1)
    # each iteration from the previous one's end (56 ms into the 100) to its own:
    # 44 ms after that end (optimizer, data) + the compute between its calls
    for it, compute in ((fast, 44 + 9), (slow, 44 + 52)):
        assert set(it.n_ops) == {4}
        assert set(np.round((it.comm_start - it.compute_start) / ms)) == {compute}
        assert set(np.round((it.comm_end - it.comm_start) / ms)) == {100 - compute}


def test_uneven_gaps_of_a_throttled_rank_keep_one_iteration_a_period():
    """A DDP rank throttled in whole CFS periods: its longest gap falls on
    another call of the iteration in some iterations (a stall inside the
    backward pass). Iterations still start at the same call of the period,
    the one after the longest idle time by its median: 40 iterations of 4
    calls, none merged."""
    ms = 1_000_000
    rng = np.random.default_rng(3)
    rows, t = [], 0
    for _ in range(40):
        t += 30  # forward: the idle gap before the first bucket
        stall = 60 if rng.random() < 0.3 else 0  # a throttled period, mid-backward
        for j, size in enumerate([GRAD_BYTES, GRAD_BYTES + 8, GRAD_BYTES + 16]):
            t += 5 + (stall if j == 1 else 0)
            rows.append((OP["allreduce"], 7, size, t, t + 2))
        t += 10
        rows.append((OP["allreduce"], 7, 16, t, t + 1))
        t += 1
    op, comm, nbytes, start, end = (np.array(c, dtype=np.int64) for c in zip(*rows))
    it = rank_iterations(RankOps(0, op, comm, nbytes, start * ms, end * ms), PeriodPolicy(), "r0")
    assert set(it.n_ops) == {4} and len(it.n_ops) >= 38


def test_tensor_parallel_meta_uses_the_dp_communicator(tmp_path):
    # tp=2, dp=2: ranks 0,1 and 2,3 are TP pairs running TP all-reduces through the
    # compute; ranks 0,2 (and 1,3) sync gradients. DP rank 1 (ranks 2,3) is 40% slower.
    ms = 1_000_000
    t0 = time.time_ns() - 30 * 10**9
    d = tmp_path / "55" / "n"
    d.mkdir(parents=True)
    tp = {r: comm_id_of(f"tp{r // 2}") for r in range(4)}
    dp = {r: comm_id_of(f"dp{r % 2}") for r in range(4)}
    writers = {}
    for r in range(4):
        path = str(d / f"rank-{r}.step-0.torch.ring")
        writers[r] = RingWriter(
            path, capacity=1024, job_id=55, step_id=0, global_rank=r, world_size=4, node_name="n"
        )
        with RingReader(path) as rd:
            writers[r].shift = rd.header.clock_offset_ns
    t = t0
    for _ in range(12):
        compute = {r: (140 if r >= 2 else 100) * ms for r in range(4)}
        end = t + max(compute.values()) + 20 * ms
        for r, w in writers.items():
            for q in range(4):  # TP all-reduces inside the compute, 1 ms each
                s0 = t + (q + 1) * compute[r] // 5
                w.append(
                    OP["allreduce"],
                    comm_id=tp[r],
                    nbytes=4096,
                    start_ns=s0 - w.shift,
                    end_ns=s0 + ms - w.shift,
                )
            w.append(
                OP["allreduce"],
                comm_id=dp[r],
                nbytes=GRAD_BYTES,
                start_ns=t + compute[r] - w.shift,
                end_ns=end - w.shift,
            )
        t = end
    meta = tmp_path / "meta.yaml"
    meta.write_text("dp_size: 2\npp_size: 1\ntp_size: 2\n")
    from slurmguard.whatif.trace import load_meta

    rj = load_ring_job(tmp_path / "55", load_meta(meta))
    assert sorted(rj.table["rank"].unique()) == [0, 2] and rj.steps == 11
    # compute spans the TP all-reduces: from the DP all-reduce's end to the next one's start
    c = rj.table[(rj.table["op"] == "compute")]
    assert set(((c["end_ns"] - c["start_ns"]) // ms).tolist()) == {100, 140}
    out = run_json("--rings", str(tmp_path / "55"), "--meta", str(meta))
    assert out["mw_detail"]["top_workers"][0]["rank"] == 2
    assert out["slowdown"] == pytest.approx(160 / 140, rel=1e-3)


# ---------------------------------------------------------------- bad input
@pytest.fixture
def one_line_error(capsys):
    """Run the console entry point; return its one-line error (exit 2, no traceback)."""

    def run(*args: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["whatif", *args])
        assert exc.value.code == 2
        out = capsys.readouterr()
        assert "Traceback" not in out.err and out.out == ""
        lines = [x for x in out.err.splitlines() if x.strip()]
        assert len(lines) == 1, out.err
        return lines[0]

    return run


def test_empty_directory(tmp_path, one_line_error):
    d = tmp_path / "77"
    d.mkdir()
    msg = one_line_error("--rings", str(d))
    assert str(d) in msg and "empty directory" in msg


def test_missing_directory_and_no_rings(tmp_path, one_line_error):
    assert "no such directory" in one_line_error("--rings", str(tmp_path / "nope"))
    d = tmp_path / "78" / "node-a"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    msg = one_line_error("--rings", str(tmp_path / "78"))
    assert str(tmp_path / "78") in msg and "no ring files" in msg


def test_rings_of_different_jobs(tmp_path, one_line_error):
    write_job(tmp_path, iters=8)
    write_job(tmp_path / "other", iters=8, job=4243)
    (tmp_path / "other" / "4243" / "node-a").rename(tmp_path / str(JOB) / "node-c")
    msg = one_line_error("--rings", str(tmp_path / str(JOB)))
    assert "several jobs (4242, 4243)" in msg and str(tmp_path / str(JOB)) in msg


def test_missing_ranks(tmp_path, one_line_error):
    write_job(tmp_path, iters=8, ranks=[0, 1, 2])
    msg = one_line_error("--rings", str(tmp_path / str(JOB)))
    assert "no ring of rank(s) 3" in msg and "world size 4" in msg and str(tmp_path / str(JOB)) in msg


def test_corrupt_ring_is_named(tmp_path, one_line_error):
    write_job(tmp_path, iters=8)
    bad = tmp_path / str(JOB) / "node-b" / "rank-3.step-0.torch.ring"
    os.truncate(bad, 1000)
    msg = one_line_error("--rings", str(tmp_path / str(JOB)))
    assert str(bad) in msg and "truncated" in msg


def test_no_iterations_in_a_rank(tmp_path, one_line_error):
    d = tmp_path / "9" / "n"
    d.mkdir(parents=True)
    for r in range(2):
        w = RingWriter(
            str(d / f"rank-{r}.step-0.torch.ring"),
            capacity=16,
            job_id=9,
            step_id=0,
            global_rank=r,
            world_size=2,
            node_name="n",
        )
        w.append(OP["broadcast"], comm_id=1, nbytes=8, start_ns=1000, end_ns=2000)
        w.close()
    msg = one_line_error("--rings", str(tmp_path / "9"))
    assert "rank 0" in msg and "no repeating iteration" in msg and "rank-0.step-0" in msg


def test_meta_must_fit_the_rings(tmp_path, one_line_error):
    write_job(tmp_path, iters=8)
    meta = tmp_path / "meta.yaml"
    meta.write_text("dp_size: 2\npp_size: 2\n")
    assert "pp_size=2" in one_line_error("--rings", str(tmp_path / str(JOB)), "--meta", str(meta))
    meta.write_text("dp_size: 8\npp_size: 1\n")
    assert "world_size=8" in one_line_error("--rings", str(tmp_path / str(JOB)), "--meta", str(meta))
    with pytest.raises(InputError, match="TRACE or --rings"):
        from slurmguard.whatif.cli import whatif

        whatif.main(["--rings", str(tmp_path), str(meta)], standalone_mode=False)


def test_trace_file_still_needs_meta(tmp_path, one_line_error):
    (tmp_path / "t.parquet").write_bytes(b"")
    assert "--meta META is required" in one_line_error(str(tmp_path / "t.parquet"))


def test_an_iteration_of_two_steps_is_not_matched_as_one():
    """Where every rank's boundaries of one throttled stretch were missed alike,
    two steps read as one iteration of twice the collectives on all ranks: it
    lines up across ranks, yet it is not a step, and kept it would add its
    whole length to the mean step time reported as the actual one."""
    ms = 1_000_000
    ops = np.array([9, 9, 18, 9, 9])
    ends = np.array([100, 200, 400, 500, 600]) * ms

    def its(rank: int, skew: int) -> RankIterations:
        e = ends + skew
        return RankIterations(rank, e - 60 * ms, e - 20 * ms, e, ops.copy())

    idx, picks = match_steps({0: its(0, 0), 1: its(1, 3 * ms)}, 0)
    assert idx.tolist() == [0, 1, 3, 4] and picks[1].tolist() == [0, 1, 3, 4]


# ---------------------------------------------------------------- the real cluster
@pytest.mark.slurm
@pytest.mark.slow
def test_archived_trace_of_a_guarded_job_names_the_slowed_rank(guarded, capsys):
    """A real 3-node DDP job (slurmguard.workloads: gradient buckets overlapping the
    backward pass) whose second node is CPU-capped from outside after its first
    10 steps; the what-if replay of the rings its epilogs archived names that
    node's rank. About 1-2 minutes."""
    from slurmguard_dev.devcluster.scenario import SEVERE, Scenario
    from tests.fixtures.guard import wait_for

    # dry run: the controller must not drain the slowed node and requeue the job
    guarded.configure(safety={"dry_run": True})
    # three ranks: the what-if's ideal op is the median over the ranks, which of
    # two is their mean (half the straggler's excess), of three the healthy one
    first, second, third = guarded.cluster.node_names[:3]
    sc = Scenario(guarded.guard, say=print, workload="ddp")
    # long enough that most of it runs capped: calibrating the cap watches the job for 3 s
    job = sc.submit(steps=300, ckpt_every=0, signal=False, nodes=f"{first},{second},{third}", n_nodes=3)
    sc.wait_steps(job, 10)
    try:
        sc.inject(second, SEVERE)  # the cap that makes its steps about 2.5x slower
        assert guarded.cluster.wait_job(job, timeout=300) == "COMPLETED"
    finally:
        sc.clear(second)
    archive = guarded.guard.state / "traces" / str(job)
    wait_for(
        lambda: all((archive / n / "manifest.json").exists() for n in (first, second, third)),
        30,
        f"the epilogs to archive job {job}",
    )
    with pytest.raises(SystemExit) as exc:
        main(["whatif", "--rings", str(archive), "--json"])
    assert exc.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    log = sc.log(job)
    logged = float(np.mean([x["step_s"] for x in log]))
    # shown with any failure below (pytest prints what the test wrote to stderr)
    print(
        json.dumps(
            {k: out[k] for k in ("slowdown", "by_dp_rank", "mw", "discrepancy", "step_time_s")}
            | {"logged_step_s": logged, "logged_steps": len(log), "input": out["input"]}
        ),
        file=sys.stderr,
    )
    nodes = out["input"]["nodes"]
    slowed = int(next(r for r, n in nodes.items() if n == second))
    assert out["mw_detail"]["top_workers"][0]["rank"] == slowed
    by_dp = out["by_dp_rank"]
    assert by_dp[str(slowed)] == max(by_dp.values()) > 1.1
    # the pattern: "worker" in 3 of 3 runs, M_W 0.56-0.63 against its 0.5 bar
    assert out["slowdown"] > 1.1 and out["diagnosis"]["pattern"] in ("worker", "widespread")
    assert out["input"]["steps_matched"] >= 80
    # the step time replayed from the rings is the one the job measured itself
    # (rank 0; both means: the throttled steps vary by a CFS period)
    assert out["step_time_s"]["actual"] == pytest.approx(logged, rel=0.1)
    # two ops an iteration (compute, then exposed communication) replay an
    # overlapped DDP step only roughly: the capped rank's CFS-throttled stalls
    # with buckets in flight read as waiting (2-11% in five runs); the
    # output says so (diagnosis.fidelity_ok) rather than hiding it
    assert abs(out["discrepancy"]) < 0.15
