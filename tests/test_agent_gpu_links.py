"""Slow links as localisation (Mycroft, Table 4): the NCCL profiler plugin's
per-link transfer times, read from synthesised GPU rings of a 4-node ring
(one rank per node, communicator 9, rank r sending to r+1 and receiving
from r-1), name the node common to the slow links when compute-based
localisation names nobody; slow links with no common node are said so in
the assessment and blame nobody."""

from __future__ import annotations

import os
import time

import pytest

from slurmguard.agent.analysis import RankAnalyzer
from slurmguard.agent.rings import RingTracker
from slurmguard.config import Policy
from slurmguard.controller.assess import assess_job
from slurmguard.controller.links import link_verdict
from slurmguard.hook import ring
from slurmguard.wire import StepSample

POLICY = Policy()
JOB = 11
N = 4
STEPS = 40
FAST_NS, SLOW_NS = 800_000, 8_000_000  # network time per proxy step


def ring_reports(root, slow: set[tuple[int, int]]) -> list:
    """Each rank's report from its profiler-plugin ring: GPU-timed
    all-reduces and one peer_xfer record per peer and direction; a link
    (src, dst) in `slow` spends SLOW_NS per step on the network, seen from
    both its ends."""
    d = root / str(JOB)
    d.mkdir(parents=True)
    t = time.monotonic_ns() - 2 * 10**9
    for r in range(N):
        w = ring.RingWriter(
            str(d / f"rank-{r}.step-0.ncclprof.ring"),
            capacity=256,
            job_id=JOB,
            step_id=0,
            global_rank=r,
            local_rank=0,
            world_size=N,
            source=ring.SOURCE_NCCL_PROFILER,
            node_name=f"node{r}",
        )
        for i in range(20):
            s = t + i * 10**7
            w.append(
                ring.OP["allreduce"],
                comm_id=9,
                count=1 << 20,
                nbytes=4 << 20,
                start_ns=s,
                end_ns=s + 5000,
                flags=ring.F_GPU_TIME,
                gpu_start_ns=s + 10**6,
                gpu_end_ns=s + 4 * 10**6,
            )
        for peer, sent in (((r + 1) % N, True), ((r - 1) % N, False)):
            link = (r, peer) if sent else (peer, r)
            w.append(
                ring.OP["peer_xfer"],
                comm_id=9,
                count=STEPS,
                nbytes=STEPS << 19,
                start_ns=t,
                end_ns=t + 10**8,
                peer=peer,
                flags=ring.F_XFER_SEND if sent else 0,
                xfer_net_ns=STEPS * (SLOW_NS if link in slow else FAST_NS),
                xfer_ops=4,
            )
        w.close()
    out = []
    for r in range(N):
        tr = RingTracker(str(root), f"node{r}", lambda: {JOB: os.getuid()}, young_s=0.0)
        (tracked,) = tr.poll()
        out.append((f"node{r}", RankAnalyzer(POLICY.agent, POLICY.detection).report(tracked)))
        tr.close()
    return out


def test_a_slow_nic_is_the_node_common_to_the_slow_links(tmp_path):
    # node2's NIC: its link from node1 and its link to node3 are slow
    v = link_verdict(ring_reports(tmp_path, {(1, 2), (2, 3)}), POLICY)
    assert v.node == "node2" and v.ranks == (2,)
    assert len(v.links) == 4  # each slow link from both its ends
    assert v.why.startswith("slow links point at node2")


@pytest.mark.parametrize(
    "slow",
    [
        {(0, 1)},  # one slow link: a cable or either end, not one node
        {(0, 1), (2, 3)},  # two links with no node in common
    ],
)
def test_slow_links_without_a_common_node_name_nobody(tmp_path, slow):
    v = link_verdict(ring_reports(tmp_path, slow), POLICY)
    assert v.node is None and v.ranks == ()
    assert "point at no single node" in v.why and len(v.links) == 2 * len(slow)


def test_no_slow_link_no_verdict(tmp_path):
    assert link_verdict(ring_reports(tmp_path, set()), POLICY) is None


def _slowed(reports, *, slow_compute_rank: int | None = None) -> list:
    """The job slowed from 0.2 s to 0.3 s per step; the time went into the
    collectives (every rank's compute stays 0.1 s), except on
    slow_compute_rank, whose compute grew (the others wait for it)."""
    out = []
    for node, rep in reports:
        steps = []
        for i in range(120):
            step = 0.2 if i < 80 else 0.3
            comp = 0.2 if (rep.rank == slow_compute_rank and i >= 80) else 0.1
            steps.append(StepSample(end=1000.0 + 0.25 * i, step_s=step, comm_s=step - comp))
        out.append(
            (
                node,
                rep.model_copy(
                    update={
                        "steps": steps,
                        "total_steps": 120,
                        "baseline_step_s": 0.2,
                        "baseline_compute_s": 0.1,
                        "role": "dp",
                        "last_progress": 1030.0,
                        "exited": False,
                    }
                ),
            )
        )
    return out


def test_assessment_names_the_links_node_when_compute_names_nobody(tmp_path):
    ranks = _slowed(ring_reports(tmp_path, {(1, 2), (2, 3)}))
    nodes = tuple(n for n, _ in ranks)
    a = assess_job(JOB, nodes, ranks, {}, POLICY, now=1031.0)
    assert a is not None and a.current_s == pytest.approx(0.3, rel=0.05)
    assert [c.node for c in a.culprits] == ["node2"]
    assert a.culprits[0].ranks == (2,) and "slow links point at node2" in a.culprits[0].why
    assert len(a.evidence["slow_links"]) == 4


def test_assessment_says_when_links_point_at_no_node_and_blames_nobody(tmp_path):
    ranks = _slowed(ring_reports(tmp_path, {(0, 1)}))
    a = assess_job(JOB, tuple(n for n, _ in ranks), ranks, {}, POLICY, now=1031.0)
    assert a is not None and a.culprits == ()
    assert "point at no single node" in a.evidence["link_localisation"]
    assert "localisation" in a.evidence  # compute's own reason stays


def test_compute_localisation_wins_over_link_evidence(tmp_path):
    ranks = _slowed(ring_reports(tmp_path, {(1, 2), (2, 3)}), slow_compute_rank=0)
    a = assess_job(JOB, tuple(n for n, _ in ranks), ranks, {}, POLICY, now=1031.0)
    assert [c.node for c in a.culprits] == ["node0"]
    assert a.evidence["link_localisation"].startswith("slow links point at node2")
