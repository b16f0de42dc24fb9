"""The CPU-cap fault (slurmguard_dev.devcluster.fault) on the real local cluster, and
its cgroup v2 path on a directory laid out like a cgroup2 mount (this host's v2
tree has no cpu controller)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from slurmguard_dev.devcluster import ClusterSpec, DevCluster
from slurmguard_dev.devcluster.fault import (
    PARENT,
    CgroupCpu,
    FaultError,
    active_faults,
    apply_cpu_cap,
    clear_fault,
    find_cpu_cgroup,
)
from tests.fixtures.common import wait_for

# a pure-Python CPU-bound loop: prints "<seconds since start> <seconds per chunk>"
BURN = """
import sys, time
t0 = time.time(); end = t0 + float(sys.argv[1])
while time.time() < end:
    a = time.perf_counter(); s = 0
    for i in range(100000):
        s += i
    print(f"{time.time() - t0:.3f} {time.perf_counter() - a:.5f}", flush=True)
"""


def test_find_cpu_cgroup_prefers_v1_cpu_and_falls_back_to_v2(tmp_path):
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n"
        f"cgroup2 {v2} cgroup2 rw,relatime 0 0\n"
    )
    assert find_cpu_cgroup(mounts) == CgroupCpu(v2, 2)
    mounts.write_text(mounts.read_text() + "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n")
    assert find_cpu_cgroup(mounts) == CgroupCpu(Path("/sys/fs/cgroup/cpu"), 1)
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    mounts.write_text(f"cgroup2 {v2} cgroup2 rw,relatime 0 0\n")
    with pytest.raises(FaultError, match="cpu controller"):
        find_cpu_cgroup(mounts)


def test_v2_cap_enables_cpu_down_the_tree_and_writes_cpu_max(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    cg = CgroupCpu(tmp_path, 2)
    # a real cgroupfs creates this file in every new directory; a plain one does not
    (tmp_path / PARENT).mkdir()
    (tmp_path / PARENT / "cgroup.subtree_control").write_text("")
    parent = cg.prepare_parent()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu"
    group = parent / "abc-node2"
    group.mkdir()
    cg.cap(group, 30)
    assert (group / "cpu.max").read_text() == "30000 100000"
    cg.cap(group, 0.2)  # below the kernel's 1 ms minimum quota
    assert (group / "cpu.max").read_text() == "1000 100000"


def _chunk_times(out: Path, node_index: int) -> list[tuple[float, float]]:
    rows = []
    for line in out.read_text().splitlines():
        label, _, rest = line.partition(": ")
        if label.strip() == str(node_index) and len(rest.split()) == 2:
            t, dt = rest.split()
            rows.append((float(t), float(dt)))
    return rows


@pytest.mark.slurm
@pytest.mark.slow
def test_cpu_cap_slows_a_running_step_and_clear_restores_it(clean_cluster, tmp_path):
    """~35 s: a CPU-bound step on 2 nodes; node B capped at 20% of a CPU for 10 s, then cleared."""
    c = clean_cluster
    burn = tmp_path / "burn.py"
    burn.write_text(BURN)
    out = tmp_path / "burn.out"
    job = c.sbatch(
        f"#!/bin/bash\nsrun -l {sys.executable} {burn} 30\n", "-N2", "--ntasks-per-node=1", "-o", str(out)
    )
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) > 40, 60, "the step to run")
    nodes = c.run(["squeue", "-h", "-j", str(job), "-o", "%N"]).stdout.strip()
    from slurmguard.slurm.hostlist import expand

    slow = expand(nodes)[1]  # task 1 runs on the job's second node
    t_on = _elapsed(out)
    cap = apply_cpu_cap(c, slow, 20)
    assert cap.moved >= 3  # slurmd, the step's slurmstepd, the task
    assert set(active_faults(c)) == {slow}
    assert (Path(cap.cgroup) / "cgroup.procs").read_text().split()
    time.sleep(10)
    t_off = _elapsed(out)
    assert clear_fault(c, slow)
    assert not Path(cap.cgroup).exists() and active_faults(c) == {}
    assert not clear_fault(c, slow)  # nothing left to clear
    time.sleep(8)
    t_end = _elapsed(out)
    assert c.wait_job(job, timeout=60) == "COMPLETED"
    # seconds per chunk as wall time over chunks done: a chunk (~15 ms) is shorter
    # than the CFS period (100 ms), so the cap shows in the pauses between chunks
    rows = _chunk_times(out, 1)
    before = _per_chunk(rows, 0, t_on)
    during = _per_chunk(rows, t_on + 1, t_off)
    after = _per_chunk(rows, t_off + 1, t_end)
    other = _per_chunk(_chunk_times(out, 0), t_on + 1, t_off)
    # both "nodes" share this host's cores with the cluster's daemons, so its load drifts
    # over the step: the cleared node is judged against the uncapped one in the same window
    other_after = _per_chunk(_chunk_times(out, 0), t_off + 1, t_end)
    print(
        f"\nwall per chunk on {slow}: {before * 1e3:.1f} ms -> capped 20% {during * 1e3:.1f} ms "
        f"-> cleared {after * 1e3:.1f} ms; uncapped peer {other * 1e3:.1f} ms, then {other_after * 1e3:.1f} ms"
    )
    assert during >= 2.0 * before
    assert during >= 2.0 * other
    assert after <= 1.5 * max(before, other_after)
    assert other <= 1.5 * before  # the other node is not touched


def _elapsed(out: Path) -> float:
    """Seconds since the step started, from its newest line."""
    return float(out.read_text().splitlines()[-1].split()[1])


def _per_chunk(rows: list[tuple[float, float]], t0: float, t1: float) -> float:
    ts = [t for t, _ in rows if t0 <= t <= t1]
    return (ts[-1] - ts[0]) / (len(ts) - 1)


@pytest.mark.slurm
@pytest.mark.slow
def test_new_steps_inherit_the_cap_and_down_removes_it(tmp_path):
    """~10 s: a private 1-node cluster (down must clean up) shares the host with others."""
    c = DevCluster(ClusterSpec(state_dir=tmp_path / "c", nodes=1))
    c.up()
    try:
        cap = apply_cpu_cap(c, "node1", 50)
        assert Path(cap.cgroup).name.endswith("-node1")
        res = c.run(["srun", "-N1", "cat", "/proc/self/cgroup"], timeout=60)
        assert res.returncode == 0, res.stderr
        # v1: the "N:cpu:/..." line; v2: "0::/..."
        assert any(line.endswith(f"/{PARENT}/{Path(cap.cgroup).name}") for line in res.stdout.splitlines()), (
            res.stdout
        )
        with pytest.raises(FaultError, match="no node 'node9'"):
            apply_cpu_cap(c, "node9", 50)
        with pytest.raises(FaultError, match="percentage of one CPU"):
            apply_cpu_cap(c, "node1", 0)
    finally:
        c.down()
    assert not Path(cap.cgroup).exists()
    assert active_faults(c) == {}
