"""The agent and the controller on GPU rings (issue 16.3): localisation
uses the GPU time of collectives where the ring has it, and names the slow
rank on a GPU job exactly as on a gloo job.

The GPU jobs are the recorded gloo jobs of tests/test_agent_localise.py
(tests/fixtures/agent_rings/L_*.npz: one rank's compute 2x slower from
iteration 25) as the NCCL hook writes them on a GPU: each collective's
recorded span becomes its GPU execution (gpu_start_ns/gpu_end_ns, flag
gpu_time), and its host call becomes what it is on a GPU, an enqueue of a
few microseconds issued as the CPU runs ahead (all of an iteration's calls
at its start). Point-to-point calls are NCCL groups, as torch issues them:
the calls inside keep host times, the outermost group_end carries the
GPU time (as recorded on the H100, tests/test_agent_gpu_real.py).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from slurmguard.agent.analysis import RankAnalyzer
from slurmguard.agent.rings import RingTracker
from slurmguard.config import Policy
from slurmguard.controller.assess import assess_job
from slurmguard.controller.links import slow_links
from slurmguard.detect.waiting import waiting_time
from slurmguard.hook import ring
from tests.fixtures.agent import recorded
from tests.test_agent_localise import judge as judge_gloo

POLICY = Policy()
JOB = 7
ENQUEUE_NS = 5_000  # a host call of an NCCL collective on a GPU
ISSUE_GAP_NS = 20_000  # between two calls the CPU issues back to back


def _ring(tmp_path, *, rank: int = 0, world: int = 2, profiler: bool = False, node: str = "n"):
    """A 64-record ring of job JOB under tmp_path, as the NCCL hook (or, with
    profiler, the profiler plugin) writes it for `rank`."""
    d = tmp_path / str(JOB)
    d.mkdir(exist_ok=True)
    kind = "ncclprof" if profiler else "nccl"
    return ring.RingWriter(
        str(d / f"rank-{rank}.step-0.{kind}.ring"),
        capacity=64,
        job_id=JOB,
        step_id=0,
        global_rank=rank,
        world_size=world,
        source=ring.SOURCE_NCCL_PROFILER if profiler else ring.SOURCE_NCCL,
        node_name=node,
    )


_SEND, _RECV = ring.OP["send"], ring.OP["recv"]


def gpu_job(pattern: str, root, job: int = JOB, *, gpu: bool = True) -> dict:
    """Write the recorded job as NCCL-hook rings under root/job. gpu=False:
    the same host calls without GPU times (the hook before issue 16)."""
    rec = recorded(pattern)
    last = max(int(v["records"][:, 5].max()) for v in rec.values())
    shift = time.monotonic_ns() - 10**9 - last
    d = root / str(job)
    d.mkdir(parents=True, exist_ok=True)
    for r, v in rec.items():
        # issue order (the torch hook wrote async work when it completed)
        recs = v["records"][np.argsort(v["records"][:, 4], kind="stable")]
        recs[:, 4:6] += shift
        marks = v["marks"] + shift
        coll = ~np.isin(recs[:, 0], [9, 10, 11, 12, 13, 17, 18])
        start, end = recs[:, 4], recs[:, 5].copy()
        # a gloo receive's record ends when the call returns, its wait unseen:
        # on the GPU the receive runs until the data is there, which the
        # recording bounds by the rank's next call (agent.analysis.waited_until)
        untimed = (recs[:, 0] == _RECV) & ((recs[:, 7] & ring.F_ASYNC) == 0)
        nxt = np.concatenate([start[1:], end[-1:]])
        end = np.where(untimed, np.maximum(end, nxt), end)
        # the CPU issues an iteration's calls at the iteration's start
        it = np.clip(np.searchsorted(marks, start, side="right") - 1, 0, None)
        first = np.concatenate([[True], it[1:] != it[:-1]])
        pos = np.arange(len(it)) - np.maximum.accumulate(np.where(first, np.arange(len(it)), 0))
        host = np.where(it >= 0, marks[it], start) + pos * ISSUE_GAP_NS
        host = np.minimum(host, start)  # never after the work itself started
        w = ring.RingWriter(
            str(d / f"rank-{r}.step-0.nccl.ring"),
            capacity=8192,
            job_id=job,
            step_id=0,
            global_rank=r,
            local_rank=0,
            world_size=v["world"],
            source=ring.SOURCE_NCCL,
            node_name=v["node"],
        )
        for i, (op, comm, count, nbytes, s, _, peer, _) in enumerate(recs.tolist()):
            h = int(host[i]) if coll[i] else s
            times = {"gpu_start_ns": s, "gpu_end_ns": int(end[i])} if gpu else {}
            gflag = ring.F_GPU_TIME if gpu else ring.F_NO_EVENT
            if op in (_SEND, _RECV):
                # torch issues p2p inside an NCCL group; the group carries the time
                w.append(ring.OP["group_start"], start_ns=h, end_ns=h + 500)
                w.append(
                    op,
                    comm_id=comm,
                    count=count,
                    nbytes=nbytes,
                    start_ns=h + 1000,
                    end_ns=h + 1000 + ENQUEUE_NS,
                    peer=peer,
                    flags=ring.F_IN_GROUP,
                )
                w.append(
                    ring.OP["group_end"],
                    start_ns=h + 2000 + ENQUEUE_NS,
                    end_ns=h + 3000 + ENQUEUE_NS,
                    flags=gflag,
                    **times,
                )
            elif coll[i]:
                w.append(
                    op,
                    comm_id=comm,
                    count=count,
                    nbytes=nbytes,
                    start_ns=h,
                    end_ns=h + ENQUEUE_NS,
                    peer=peer,
                    flags=gflag,
                    **times,
                )
            else:
                w.append(
                    op, comm_id=comm, count=count, nbytes=nbytes, start_ns=s, end_ns=int(end[i]), peer=peer
                )
        w.close()
    return rec


def judge(tmp_path, pattern, *, gpu=True):
    rec = gpu_job(pattern, tmp_path, gpu=gpu)
    nodes = sorted({v["node"] for v in rec.values()})
    ranks = []
    for node in nodes:
        tr = RingTracker(str(tmp_path), node, lambda: {JOB: os.getuid()}, young_s=0.0)
        for t in tr.poll():
            ranks.append((node, RankAnalyzer(POLICY.agent, POLICY.detection).report(t)))
    now = max(r.last_progress for _, r in ranks) + 1.0
    return assess_job(JOB, tuple(nodes), ranks, {}, POLICY, now), ranks


#: recordings whose slow spell is within the noise of the localiser's window
#: (see tests/test_agent_localise.py): no node named, on the GPU as on gloo
NOISY = {"L_tp2"}


@pytest.mark.parametrize(
    "name,node",
    [
        ("L_ddp", "node1"),  # DP: the peer waits inside the all-reduce, on the GPU
        ("L_fsdp", "node1"),  # FSDP: in all_gather / reduce_scatter
        ("L_tp2", "node1"),  # TP pairs inside a node, DP across nodes
    ],
)
def test_gpu_job_names_the_slow_rank_as_the_gloo_job_does(tmp_path, name, node):
    a, ranks = judge(tmp_path / "gpu", name)
    g, _ = judge_gloo(tmp_path / "gloo", name)
    want = [] if name in NOISY else [node]
    assert [c.node for c in a.culprits] == [c.node for c in g.culprits] == want, a.evidence
    assert [c.ranks for c in a.culprits] == [c.ranks for c in g.culprits]
    # the same numbers: GPU times are what the gloo hook saw around its calls
    assert a.evidence == g.evidence
    # the job is seen slower; a noisy recording's slow spell is within the
    # noise of its baseline (L_tp2: no slowdown, tests/test_agent_localise.py)
    assert a.slowdown == g.slowdown
    assert a.slowdown > 0.5 or name in NOISY
    assert all(r.source == "nccl" for _, r in ranks)


@pytest.mark.parametrize("name", ["L_pp0", "L_pp1"])
def test_gpu_pipeline_is_judged_as_the_gloo_one(tmp_path, name):
    """Pipeline stages: the same roles and the same verdict as on gloo (the
    p2p calls reach the agent as NCCL groups, timed by their group_end)."""
    a, ranks = judge(tmp_path / "gpu", name)
    g, granks = judge_gloo(tmp_path / "gloo", name)
    assert len({r.role for _, r in ranks}) == 2
    assert {c.node for c in a.culprits} == {c.node for c in g.culprits}
    assert {r.rank: r.period_ops for _, r in ranks} == {r.rank: r.period_ops for _, r in granks}


@pytest.mark.parametrize("name,node", [("L_ddp", "node1"), ("L_tp2", "node1")])
def test_host_times_alone_cannot_localise_a_gpu_job(tmp_path, name, node):
    """The same GPU job with host times only (each collective an enqueue of
    microseconds): every rank's compute looks like its whole step, and the
    slow rank is not the one named. What the GPU times are for."""
    a, _ = judge(tmp_path, name, gpu=False)
    assert a is None or [c.node for c in a.culprits] != [node]


def test_compute_is_iteration_minus_gpu_time_in_collectives(tmp_path):
    """Per iteration, comm_s is the GPU time inside collectives: the peer
    of the slow rank waits there (late start of the slow rank's all-reduce
    on the GPU), so only the slow rank's compute (step - comm) grows."""
    a, ranks = judge(tmp_path, "L_ddp")
    by_rank = {r.rank: r for _, r in ranks}
    slow, peer = by_rank[1], by_rank[0]
    ratio = a.evidence["rank_compute_ratio"]
    assert ratio["node1/1"] > 1.15 * ratio["node0/0"]
    assert np.median([s.comm_s for s in peer.steps[-6:]]) > 20 * np.median(
        [s.comm_s for s in slow.steps[-6:]]
    )
    for s in slow.steps:
        assert 0 <= s.comm_s <= s.step_s


