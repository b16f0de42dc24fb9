"""Sweep jobs rendered from the shipped templates, submitted to the real local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmguard.config import SweepPolicy
from slurmguard.sweeps.local import free_port
from slurmguard.sweeps.result import load_result
from slurmguard.sweeps.templates import SweepJobSpec, render_sweep_script
from slurmguard.sweeps.verdict import JobOutcome, Outcome, judge_job

pytestmark = pytest.mark.slurm

POL = SweepPolicy(device="cpu")
SMALL = (
    "--device",
    "cpu",
    "--duration",
    "0.5",
    "--gemm-size",
    "96",
    "--dtypes",
    "float32",
    "--membw-bytes",
    str(2 << 20),
    "--message-sizes-mb",
    "1",
    "--repeats",
    "2",
    "--threads",
    "1",
    "--comm-timeout",
    "60",
)


def _submit(cluster, spec: SweepJobSpec) -> tuple[int, str, str]:
    script = render_sweep_script(spec, POL)
    jid = cluster.sbatch(script)
    state = cluster.wait_job(jid, timeout=180)
    log = Path(spec.log_path)
    return jid, state, log.read_text() if log.exists() else ""


def test_node_sweep_job_writes_a_valid_result(clean_cluster, tmp_path):
    out, log = tmp_path / "node3.json", tmp_path / "node3.log"
    spec = SweepJobSpec(
        "node",
        ("node3",),
        str(out),
        str(log),
        time_limit_min=5,
        partition=clean_cluster.partition,
        extra_args=SMALL,
    )
    jid, state, text = _submit(clean_cluster, spec)
    assert state == "COMPLETED", text[-2000:]
    r = load_result(str(out))
    assert (r.kind, r.node_under_test, r.device, r.job_id) == ("node", "node3", "cpu", str(jid))
    v = judge_job(
        JobOutcome(state, 0, out.read_text(), str(out)),
        kind="node",
        node="node3",
        baseline=None,
        policy=POL,
        suspected=False,
    )
    assert v.outcome is Outcome.BOOTSTRAP, v.detail


def test_pair_sweep_job_across_two_nodes(clean_cluster, tmp_path):
    out, log = tmp_path / "pair.json", tmp_path / "pair.log"
    spec = SweepJobSpec(
        "pair",
        ("node2", "node1"),
        str(out),
        str(log),
        time_limit_min=5,
        partition=clean_cluster.partition,
        master_addr="127.0.0.1",
        master_port=free_port(),
        extra_args=SMALL,
    )
    jid, state, text = _submit(clean_cluster, spec)
    assert state == "COMPLETED", text[-2000:]
    r = load_result(str(out))
    assert (r.kind, r.node_under_test, r.reference) == ("pair", "node2", "node1")
    assert set(r.nodes) == {"node1", "node2"} and r.job_id == str(jid)
    assert {(t.src_node, t.dst_node) for t in r.transfers} == {("node1", "node2"), ("node2", "node1")}
