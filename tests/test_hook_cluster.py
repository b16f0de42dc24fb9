"""The SPANK plugin on the real local cluster, installed through
plugstack.conf: the option, guarded/unguarded torch DDP jobs over two
nodes, the environment the tasks get, ring directory ownership, and a
broken plugstack line."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from slurmguard.hook import ring
from tests.fixtures.security import traversable

pytestmark = pytest.mark.slurm

TRAIN = textwrap.dedent("""
    import hashlib, os, sys
    from slurmguard.rendezvous import rdzv_id
    print("TASK", os.environ["SLURM_PROCID"], "LD_PRELOAD=" + os.environ.get("LD_PRELOAD", ""),
          "RDZV=" + rdzv_id(),
          "PYTHONPATH=" + os.environ.get("PYTHONPATH", ""),
          "SG=" + ",".join(sorted(k for k in os.environ if k.startswith("SLURMGUARD_"))),
          flush=True)
    import torch, torch.distributed as dist
    from slurmguard.rendezvous import init_process_group
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_process_group("gloo", rank, world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(128, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range({steps}):
        opt.zero_grad()
        model(torch.randn(16, 128, generator=gen)).pow(2).mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print("PARAMS", rank, digest.hexdigest(), flush=True)
    # done and recorded: end without interpreter finalisation (gloo's
    # upstream teardown race, pytorch issue 190489)
    from slurmguard.teardown import finish
    finish(0)
""")

STEPS = 8
DDP_COUNT = 128 * 128 + 128


@pytest.fixture(scope="module")
def guard(devcluster, spank_build):
    """The plugin installed with a ring root of our own; removed after."""
    root = Path(tempfile.mkdtemp(prefix="sg-hook-", dir="/dev/shm"))
    os.chmod(root, 0o755)
    line = (
        f"optional {spank_build.plugin} nccl_hook={spank_build.hook} "
        f"torch_hook={spank_build.torch_site} ring_root={root}/rings ring_records=4096\n"
    )
    devcluster.set_plugstack(line)
    yield {"root": root / "rings", "line": line, "build": spank_build}
    devcluster.set_plugstack("")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def outdir():
    """A directory every job user (root, nobody) can write its output to."""
    d = Path(tempfile.mkdtemp(prefix="sg-hook-out-"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_batch(cluster, script: str, out: Path, *args: str, timeout: float = 240) -> tuple[int, str, str]:
    # the time limit (min) ends a job that hangs before the test gives up on it
    jid = cluster.sbatch(script, "-o", str(out), "--time=3", *args)
    state = cluster.wait_job(jid, timeout=timeout)
    text = out.read_text() if out.exists() else ""
    return jid, state, text


def ddp_script(tmp: Path) -> str:
    train = tmp / "train.py"
    train.write_text(TRAIN.format(steps=STEPS))
    os.chmod(train, 0o644)
    return textwrap.dedent(f"""\
        #!/bin/bash
        export MASTER_ADDR=127.0.0.1
        srun --kill-on-bad-exit=1 bash -c \\
          'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec {sys.executable} {train}'
        """)


def tasks(output: str) -> dict[str, dict[str, str]]:
    found = {}
    for line in output.splitlines():
        if line.startswith("TASK "):
            parts = line.split(" ")
            found[parts[1]] = dict(p.split("=", 1) for p in parts[2:])
    return found


def params(output: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^PARAMS (\d+) (\w+)$", output, re.MULTILINE)}


def test_option_in_help(devcluster, guard):
    for cmd in ("sbatch", "srun", "salloc"):
        res = devcluster.run([cmd, "--help"])
        assert res.returncode == 0
        assert "--straggler-guard" in res.stdout, f"{cmd} --help:\n{res.stdout[-1500:]}"


def test_guarded_and_unguarded_ddp_over_two_nodes(devcluster, guard, tmp_path):
    script = ddp_script(tmp_path)
    wall0 = time.time_ns()
    jid, state, out = run_batch(
        devcluster, script, tmp_path / "guarded.out", "-N2", "-n2", "--straggler-guard"
    )
    wall1 = time.time_ns()
    assert state == "COMPLETED", out
    hook, site = str(guard["build"].hook), str(guard["build"].torch_site)
    t = tasks(out)
    assert set(t) == {"0", "1"}
    # one rendezvous for the step, named after its srun: job ids repeat across
    # the dev clusters sharing this host
    assert t["0"]["RDZV"] == t["1"]["RDZV"]
    assert re.fullmatch(rf"slurm-{jid}\.0\.0-\w+@[\w.-]+:\d+", t["0"]["RDZV"]), t["0"]["RDZV"]
    for env in t.values():
        assert env["LD_PRELOAD"] == hook and env["PYTHONPATH"] == site
        assert env["SG"] == (
            "SLURMGUARD_JOB_ID,SLURMGUARD_NCCL_HOOK,SLURMGUARD_RING_DIR,"
            "SLURMGUARD_RING_RECORDS,SLURMGUARD_STEP_ID"
        )

    job_dir = guard["root"] / str(jid)
    assert sorted(os.listdir(job_dir)) == ["rank-0.step-0.torch.ring", "rank-1.step-0.torch.ring"]
    nodes = set()
    ddp_starts = []
    for rank in (0, 1):
        with ring.RingReader(str(job_dir / f"rank-{rank}.step-0.torch.ring")) as r:
            h = r.refresh_header()
            recs = r.read().records
        assert (h.job_id, h.step, h.global_rank, h.world_size, h.capacity) == (jid, "0", rank, 2, 4096)
        nodes.add(h.node_name)
        assert recs[0].op_name == "comm_init" and recs[0].count == 2 and recs[0].peer == rank
        ddp = [x for x in recs if x.op_name == "allreduce" and x.count == DDP_COUNT]
        # the all-reduce pattern: one gradient bucket per step, summed float32
        assert len(ddp) == STEPS
        assert all(x.bytes == 4 * DDP_COUNT and x.redop == ring.REDOP["sum"] for x in ddp)
        # plausible times: inside the job's wall-clock window, steps in order,
        # each all-reduce well under the step budget
        for x in recs:
            assert wall0 <= x.start_ns + h.clock_offset_ns <= x.end_ns + h.clock_offset_ns <= wall1
        starts = sorted(x.start_ns for x in ddp)
        assert all(b > a for a, b in zip(starts, starts[1:]))
        assert all(x.duration_ns < 5e9 for x in ddp)
        ddp_starts.append(starts)
    assert nodes == {"node1", "node2"}
    # both ranks' step k all-reduces start within a second of each other
    for a, b in zip(*ddp_starts):
        assert abs(a - b) < 1e9

    # the same job without the flag: no rings, environment untouched
    jid2, state2, out2 = run_batch(devcluster, script, tmp_path / "plain.out", "-N2", "-n2")
    assert state2 == "COMPLETED", out2
    assert not (guard["root"] / str(jid2)).exists()
    for env in tasks(out2).values():
        assert env["LD_PRELOAD"] == "" and site not in env["PYTHONPATH"] and env["SG"] == ""
    # and the guard changed no result
    assert params(out) == params(out2) and len(params(out)) == 2


def test_user_ld_preload_is_kept(devcluster, guard, outdir):
    user_lib = "/lib/x86_64-linux-gnu/libm.so.6"
    probe = "#!/bin/bash\nsrun bash -c 'echo \"PRELOAD=$LD_PRELOAD\"'\n"
    env_arg = f"--export=ALL,LD_PRELOAD={user_lib}"
    _, state, out = run_batch(devcluster, probe, outdir / "a.out", "-N1", "--straggler-guard", env_arg)
    assert state == "COMPLETED", out
    assert f"PRELOAD={guard['build'].hook}:{user_lib}" in out.splitlines()
    _, state, out = run_batch(devcluster, probe, outdir / "b.out", "-N1", env_arg)
    assert state == "COMPLETED", out
    assert f"PRELOAD={user_lib}" in out.splitlines()


@pytest.fixture
def traversable_spool(devcluster):
    """Let other users reach their batch scripts in the cluster's spool (the
    session cluster lives under pytest's 0700 temp dir)."""
    with traversable(Path(devcluster.state_dir) / "spool"):
        yield


def test_guarded_non_torch_job_as_other_user(devcluster, guard, outdir, traversable_spool):
    """A shell job as nobody runs normally; its ring dir is nobody's, 0700,
    and writable by the job; the user cannot redirect it."""
    nobody = pwd.getpwnam("nobody")
    script = textwrap.dedent("""\
        #!/bin/bash
        echo "who=$(id -un) dir=$SLURMGUARD_RING_DIR"
        stat -c 'owner=%U mode=%a' "$SLURMGUARD_RING_DIR"
        touch "$SLURMGUARD_RING_DIR/probe" && echo writable=yes
        """)
    jid, state, out = run_batch(
        devcluster,
        script,
        outdir / "n.out",
        "-N1",
        "--straggler-guard",
        "--uid=nobody",
        "--gid=nogroup",
        f"--chdir={outdir}",
        "--export=ALL,SLURMGUARD_RING_DIR=/tmp/evil",
    )
    assert state == "COMPLETED", out
    job_dir = guard["root"] / str(jid)
    lines = out.splitlines()
    assert f"who=nobody dir={job_dir}" in lines
    assert "owner=nobody mode=700" in lines and "writable=yes" in lines
    st = os.stat(job_dir)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (nobody.pw_uid, nobody.pw_gid, 0o700)
    assert not Path("/tmp/evil").exists()


def test_step_can_opt_out_inside_a_guarded_job(devcluster, guard, outdir):
    script = textwrap.dedent("""\
        #!/bin/bash
        echo "batch=${LD_PRELOAD:-none}"
        srun bash -c 'echo "step=${LD_PRELOAD:-none},${SLURMGUARD_RING_DIR:-none}"'
        srun --straggler-guard=off bash -c 'echo "optout=${LD_PRELOAD:-none},${SLURMGUARD_RING_DIR:-none}"'
        """)
    jid, state, out = run_batch(devcluster, script, outdir / "o.out", "-N1", "--straggler-guard")
    assert state == "COMPLETED", out
    hook = str(guard["build"].hook)
    lines = out.splitlines()
    assert f"batch={hook}" in lines
    assert f"step={hook},{guard['root'] / str(jid)}" in lines
    assert "optout=none,none" in lines


def test_bad_plugstack_line_never_breaks_jobs(devcluster, guard, outdir):
    bad = guard["line"].replace("ring_records=4096", "ring_records=4096 colour=blue")
    devcluster.set_plugstack(bad)
    try:
        _, state, out = run_batch(
            devcluster,
            "#!/bin/bash\necho ran-${SLURMGUARD_RING_DIR:-unguarded}\n",
            outdir / "bad.out",
            "-N1",
            "--straggler-guard",
        )
    finally:
        devcluster.set_plugstack(guard["line"])
    assert state == "COMPLETED" and "ran-unguarded" in out
    log = "".join(p.read_text(errors="replace") for p in devcluster.log_dir.glob("slurmd-*.log"))
    assert "slurmguard: plugstack.conf: unknown argument 'colour=blue'" in log


def test_partition_default_on_without_opt_out(devcluster, guard, outdir):
    """default=on for the job's partition guards jobs that do not ask; with
    allow_opt_out=no, =off is refused at submission with a clear message."""
    strict = guard["line"].replace(
        "ring_records=4096",
        f"ring_records=4096 default=on allow_opt_out=no partitions={devcluster.partition}",
    )
    devcluster.set_plugstack(strict)
    try:
        jid, state, out = run_batch(
            devcluster, "#!/bin/bash\necho dir=${SLURMGUARD_RING_DIR:-none}\n", outdir / "d.out", "-N1"
        )
        res = devcluster.run(["sbatch", "--parsable", "-N1", "--straggler-guard=off", "--wrap", "true"])
    finally:
        devcluster.set_plugstack(guard["line"])
    assert state == "COMPLETED" and f"dir={guard['root'] / str(jid)}" in out
    assert res.returncode != 0
    assert "slurmguard: --straggler-guard=off: opting out is not allowed on this cluster" in res.stderr
