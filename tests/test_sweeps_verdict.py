import json

import pytest

from slurmguard.config import SweepPolicy
from slurmguard.sweeps.baseline import baseline_for, compute_baseline, extract_metrics, settings_fingerprint
from slurmguard.sweeps.result import SweepResult, Transfer, parse_result
from slurmguard.sweeps.verdict import (
    JobOutcome,
    Outcome,
    PastSweep,
    ReferenceStatus,
    judge_job,
    judge_multi,
    judge_result,
    localize_links,
    make_reason,
    reference_status,
)
from tests.fixtures.sweeps import node_doc, node_result, pair_doc, pair_result

POL = SweepPolicy()
TRUSTED = ReferenceStatus("node1", True, "test")


def _judge(r: SweepResult, healthy, **kw):
    return judge_result(r, baseline_for(r, healthy), POL, **kw)


def test_healthy_node_passes(healthy_node_results):
    v = _judge(node_result("node2", noise=0.01), healthy_node_results)
    assert v.outcome is Outcome.PASS and v.outcome.returns_node
    assert v.reason == "slurmguard: sweep1 pass"
    judged = [c for c in v.checks if c.basis == "class"]
    assert len(judged) == len(extract_metrics(v.result)) == 8 * 2 + 8 + 56 + 2


def test_one_slow_gpu_fails_naming_gpu_and_dtype(healthy_node_results):
    r = node_result("node2", gemm_scale={(5, "bfloat16"): 0.82})
    v = _judge(r, healthy_node_results)
    assert v.outcome is Outcome.FAIL
    # the class check and the node-peer check both see it; the reason names it once
    assert v.reason.startswith("slurmguard: sweep1 gpu5 gemm_bf16 -18% vs ")
    assert {c.basis for c in v.failures} == {"class", "node"}
    assert all(c.key == "gemm_bfloat16/gpu5" for c in v.failures)
    assert "700 of 5" in v.detail or "median 700" in v.detail


def test_within_tolerance_passes_and_just_outside_fails(healthy_node_results):
    assert _judge(node_result("node2", membw_scale={3: 0.96}), healthy_node_results).outcome is Outcome.PASS
    v = _judge(node_result("node2", membw_scale={3: 0.93}), healthy_node_results)
    assert v.outcome is Outcome.FAIL and v.reason.startswith("slurmguard: sweep1 gpu3 membw -7% vs")


def test_whole_node_slow_is_caught_by_class_not_by_peers(healthy_node_results):
    scale = {(i, "float32"): 0.85 for i in range(8)}
    v = _judge(node_result("node2", gemm_scale=scale), healthy_node_results)
    assert v.outcome is Outcome.FAIL
    assert {c.basis for c in v.failures} == {"class"}  # every GPU equally slow: peers agree
    assert v.reason.endswith("gemm_fp32 -15% vs class +7 more")


def test_missing_gpu_fails(healthy_node_results):
    r = node_result("node2", drop_gpu=7)
    v = _judge(r, healthy_node_results)
    assert v.outcome is Outcome.FAIL
    assert v.reason == "slurmguard: sweep1 gpu7 missing +17 more"  # + 2 dtypes, membw, 14 p2p
    assert {c.key for c in v.failures} >= {"device/gpu7", "gemm_bfloat16/gpu7", "p2p/gpu0-gpu7"}
    r7 = node_result("node2", gpus=7)
    v7 = _judge(r7, healthy_node_results)
    assert v7.outcome is Outcome.FAIL and "gpus 7 vs class 8" in v7.reason


def test_errors_in_result_fail_even_with_good_numbers(healthy_node_results):
    r = node_result(
        "node2", errors=[{"where": "gemm float16", "message": "CUDA error: an illegal memory access"}]
    )
    v = _judge(r, healthy_node_results)
    assert v.outcome is Outcome.FAIL
    assert v.reason == "slurmguard: sweep1 error in gemm float16: CUDA error: an illegal memory access"