def test_group_members_take_their_groups_gpu_span(tmp_path):
    """Calls inside an outermost NCCL group get the GPU span of its
    group_end, also when the group_end is read in a later poll (the hook
    writes it once the GPU work has run); a group without GPU time leaves
    its calls their host times."""
    w = _ring(tmp_path)
    t = time.monotonic_ns() - 10**9
    w.append(ring.OP["group_start"], start_ns=t, end_ns=t + 10)
    w.append(_SEND, comm_id=5, nbytes=8, start_ns=t + 100, end_ns=t + 200, peer=1, flags=ring.F_IN_GROUP)
    w.append(_RECV, comm_id=5, nbytes=8, start_ns=t + 300, end_ns=t + 400, peer=1, flags=ring.F_IN_GROUP)
    tr = RingTracker(str(tmp_path), "n", lambda: {JOB: os.getuid()}, young_s=0.0)
    (tracked,) = tr.poll()
    assert tracked.begin_ns.tolist() == [t + 100, t + 300]  # host times until the group_end
    w.append(
        ring.OP["group_end"],
        start_ns=t + 500,
        end_ns=t + 600,
        flags=ring.F_GPU_TIME,
        gpu_start_ns=t + 5000,
        gpu_end_ns=t + 9000,
    )
    # an untimed group (events off): its calls keep their host times
    w.append(ring.OP["group_start"], start_ns=t + 10000, end_ns=t + 10010)
    w.append(_SEND, comm_id=5, nbytes=8, start_ns=t + 10100, end_ns=t + 10200, peer=1, flags=ring.F_IN_GROUP)
    w.append(ring.OP["group_end"], start_ns=t + 10500, end_ns=t + 10600, flags=ring.F_NO_EVENT)
    tr.poll()
    assert tracked.begin_ns.tolist() == [t + 5000, t + 5000, t + 10100]
    assert tracked.finish_ns.tolist() == [t + 9000, t + 9000, t + 10200]
    assert tracked.start_ns.tolist() == [t + 100, t + 300, t + 10100]  # host times kept
    w.close()


