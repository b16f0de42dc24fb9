"""The decide step: a job's typed findings -> the assessment and tier (issue 14.2)."""

from __future__ import annotations

import pytest

from slurmguard.config import Policy
from slurmguard.controller.decide import JobFindings, decide
from slurmguard.detect.findings import Finding, Kind, Measure, Severity, Subject
from slurmguard.detect.peers import Deviation, PeerFlag
from slurmguard.respond.tiers import Tier, classify

NOW = 1_000_000.0


def steps(baseline: float, current: float, onset: float | None) -> Finding:
    return Finding(
        Kind.STEP_TIME,
        Subject(job_id=7),
        "steps",
        NOW,
        Severity.WARNING,
        (Measure("baseline_s", baseline, "s/step"), Measure("current_s", current, "s/step")),
        onset=onset,
    )


def slow_rank(node: str, rank: int) -> Finding:
    return Finding(
        Kind.SLOW_RANK,
        Subject(job_id=7, node=node, rank=rank, gpu=rank % 2),
        "localise",
        NOW,
        Severity.WARNING,
        (Measure("compute_s", 0.2, "s/step"),),
        text=f"rank {rank} slow",
    )


def test_slow_ranks_name_their_node_with_its_telemetry_and_the_tier_follows_the_policy():
    flag = PeerFlag(
        "node2", "gpu1", False, ("sm_clock low",), (Deviation("sm_clock", 1380.0, 1980.0, -6.0),), 3
    )
    other = PeerFlag("node9", "gpu0", True, ("XID 79",))
    jf = JobFindings(
        7,
        ("node1", "node2"),
        4,
        (
            steps(0.1, 0.13, NOW - 100),
            slow_rank("node2", 3),
            slow_rank("node2", 2),
            flag.finding(NOW),
            other.finding(NOW),
        ),
    )
    a = decide(jf)
    tier = classify(a, Policy().response.tiers, NOW)
    assert [(c.node, c.ranks, c.gpu) for c in a.culprits] == [("node2", (2, 3), 0)]
    assert a.culprits[0].why == "rank 2 slow"
    assert a.culprits[0].telemetry == ("gpu1 sm_clock 1380 vs peers 1980",)  # node9 is not the job's
    assert a.slowdown == pytest.approx(0.3) and a.onset == NOW - 100
    assert tier is Tier.REQUEUE  # 30% >= severe_slowdown 20%
    a2 = decide(JobFindings(7, ("node1", "node2"), 4, (steps(0.1, 0.105, None),)))
    assert a2.culprits == () and classify(a2, Policy().response.tiers, NOW) is Tier.NONE


def test_a_stall_names_its_least_progress_rank_only_when_no_rank_computes_slowly():
    stall = Finding(
        Kind.STALL,
        Subject(job_id=7, node="node1", rank=0),
        "stall",
        NOW,
        Severity.CRITICAL,
        (Measure("quiet_s", 130.0, "s", 120.0), Measure("baseline_s", 0.1, "s/step")),
        onset=NOW - 130,
        text="rank 0 made the least progress",
    )
    a = decide(JobFindings(7, ("node1", "node2"), 2, (stall,)))
    assert a.stalled_for_s == 130.0 and a.onset == NOW - 130 and a.current_s is None
    assert [(c.node, c.ranks) for c in a.culprits] == [("node1", (0,))]
    a = decide(JobFindings(7, ("node1", "node2"), 2, (stall, slow_rank("node2", 1))))
    assert [c.node for c in a.culprits] == ["node2"]


def test_nothing_to_judge_and_the_reason_for_no_culprit_are_kept():
    assert decide(JobFindings(7, ("node1",), 1, ())) is None
    why = Finding(Kind.UNLOCALISED, Subject(job_id=7), "localise", NOW, text="job-wide slowdown")
    a = decide(
        JobFindings(
            7, ("node1", "node2"), 2, (steps(0.1, 0.2, NOW - 5), why), rank_compute_s={"node1/0": 0.05}
        )
    )
    assert a.culprits == () and a.evidence["localisation"] == "job-wide slowdown"
    assert a.evidence["rank_compute_s"] == {"node1/0": 0.05}


def test_a_telemetry_finding_carries_units_and_severity():
    f = PeerFlag("n1", "gpu0", False, ("x",), (Deviation("gpu_temp", 91.0, 70.0, 5.2),), 3).finding(NOW)
    assert (f.kind, f.severity, f.subject.node, f.subject.device) == (
        Kind.TELEMETRY,
        Severity.WARNING,
        "n1",
        "gpu0",
    )
    assert f.measure("gpu_temp") == Measure("gpu_temp", 91.0, "C", 70.0)
    assert f.value("gpu_temp_z") == 5.2 and f.detected_at == NOW
    hard = PeerFlag("n1", "mlx5_0", True, ("link down",)).finding(NOW)
    assert hard.severity is Severity.CRITICAL and hard.text == "mlx5_0 link down"
    assert hard.to_dict()["subject"] == "node n1 mlx5_0"