def test_bootstrap_unsuspected_seeds_suspected_waits(healthy_node_results):
    two = healthy_node_results[:2]
    r = node_result("node2")
    nofloor = SweepPolicy(floors=())  # no reference of any kind

    def judge(res, healthy, **kw):
        return judge_result(res, baseline_for(res, healthy), nofloor, **kw)

    v = judge(r, two, suspected=False)
    assert v.outcome is Outcome.BOOTSTRAP and v.outcome.healthy_sample
    assert v.reason == "slurmguard: sweep1 bootstrap sample (3/3 nodes)"
    v = judge(r, two, suspected=True)
    assert v.outcome is Outcome.INSUFFICIENT_BASELINE and not v.outcome.returns_node
    assert (
        v.reason
        == "slurmguard: sweep1 no reference: class 2/3, peers 0/2, no floor for NVIDIA H100 80GB HBM3"
    )
    assert v.basis == "none"
    # a bad GPU fails even during bootstrap: the node's own GPUs are the reference
    v = judge(node_result("node2", gemm_scale={(1, "float32"): 0.7}), [], suspected=False)
    assert v.outcome is Outcome.FAIL and v.reason == "slurmguard: sweep1 gpu1 gemm_fp32 -30% vs node"
    # fresh cluster: three unsuspected bootstrap samples make a baseline that judges the next
    seeds = [node_result(f"node{i}", finished=10.0 + i) for i in (3, 4, 5)]
    assert _judge(node_result("node6", gemm_scale={(0, "bfloat16"): 0.8}), seeds).outcome is Outcome.FAIL


def test_baseline_math():
    old = node_result("node3", finished=1.0, gemm_scale={(i, "float32"): 2.0 for i in range(8)})
    new = node_result("node3", finished=5.0)
    other = node_result("node4", finished=2.0, gemm_scale={(i, "float32"): 0.5 for i in range(8)})
    broken = node_result("node5", errors=[{"where": "x", "message": "y"}])
    odd = parse_result({**node_doc("node6"), "settings": {**node_doc()["settings"], "gemm_size": 4096}})
    judged = node_result("node2")
    b = compute_baseline(
        [old, new, other, broken, odd, judged],
        hw_class=judged.hw_class,
        kind="node",
        fingerprint=settings_fingerprint(judged),
        exclude_nodes=["node2"],
    )
    assert b.nodes == ("node3", "node4")  # latest per node; errors, other settings, self excluded
    assert b.metrics["gemm_float32/gpu0"].median == pytest.approx((50.0 + 25.0) / 2)
    assert b.metrics["gemm_float32/gpu0"].count == 2
    assert b.devices_per_node == 8


