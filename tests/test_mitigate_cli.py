"""`slurmguard plan ...` and `slurmguard bench plan` through the real entry point."""

from __future__ import annotations

import json

import pytest

from slurmguard.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as ex:
        main(list(argv))
    out, err = capsys.readouterr()
    return ex.value.code or 0, out, err


def test_microbatch_prints_plan_json(capsys):
    rc, out, _ = run(capsys, "plan", "microbatch", "--times", "1,1,3", "--microbatches", "16")
    assert rc == 0
    assert json.loads(out) == {"m": [7, 7, 2], "makespan": 7.0}


def test_microbatch_pp_variant_and_milp_agree(capsys):
    args = ["plan", "microbatch", "--times", "1,1,2,2", "--microbatches", "16", "--pp", "2"]
    rc, out, _ = run(capsys, *args)
    assert rc == 0 and json.loads(out) == {"m": [6, 6, 2, 2], "makespan": 6.0}
    pytest.importorskip("cvxpy")
    rc, out2, _ = run(capsys, *args, "--method", "milp")
    assert rc == 0 and json.loads(out2)["makespan"] == 6.0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--times", "1,abc", "--microbatches", "4"], "--times: item 2 'abc' is not a number"),
        (["--times", "1,2,3", "--microbatches", "2"], "cannot give each of 3 DP groups"),
        (["--times", "1,-1", "--microbatches", "4"], "item 2 '-1' must be a positive number"),
        (["--times", "1,1", "--microbatches", "x"], "--microbatches: 'x' is not an integer"),
        (["--times", "1,1", "--microbatches", "5", "--pp", "2"], "not a multiple of pp=2"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    rc, out, err = run(capsys, "plan", "microbatch", *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("slurmguard: error:")


def test_consolidate_and_swap(capsys):
    rc, out, _ = run(
        capsys, "plan", "consolidate", "--stages", "4", "--per-stage", "4", "--stragglers", "w1,w6"
    )
    assert rc == 0
    res = json.loads(out)
    assert res["stages_needed"] == 1 and res["stages_after"] == [1] and res["swaps"] == [["w1", "w5"]]
    rc, out, _ = run(capsys, "plan", "swap", "--layout", "n1,n2;n3,n4", "--link", "n3-n4")
    assert rc == 0
    res = json.loads(out)
    assert res["before"][0]["carries"] == "dp" and res["after"][0]["carries"] != "dp"
    rc, _, err = run(capsys, "plan", "swap", "--layout", "n1,n2;n3", "--link", "n1-n2")
    assert rc == 2 and "stage 1 has 1 workers" in err
    rc, _, err = run(capsys, "plan", "swap", "--layout", "n1,n2;n3,n4", "--link", "n1n2")
    assert rc == 2 and "--link 'n1n2'" in err


def test_escalation_table_uses_policy_costs(capsys, tmp_path):
    rc, out, _ = run(capsys, "plan", "escalation", "--slow", "1.5", "--healthy", "1", "--gpus", "8")
    assert rc == 0
    tiers = json.loads(out)["tiers"]
    assert [(t["action"], t["after_iterations"]) for t in tiers] == [
        ("rebalance", 15),
        ("retopology", 150),
        ("drain_checkpoint", 450),
        ("requeue", 900),
    ]
    pol = tmp_path / "p.yaml"
    pol.write_text("response:\n  escalation:\n    rebalance_gpu_s: 8.0\n")
    rc, out, _ = run(
        capsys,
        "--policy",
        str(pol),
        "plan",
        "escalation",
        "--slow",
        "1.5",
        "--healthy",
        "1",
        "--gpus",
        "8",
        "--cause",
        "compute",
    )
    assert rc == 0 and json.loads(out)["tiers"][0]["after_iterations"] == 2


def test_bench_plan_small_sizes_match(capsys):
    pytest.importorskip("cvxpy")
    rc, out, _ = run(
        capsys,
        "bench",
        "plan",
        "--min-groups",
        "16",
        "--max-groups",
        "32",
        "--max-cvxpy-groups",
        "32",
        "--repeats",
        "2",
        "--json",
    )
    assert rc == 0
    rows = json.loads(out)
    assert [r["groups"] for r in rows] == [16, 32]
    assert all(r["match"] is True and r["makespan"] < r["uniform_makespan"] for r in rows)
