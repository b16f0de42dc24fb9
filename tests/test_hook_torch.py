"""The torch.distributed hook, without Slurm: 2-process gloo jobs on
localhost with and without the hook's environment, in subprocesses (the
hook registers dispatcher kernels, which must not leak into this process).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurmguard.hook import ring

pytestmark = pytest.mark.slow

JOB = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=gen)).pow(2).sum().backward()
        opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    t = torch.arange(10, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t
    t2 = torch.ones(5, dtype=torch.int32) * (rank + 1)
    dist.all_reduce(t2, async_op=True).wait()
    out["sum"] = t2
    g = torch.empty(2 * world)
    dist.all_gather_into_tensor(g, torch.full((2,), float(rank)))
    out["gather"] = g
    if rank == 0:
        dist.send(torch.arange(7.0), 1)
    else:
        r = torch.zeros(7)
        dist.recv(r, 0)
        out["recv"] = r
    dist.barrier()
    torch.save(out, os.environ["OUT"])
    print("hook-loaded:", "_slurmguard_torchhook" in sys.modules)
    dist.destroy_process_group()
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp: Path, name: str, env_extra: dict, world: int = 2) -> list[subprocess.CompletedProcess]:
    script = tmp / f"{name}.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OUT=str(tmp / f"{name}-{rank}.pt"), **env_extra)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    return results


def outputs(tmp: Path, name: str, world: int = 2) -> list[dict]:
    import torch

    return [torch.load(tmp / f"{name}-{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spank_build):
    """One guarded and one unguarded run of the same job."""
    tmp = tmp_path_factory.mktemp("torchhook")
    rings = tmp / "rings"
    rings.mkdir()
    site = str(spank_build.torch_site)
    t0 = time.monotonic_ns()
    guarded = run_job(tmp, "guarded", {
        "PYTHONPATH": site, "SLURMGUARD_RING_DIR": str(rings), "SLURMGUARD_JOB_ID": "77",
        "SLURMGUARD_STEP_ID": "0", "SLURMGUARD_RING_RECORDS": "4096"})
    t1 = time.monotonic_ns()
    plain = run_job(tmp, "plain", {"PYTHONPATH": site})
    return {"tmp": tmp, "rings": rings, "guarded": guarded, "plain": plain, "window": (t0, t1)}


def test_hook_does_not_change_results(runs):
    import torch

    g, p = outputs(runs["tmp"], "guarded"), outputs(runs["tmp"], "plain")
    for rank in range(2):
        for a, b in zip(g[rank]["params"], p[rank]["params"]):
            assert torch.equal(a, b)  # bitwise: same kernels, same order
        for key in ("max", "sum", "gather"):
            assert torch.equal(g[rank][key], p[rank][key])
    assert torch.equal(g[1]["recv"], torch.arange(7.0))
    assert torch.equal(g[0]["max"], torch.arange(10, dtype=torch.float64) * 2)
    assert ["hook-loaded: True" in r.stdout for r in runs["guarded"]] == [True, True]
    # outside guarded jobs the site dir only chain-loads: nothing hooked
    assert ["hook-loaded: False" in r.stdout for r in runs["plain"]] == [True, True]


def test_one_ring_per_rank_with_the_allreduce_pattern(runs):
    files = sorted(os.listdir(runs["rings"]))
    assert files == ["rank-0.step-0.torch.ring", "rank-1.step-0.torch.ring"]
    t0, t1 = runs["window"]
    comm_ids = set()
    for rank in range(2):
        with ring.RingReader(str(runs["rings"] / files[rank])) as r:
            h = r.header
            recs = r.read().records
        assert (h.global_rank, h.world_size, h.job_id, h.step, h.source_name) == (
            rank, 2, 77, "0", "torch")
        assert h.capacity == 4096
        ops = [x.op_name for x in recs]
        assert ops[0] == "comm_init" and recs[0].peer == rank and recs[0].count == 2
        comm_ids.add(recs[0].comm_id)
        # DDP: one bucket all-reduce per step, 64*64+64 float32 gradients, summed
        ddp = [x for x in recs if x.op_name == "allreduce" and x.count == 4160]
        assert len(ddp) == 6
        assert all(x.datatype == ring.DATATYPE["float32"] and x.bytes == 4160 * 4
                   and x.redop == ring.REDOP["sum"] and x.flags & ring.F_ASYNC for x in ddp)
        # the explicit calls, in program (start) order, with their sizes and
        # ops; records are in completion order
        last_ddp = max(x.start_ns for x in ddp)
        tail = [(x.op_name, x.count, ring.DATATYPE_NAMES[x.datatype], ring.REDOP_NAMES[x.redop],
                 x.peer) for x in sorted(recs, key=lambda x: x.start_ns)
                if x.start_ns > last_ddp and x.op_name != "comm_init"]
        p2p = ("send", 7, "float32", "none", 1) if rank == 0 else ("recv", 7, "float32", "none", 0)
        assert tail == [("allreduce", 10, "float64", "max", -1), ("allreduce", 5, "int32", "sum", -1),
                        ("allgather", 2, "float32", "none", -1), p2p,
                        ("barrier", 0, "unknown", "none", -1)]
        # plausible times: inside the run, ordered, non-negative durations
        assert all(t0 <= x.start_ns <= x.end_ns <= t1 for x in recs)
        assert [x.seq for x in recs] == list(range(1, len(recs) + 1))
        # one step's all-reduce starts after the previous one's
        starts = sorted(x.start_ns for x in ddp)
        assert all(b - a > 0 for a, b in zip(starts, starts[1:]))
        assert len({x.comm_id for x in recs}) == 1
    assert len(comm_ids) == 1  # both ranks name the world group the same


def test_non_torch_job_and_chained_sitecustomize(spank_build, tmp_path):
    """A guarded Python job that never imports torch runs as usual: no
    torch import, no ring; a sitecustomize we shadow still runs, once."""
    other = tmp_path / "othersite"
    other.mkdir()
    marker = tmp_path / "marker"
    (other / "sitecustomize.py").write_text(
        f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    rings = tmp_path / "rings"
    rings.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update(PYTHONPATH=f"{spank_build.torch_site}:{other}", SLURMGUARD_RING_DIR=str(rings))
    res = subprocess.run([sys.executable, "-c",
                          "import sys, json; print(json.dumps(sorted(m for m in sys.modules "
                          "if m.startswith(('torch', '_slurmguard')))))"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.strip() == '["_slurmguard_ring", "_slurmguard_torchhook"]'
    assert marker.read_text() == "ran\n"
    assert list(rings.iterdir()) == []


def test_unusable_ring_dir_never_breaks_the_job(spank_build, tmp_path):
    """Recording that cannot start costs one warning line, not the job."""
    res = run_job(tmp_path, "broken", {"PYTHONPATH": str(spank_build.torch_site),
                                       "SLURMGUARD_RING_DIR": str(tmp_path / "does-not-exist")})
    for r in res:
        warnings = [line for line in r.stderr.splitlines() if line.startswith("slurmguard:")]
        assert len(warnings) == 1 and "cannot create" in warnings[0], r.stderr
    import torch

    out = outputs(tmp_path, "broken")
    assert torch.equal(out[0]["max"], torch.arange(10, dtype=torch.float64) * 2)
    assert torch.equal(out[1]["recv"], torch.arange(7.0))


MANY = textwrap.dedent('''
    import os, sys, tempfile, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    hook = sys.modules["_slurmguard_torchhook"]
    works = [dist.all_reduce(torch.ones(i % 7 + 1), async_op=True) for i in range(300)]
    for w in works:
        w.wait()
    hook.unpatch()
    dist.all_reduce(torch.ones(99))  # not recorded
    hook.patch()
    dist.all_reduce(torch.ones(100))
    hook._state["recorder"].settle()
    dist.destroy_process_group()
''')


def test_many_async_calls_all_recorded_and_unpatch_stops_recording(spank_build, tmp_path):
    rings = tmp_path / "rings"
    rings.mkdir()
    script = tmp_path / "many.py"
    script.write_text(MANY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update(PYTHONPATH=str(spank_build.torch_site), SLURMGUARD_RING_DIR=str(rings),
               SLURMGUARD_STEP_ID="0")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "slurmguard:" not in res.stderr, res.stderr[-2000:]
    with ring.RingReader(str(rings / "rank-0.step-0.torch.ring")) as r:
        recs = [x for x in r.read().records if x.op_name == "allreduce"]
    by_start = sorted(recs, key=lambda x: x.start_ns)
    assert [x.count for x in by_start] == [i % 7 + 1 for i in range(300)] + [100]
    assert all(x.flags & ring.F_ASYNC and x.start_ns <= x.end_ns for x in recs)