def test_job_crash_timeout_and_bad_output_fail_never_pass(healthy_node_results):
    good = json.dumps(node_doc("node2"))
    b = baseline_for(node_result("node2"), healthy_node_results)

    def j(job):
        return judge_job(job, kind="node", node="node2", baseline=b, policy=POL)

    assert j(JobOutcome("COMPLETED", 0, good)).outcome is Outcome.PASS
    cases = {
        JobOutcome("TIMEOUT", None, good): "slurmguard: sweep1 timed out",
        JobOutcome("FAILED", 3, None): "slurmguard: sweep1 crashed (FAILED exit 3)",
        JobOutcome("NODE_FAIL", None, None): "slurmguard: sweep1 crashed (NODE_FAIL)",
        JobOutcome("CANCELLED by 0", None, None): "slurmguard: sweep1 crashed (CANCELLED)",
        JobOutcome("COMPLETED", 1, good): "slurmguard: sweep1 crashed (exit 1)",
        JobOutcome("COMPLETED", 0, None): "slurmguard: sweep1 no result",
        JobOutcome(
            "COMPLETED", 0, good[: len(good) // 2]
        ): f"slurmguard: sweep1 bad result: invalid JSON at line 1 column {len(good) // 2 + 1}",
        JobOutcome(
            "COMPLETED", 0, good.replace('"membw_gbps": 2800.0', '"membw_gbps": "2800"', 1)
        ): "slurmguard: sweep1 bad result: devices[0].membw_gbps",
        JobOutcome(
            "COMPLETED", 0, json.dumps(node_doc("node3"))
        ): "slurmguard: sweep1 bad result: node of node3",
    }
    for job, reason in cases.items():
        v = j(job)
        assert v.outcome is Outcome.FAIL, job
        assert v.reason == reason
    # a failed job that still wrote its errors gives the error as the reason
    errs = json.dumps(node_doc("node2", errors=[{"where": "membw gpu2", "message": "RuntimeError: ECC"}]))
    assert (
        j(JobOutcome("FAILED", 1, errs)).reason == "slurmguard: sweep1 error in membw gpu2: RuntimeError: ECC"
    )


def _pair_history():
    return [pair_result(f"node{i}", "node1", finished=100.0 + i) for i in (3, 4, 5)]


def test_pair_with_link_slowed_node_under_test_names_that_node():
    hist = _pair_history()
    r = pair_result("node2", "node1", send_scale=0.6, recv_scale=0.62)
    v = judge_result(r, baseline_for(r, hist), POL, ref_status=TRUSTED)
    assert v.outcome is Outcome.FAIL and v.node == "node2" and v.reference == "node1"
    assert v.reason.startswith("slurmguard: sweep2 gpu")
    assert "send" in v.reason and "-40% vs class" in v.reason
    healthy = pair_result("node2", "node1")
    assert judge_result(healthy, baseline_for(healthy, hist), POL, ref_status=TRUSTED).outcome is Outcome.PASS


def test_slow_pair_against_untrusted_reference_is_inconclusive_not_a_drain():
    hist = _pair_history()
    r = pair_result("node2", "node1", send_scale=0.6, recv_scale=0.6)
    untrusted = ReferenceStatus("node1", False, "node1 failed its last own sweep")
    v = judge_result(r, baseline_for(r, hist), POL, ref_status=untrusted)
    assert v.outcome is Outcome.INCONCLUSIVE and not v.outcome.returns_node
    assert v.reason == "slurmguard: sweep2 inconclusive, reference node1 untrusted"
    assert "node1 failed its last own sweep" in v.detail
    # but a pass is a pass: both ends reached class bandwidth
    ok = pair_result("node2", "node1")
    assert judge_result(ok, baseline_for(ok, hist), POL, ref_status=untrusted).outcome is Outcome.PASS


def test_reference_trust_from_history():
    own_pass = PastSweep(node_result("node1", finished=10.0), Outcome.PASS)
    own_fail = PastSweep(node_result("node1", finished=20.0), Outcome.FAIL)
    assert not reference_status("node1", [], POL).trusted
    assert reference_status("node1", [own_pass], POL).trusted
    assert not reference_status("node1", [own_pass, own_fail], POL).trusted
    # two different partners failed against node1 in a row: the reference is the suspect
    f3 = PastSweep(pair_result("node3", "node1", finished=30.0, send_scale=0.5), Outcome.FAIL)
    f4 = PastSweep(pair_result("node4", "node1", finished=40.0, send_scale=0.5), Outcome.FAIL)
    st = reference_status("node1", [own_pass, f3, f4], POL)
    assert not st.trusted and "2 different partners" in st.why
    # the same partner failing twice is that partner's problem; a pass in between resets
    f3b = PastSweep(pair_result("node3", "node1", finished=45.0, send_scale=0.5), Outcome.FAIL)
    assert reference_status("node1", [own_pass, f3, f3b], POL).trusted
    ok5 = PastSweep(pair_result("node5", "node1", finished=35.0), Outcome.PASS)
    assert reference_status("node1", [own_pass, f3, ok5, f4], POL).trusted


def _ring_transfers(n, slow_node=None, slow_link=None, gbps=40.0):
    names = [f"n{i}" for i in range(n)]
    out = []
    for sched, links in (
        ("ring", [(i, (i + 1) % n) for i in range(n)]),
        ("tree", [(c, (c - 1) // 2) for c in range(1, n)]),
    ):
        for s, d in links:
            bw = gbps
            if slow_node in (s, d) or slow_link == (s, d):
                bw *= 0.5
            out.append(Transfer(sched, 0, names[s], 0, names[d], 0, 64, 64 * 2**20 / bw / 1e9, bw))
    return out


def test_localize_links_names_the_slow_node_not_its_neighbours():
    d = localize_links(_ring_transfers(8, slow_node=5), POL)
    assert d.suspect_nodes == ("n5",)
    assert d.slow_links == ()
    d = localize_links(_ring_transfers(8, slow_link=(2, 3)), POL)
    assert d.suspect_nodes == () and d.slow_links == (("n2", "n3"),)
    assert localize_links(_ring_transfers(8), POL).suspect_nodes == ()


def test_judge_multi_fails_only_the_suspect():
    doc = pair_doc("n0", "n1")
    doc.update(
        kind="multi",
        nodes=[f"n{i}" for i in range(6)],
        reference=None,
        transfers=[t.__dict__ for t in _ring_transfers(6, slow_node=2)],
    )
    verdicts = {v.node: v for v in judge_multi(parse_result(doc), POL)}
    assert verdicts["n2"].outcome is Outcome.FAIL and verdicts["n2"].reason.startswith(
        "slurmguard: sweep6 gpu0 link n2-"
    )
    assert all(v.outcome is Outcome.PASS for n, v in verdicts.items() if n != "n2")


def test_reason_is_safe_and_bounded():
    r = make_reason("sweep1 error in x: 'quoted' \"text\"; rm -rf / $(boom)\n" + "y" * 300)
    assert r.startswith("slurmguard: sweep1 error in x: ?quoted? ?text?? rm -rf / ?(boom) y")
    assert len(r) <= 120 and "\n" not in r and "'" not in r and "$" not in r and ";" not in r
