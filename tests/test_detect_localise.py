"""Localisation: Mycroft rules, cross-group comparison, job layout, findings."""

from __future__ import annotations

import numpy as np
import pytest

from slurmguard.detect.bocd import detect_changepoints
from slurmguard.detect.crossgroup import group_times, slow_groups, suspects
from slurmguard.detect.findings import job_finding, localise
from slurmguard.detect.mycroft import StragglerTriggers, find_stall, late_ranks, sample_ranks
from slurmguard.detect.period import step_times
from slurmguard.detect.records import JobLayout, parse_tasks_per_node
from slurmguard.slurm.hostlist import expand as expand_hostlist
from slurmguard.detect.synth import JobSpec, make_job
from slurmguard.errors import InputError


def test_stalled_rank_is_named():
    tr = make_job(JobSpec(iterations=30, stall_rank=5, stall_at=20))
    st = find_stall(tr.ops, tr.now_ns + 120_000_000_000)
    assert st is not None
    assert st.culprit == 5
    assert 5 not in st.waiting and st.waiting
    # within the window there is no stall yet
    assert find_stall(tr.ops, tr.now_ns - 4_000_000_000) is None


def test_late_starting_rank_is_named():
    tr = make_job(JobSpec(iterations=20, late_rank=6, late_s=1.5))
    found = late_ranks(tr.ops)
    assert found and found[0].rank == 6 and found[0].which == "start"
    assert found[0].median_late_s == pytest.approx(1.5, abs=0.05)
    # 0.5 s late is below Mycroft's 1 s threshold
    assert late_ranks(make_job(JobSpec(iterations=20, late_rank=6, late_s=0.5)).ops) == []


def test_straggler_trigger_when_throughput_halves_or_interval_doubles():
    # step time 0.5 s -> ~1.9 s: throughput well under half, interval over double
    tr = make_job(JobSpec(iterations=40, slow_rank=0, slow_factor=5.0, slow_from=30))
    trig = StragglerTriggers(window_s=5.0)
    t0 = int(tr.ops[1].start_ns[10])
    fired = []
    for t in range(t0 + 5_000_000_000, int(tr.ops[1].start_ns[-1]), 1_000_000_000):
        fired.append((t, trig.check(tr.ops, t, sampled=[1])))
    slow_start = 1_350_000_000 + 30 * 500_000_000
    assert not any(f for t, f in fired if t < slow_start)          # healthy: no trigger
    late = [f for t, f in fired if t > slow_start + 6_000_000_000]
    assert late and all(f and f[0].rank == 1 for f in late)
    assert all(f[0].throughput_ratio <= 0.5 or f[0].interval_ratio >= 2.0 for f in late)
    assert max(f[0].interval_ratio for f in late) >= 2.0


def test_cross_group_comparison_finds_the_slow_group_and_its_places():
    tr = make_job(JobSpec(nodes=4, gpus_per_node=4, tp=2, iterations=30, slow_rank=5, slow_factor=1.5))
    times = group_times(tr.ops)
    slow = slow_groups(times)
    assert slow and slow[0].comm == tr.tp_comm[5]
    assert slow[0].excess > 0.10 and slow[0].cluster_size == 8
    sus = suspects(slow, times, tr.layout)
    assert ("node2", 1) in sus.gpus and sus.nodes == ("node2",)
    assert slow_groups(group_times(make_job(JobSpec(nodes=4, iterations=30)).ops)) == []


def test_sampling_covers_each_dp_group_and_caps_at_ten():
    tr = make_job(JobSpec(nodes=8, gpus_per_node=8, tp=8, iterations=2))
    s = sample_ranks(tr.layout, tr.dp_comm)
    assert len(s) <= 10
    assert {tr.dp_comm[r] for r in s} == set(tr.dp_comm.values())


def test_layout_from_slurm_and_headers():
    assert expand_hostlist("gpu[01-03,10],login1") == ["gpu01", "gpu02", "gpu03", "gpu10", "login1"]
    assert parse_tasks_per_node("4(x2),2") == [4, 4, 2]
    lay = JobLayout.from_slurm("77", "gpu[1-3]", "4(x2),2")
    assert lay.node_of(5) == "gpu2" and lay.gpu_of(5) == 1 and lay.node_of(9) == "gpu3"
    cyc = JobLayout.from_slurm("77", "a,b", "2(x2)", distribution="cyclic")
    assert [cyc.node_of(r) for r in range(4)] == ["a", "b", "a", "b"]
    hdr = JobLayout.from_headers("78", [(0, "n1", 0), (1, "n1", 1), (2, "n2", 0)])
    assert hdr.ranks_on("n1") == [0, 1]
    with pytest.raises(InputError, match="describes 3 nodes"):
        JobLayout.from_slurm("77", "gpu[1-2]", "4(x3)")
    with pytest.raises(InputError, match="unbalanced"):
        expand_hostlist("gpu[1-3")
    with pytest.raises(InputError, match="job 77: rank 19 is not in the job layout"):
        lay.node_of(19)


def test_finding_names_slowdown_onset_and_cause():
    tr = make_job(JobSpec(nodes=4, iterations=120, slow_rank=6, slow_factor=1.4, slow_from=60,
                          late_rank=6, late_s=0.0))
    st = step_times(tr.ops[0])
    (cp,) = detect_changepoints(st.seconds)
    culprits, stalled = localise(tr.layout, tr.ops, tr.now_ns, since_ns=int(st.end_ns[cp.index]))
    f = job_finding("4242", cp, culprits, stalled, list(st.end_ns / 1e9))
    assert f.kind == "slowdown" and f.slowdown == pytest.approx(0.28, abs=0.05)
    assert f.since == pytest.approx(st.end_ns[cp.index] / 1e9)
    assert ("node2", 3) in [(c.node, c.gpu) for c in f.culprits]
    text = f.summary()
    assert text.startswith("job 4242 is 2") and "node2" in text
    assert f.to_dict()["culprits"][0]["evidence"]


def test_stall_finding_ranks_the_stalled_gpu_first():
    tr = make_job(JobSpec(iterations=30, stall_rank=5, stall_at=20))
    culprits, stalled = localise(tr.layout, tr.ops, tr.now_ns + 120_000_000_000)
    assert stalled and (culprits[0].node, culprits[0].gpu) == ("node2", 1)
    assert job_finding("9", None, culprits, stalled).summary().startswith("job 9 is stalled")
