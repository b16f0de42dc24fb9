"""The prolog and epilog installed in the real development cluster (Slurm 22.05).

The slot scripts exec a per-test wrapper that points the real
prolog_epilog/slurmguard-{prolog,epilog} at a test policy through an env
file, exactly as /etc/default/slurmguard does on a site.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import wait_for as _wait
from tests.fixtures.prolog import RECORD_SIZE, ROOT, fake_ib

pytestmark = pytest.mark.slurm

PROLOG = ROOT / "prolog_epilog" / "slurmguard-prolog"
EPILOG = ROOT / "prolog_epilog" / "slurmguard-epilog"


def _install(tmp_path: Path, hook: Path, policy_text: str) -> Path:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text)
    env_file = tmp_path / "slurmguard.env"
    env_file.write_text(f"SLURMGUARD_POLICY={policy}\nSLURMGUARD_PYTHON={sys.executable}\n")
    slot = tmp_path / f"slot-{hook.name}"
    slot.write_text(f'#!/bin/sh\nSLURMGUARD_ENV_FILE={env_file} exec {hook} "$@"\n')
    slot.chmod(0o755)
    return slot


def _reason(cluster, node: str) -> str:
    res = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"])
    return res.stdout.strip()


def test_failing_prolog_drains_the_node_and_healthy_prolog_runs_the_job(clean_cluster, tmp_path):
    c = clean_cluster
    ib = fake_ib(
        tmp_path / "ib", {"mlx5_0:1": {"state": "1: DOWN", "phys_state": "3: Disabled"}, "mlx5_1:1": {}}
    )
    # expected_gpus left null: read from the cluster's slurm.conf (no Gres: 0 GPUs), and NVML
    # on a host without the driver is then healthy
    slot = _install(tmp_path, PROLOG, f"prolog:\n  ib_sysfs_root: {ib}\n")
    c.set_prolog(slot)
    try:
        log = c.log_dir / "slurmd-node2.log"
        log_before = log.read_text() if log.exists() else ""
        job = c.sbatch("#!/bin/sh\ntrue\n", "-w", "node2", "-o", "/dev/null")
        state = _wait(
            lambda: (s := _reason(c, "node2")) and "drain" in s.split("|")[0] and s,
            60,
            "node2 drained by the prolog",
        )
        assert state.split("|")[1].startswith("Prolog error"), state
        new_log = log.read_text()[len(log_before) :]
        assert (
            "prolog failed: rc:1 output:slurmguard-prolog: node2: nic_link: mlx5_0:1: link down "
            "(port not ACTIVE, phys_state 3: Disabled)"
        ) in new_log
        assert "internal error" not in new_log  # GPU count found in $SLURM_CONF, policy read
        # Slurm requeues the batch job and holds it (launch_failed_requeued_held)
        info = _wait(
            lambda: (
                (t := c.run(["scontrol", "show", "job", "-o", str(job)]).stdout)
                and "JobState=PENDING" in t
                and t
            ),
            30,
            "the job requeued and held",
        )
        assert "Restarts=1" in info and "launch_failed_requeued_held" in info, info
        c.run(["scancel", str(job)])

        # the port comes back: the same prolog passes and the job runs on node2
        (ib / "mlx5_0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
        (ib / "mlx5_0" / "ports" / "1" / "phys_state").write_text("5: LinkUp\n")
        c.run(["scontrol", "update", "NodeName=node2", "State=RESUME"])
        c.wait_nodes_idle(timeout=60)
        job = c.sbatch(
            "#!/bin/sh\necho ran on $SLURMD_NODENAME\n", "-w", "node2", "-o", str(tmp_path / "out-%j")
        )
        assert c.wait_job(job, timeout=60) == "COMPLETED"
        assert (tmp_path / f"out-{job}").read_text() == "ran on node2\n"
        assert "drain" not in _reason(c, "node2")
    finally:
        c.set_prolog(None)


def test_epilog_archives_each_nodes_rings_and_removes_the_ring_dir(clean_cluster, tmp_path):
    c = clean_cluster
    ring_root = tmp_path / "shm"
    ring_root.mkdir()
    ring_root.chmod(0o755)
    store = tmp_path / "traces"
    slot = _install(
        tmp_path,
        EPILOG,
        f"agent:\n  ring_root: {ring_root}\n"
        f"prolog:\n  trace_store: {store}\n  min_free_mb: 0\n"
        # every slurmd of the dev cluster shares this ring root
        f"  ring_root_shared: true\n",
    )
    c.set_epilog(slot)
    # each task writes the ring its rank would have, named for its node, into the shared dir
    writer = f"""import os, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
from tests.fixtures.prolog import write_ring
job, node, rank = int(os.environ["SLURM_JOB_ID"]), os.environ["SLURMD_NODENAME"], int(os.environ["SLURM_PROCID"])
d = Path({str(ring_root)!r}) / str(job)
write_ring(d / f"rank-{{rank}}.step-0.torch.ring", node=node, job_id=job, rank=rank, world_size=2)
if rank == 0:
    (d / "stray.txt").write_text("not a ring")
"""
    (tmp_path / "writer.py").write_text(writer)
    try:
        job = c.sbatch(
            f"#!/bin/sh\nsrun -N2 --ntasks-per-node=1 {sys.executable} {tmp_path / 'writer.py'}\n",
            "-N2",
            "-w",
            "node1,node3",
            "-o",
            str(tmp_path / "out-%j"),
        )
        assert c.wait_job(job, timeout=90) == "COMPLETED", (tmp_path / f"out-{job}").read_text()
        _wait(
            lambda: (
                not (ring_root / str(job)).exists()
                and (store / str(job) / "node1" / "manifest.json").exists()
                and (store / str(job) / "node3" / "manifest.json").exists()
            ),
            30,
            "both epilogs",
        )
        manifests = {
            n: json.loads((store / str(job) / n / "manifest.json").read_text()) for n in ("node1", "node3")
        }
        for rank, node in ((0, "node1"), (1, "node3")):
            m = manifests[node]
            assert (m["job_id"], m["node"], m["errors"]) == (job, node, [])
            assert [(f["name"], f["global_rank"], f["node"], f["bytes"]) for f in m["files"]] == [
                (f"rank-{rank}.step-0.torch.ring", rank, node, 4096 + 16 * RECORD_SIZE)
            ]
            assert (
                store / str(job) / node / f"rank-{rank}.step-0.torch.ring"
            ).stat().st_size == 4096 + 16 * RECORD_SIZE
        # the non-ring file is counted by the epilog(s) that saw it, never archived
        assert any(
            s["name"] == "stray.txt" and s["reason"].startswith("bad magic")
            for m in manifests.values()
            for s in m["skipped"]
        )
        first = [m for m in manifests.values() if m["left_for_other_nodes"]]
        assert len(first) == 1 and list(first[0]["left_for_other_nodes"].values()) == [1]
        states = c.node_states()
        assert not any("drain" in states[n] for n in ("node1", "node3")), states
    finally:
        c.set_epilog(None)