def test_peer_xfer_records_are_links_not_collectives(tmp_path):
    """The profiler plugin's per-link aggregates never enter the op
    sequence; the tracker sums them per (communicator, peer, direction)."""
    w = _ring(tmp_path, world=4, profiler=True)
    t = time.monotonic_ns() - 10**9
    w.append(
        ring.OP["allreduce"],
        comm_id=5,
        nbytes=1 << 20,
        start_ns=t,
        end_ns=t + 10,
        flags=ring.F_GPU_TIME,
        gpu_start_ns=t + 100,
        gpu_end_ns=t + 5100,
        coll_seq=1,
    )
    for k, (peer, net) in enumerate([(1, 4_000_000), (1, 6_000_000), (3, 40_000_000)]):
        w.append(
            ring.OP["peer_xfer"],
            comm_id=5,
            count=10,
            nbytes=10 << 20,
            start_ns=t + k,
            end_ns=t + k + 1,
            peer=peer,
            flags=ring.F_XFER_SEND,
            xfer_net_ns=net,
            xfer_peer_wait_ns=1000,
            xfer_channels=3,
            xfer_ops=2,
        )
    w.close()
    tr = RingTracker(str(tmp_path), "n", lambda: {JOB: os.getuid()}, young_s=0.0)
    (tracked,) = tr.poll()
    assert tracked.op.tolist() == [ring.OP["allreduce"]]
    assert (tracked.begin_ns[0], tracked.finish_ns[0]) == (t + 100, t + 5100)
    links = {(peer, sent): lt for (_, peer, sent), lt in tracked.links.items()}
    assert set(links) == {(1, True), (3, True)}
    assert links[(1, True)].steps == 20 and links[(1, True)].net_per_step_s == pytest.approx(5e-4)
    assert links[(3, True)].net_per_step_s == pytest.approx(4e-3)  # the slow link
    assert links[(1, True)].gbps == pytest.approx((20 << 20) / 10e6)


