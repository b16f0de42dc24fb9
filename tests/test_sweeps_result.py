import json
import math

import pytest

from slurmguard.sweeps.result import ResultError, load_result, parse_result, parse_result_text
from tests.fixtures.sweeps import node_doc, pair_doc


def test_round_trip_keeps_every_field():
    r = parse_result(node_doc("node4"), "x")
    assert r.kind == "node" and r.label == "sweep1" and r.devices_per_node == 8
    assert r.devices[5].gemm[1].dtype == "bfloat16" and r.devices[5].gemm[1].tflops == 700.0
    again = parse_result_text(r.to_json(), "y")
    assert again == r
    p = parse_result(pair_doc("node2", "node1"), "x")
    assert p.label == "sweep2" and p.reference == "node1" and len(p.transfers) == 2 * 2 * 8


@pytest.mark.parametrize(
    "mutate, path, message",
    [
        (lambda d: d.pop("devices"), "$.devices", "missing"),
        (lambda d: d.update(extra=1), "$.extra", "unknown key"),
        (lambda d: d.update(version=2), "$.version", "unsupported schema version 2"),
        (lambda d: d.update(kind="burnin"), "$.kind", "expected one of"),
        (
            lambda d: d.update(nodes=["node1;rm -rf /"], node_under_test="node1;rm -rf /"),
            "$.nodes[0]",
            "invalid node name",
        ),
        (
            lambda d: d["devices"][3]["gemm"][1].update(tflops="fast"),
            "$.devices[3].gemm[1].tflops",
            "expected a number, got string",
        ),
        (lambda d: d["devices"][3]["gemm"][1].update(tflops=-1.0), "$.devices[3].gemm[1].tflops", ">= 0"),
        (lambda d: d["devices"][0].update(membw_gbps=True), "$.devices[0].membw_gbps", "got boolean"),
        (lambda d: d["devices"][0].update(index=9), "$.devices[0].index", "out of range"),
        (lambda d: d.update(finished=0.0), "$.finished", "finished before it started"),
        (lambda d: d.update(node_under_test="node9"), "$.node_under_test", "not one of"),
        (lambda d: d.update(reference="node1"), "$.reference", "must be another node"),
        (lambda d: d["p2p"][0].update(dst=d["p2p"][0]["src"]), "$.p2p[0].dst", "two different GPUs"),
    ],
)
def test_malformed_results_name_the_json_path(mutate, path, message):
    d = node_doc("node1")
    mutate(d)
    with pytest.raises(ResultError) as exc:
        parse_result(d, "r.json")
    assert exc.value.path == path
    assert message in str(exc.value) and str(exc.value).startswith(f"r.json: {path}: ")


def test_pair_needs_reference_and_two_nodes():
    d = pair_doc()
    d["reference"] = None
    with pytest.raises(ResultError, match=r"\$.reference: a pair sweep names its reference"):
        parse_result(d, "r")
    d = pair_doc()
    d["nodes"] = ["node2"]
    with pytest.raises(ResultError, match=r"\$.nodes: a pair sweep has 2"):
        parse_result(d, "r")


def test_text_level_failures(tmp_path):
    for text, needle in [
        ("", "empty result"),
        ('{"schema": 1', "invalid JSON at line 1"),
        (b"\xff\xfe", "not UTF-8"),
        ("[]", "expected an object, got list"),
        (json.dumps(node_doc()).replace('"tflops": 700.0', '"tflops": NaN', 1), "invalid JSON constant NaN"),
    ]:
        with pytest.raises(ResultError, match=needle):
            parse_result_text(text, "r")
    with pytest.raises(ResultError, match="no result file"):
        load_result(str(tmp_path / "missing.json"))
    assert not math.isnan(parse_result_text(json.dumps(node_doc())).devices[0].gemm[0].tflops)