def test_impossible_gpu_times_are_counted_not_used(tmp_path):
    w = _ring(tmp_path)
    t = time.monotonic_ns() - 10**9
    w.append(
        ring.OP["allreduce"],
        comm_id=5,
        nbytes=8,
        start_ns=t,
        end_ns=t + 10,
        flags=ring.F_GPU_TIME,
        gpu_start_ns=t + 100,
        gpu_end_ns=t + 50,
    )  # ends before it starts
    w.append(
        ring.OP["allreduce"],
        comm_id=5,
        nbytes=8,
        start_ns=t + 20,
        end_ns=t + 30,
        flags=ring.F_GPU_TIME,
        gpu_start_ns=t + 100,
        gpu_end_ns=t + 10**15,
    )  # in 11 days
    w.append(
        ring.OP["allreduce"],
        comm_id=5,
        nbytes=8,
        start_ns=t + 40,
        end_ns=t + 50,
        flags=ring.F_GPU_TIME,
        gpu_start_ns=t + 200,
        gpu_end_ns=t + 300,
    )
    w.close()
    tr = RingTracker(str(tmp_path), "n", lambda: {JOB: os.getuid()}, young_s=0.0)
    (tracked,) = tr.poll()
    assert tracked.begin_ns.tolist() == [t + 200] and tracked.corrupt == 2
    assert tr.errors["corrupt_records"] == 2


def test_waiting_time_takes_ops_in_any_order():
    """GPU starts of ops in issue order may interleave across streams."""
    bounds = np.array([0, 100, 200])
    a = waiting_time(np.array([10, 50, 120]), np.array([40, 60, 150]), bounds)
    b = waiting_time(np.array([50, 10, 120]), np.array([60, 40, 150]), bounds)
    assert a.tolist() == b.tolist() == [40.0, 30.0]


def test_slow_link_from_the_plugins_transfer_times(tmp_path):
    """A 4-rank ring where rank 0 sends to rank 1 over a slow link: each
    rank's peer_xfer records reach its report as links, and the controller
    names that link (network time per step against the job's other links
    of that direction), as evidence beside the assessment."""
    t = time.monotonic_ns() - 10**9
    for r in range(4):
        w = _ring(tmp_path, rank=r, world=4, profiler=True, node=f"node{r}")
        for peer, sent in (((r + 1) % 4, True), ((r + 3) % 4, False)):
            slow = (r, peer, sent) in ((0, 1, True), (1, 0, False))
            w.append(
                ring.OP["peer_xfer"],
                comm_id=9,
                count=40,
                nbytes=40 << 19,
                start_ns=t,
                end_ns=t + 10**8,
                peer=peer,
                flags=ring.F_XFER_SEND if sent else 0,
                xfer_net_ns=40 * (8_000_000 if slow else 800_000),
                xfer_ops=4,
            )
        w.close()
    reports = []
    for r in range(4):
        tr = RingTracker(str(tmp_path), f"node{r}", lambda: {JOB: os.getuid()}, young_s=0.0)
        (tracked,) = tr.poll()
        rep = RankAnalyzer(POLICY.agent, POLICY.detection).report(tracked)
        assert len(rep.links) == 2 and all(lk.steps == 40 for lk in rep.links)
        reports.append((f"node{r}", rep))
    got = slow_links(reports, POLICY)
    assert got == [
        "node0/0 -> peer 1: 8 ms/step on the network vs median 0.8",
        "node1/1 <- peer 0: 8 ms/step on the network vs median 0.8",
    ]
    healthy = [
        (n, r.model_copy(update={"links": [lk for lk in r.links if lk.net_s < 0.1]})) for n, r in reports
    ]
    assert slow_links(healthy, POLICY) == []
    assert slow_links([(n, r.model_copy(update={"links": []})) for n, r in reports], POLICY) == []
