"""The torch hook and functional collectives (torch.ops._c10d_functional,
what DTensor, tensor parallel and torch.compile'd code issue): real 2-rank
gloo jobs on localhost, in subprocesses (the hook's dispatcher kernels must
not leak into this process).

A functional collective's C++ kernel calls the process group, whose
methods dispatch the c10d op of the call (c10d::allreduce_ for
all_reduce, ...) with autograd already excluded; the hook's kernels sit at
BackendSelect, below that exclusion, so these calls are recorded like any
other: once, as the c10d op, ended by the work's completion (a done
callback on its future) or, for gloo's futureless work (reduce_scatter,
p2p), by the wait that wait_tensor (an AsyncCollectiveTensor's first use)
makes on it. Each test runs its job once (guarded) or twice (guarded and
plain); about 20-40 s each on the 2-core development machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from slurmguard.hook import ring
from slurmguard.hook.exits import ring_env
from tests.test_hook_torch import start_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

#: how long rank 1 holds back before the delayed collectives (s): far above
#: the collectives' own time and the scheduling noise of a loaded machine
DELAY_S = 0.25

# The project's tensor-parallel shape (slurmguard.workloads.shapes.build_tp:
# DTensor parallelize_module, ColwiseParallel up / RowwiseParallel down), a
# small model. Rank 1 sleeps before block 1's down projection in the steps
# listed in DELAY_STEPS, so rank 0 waits for it inside that block's forward
# all-reduce.
TP_JOB = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    from slurmguard.workloads.runtime import Env, ModelSpec
    from slurmguard.workloads.shapes import ShapeOptions, build_tp
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = ModelSpec(width=32, hidden=64, depth=2, classes=4, batch=8)
    built = build_tp(Env(rank, world, rank, world, "local", 0, 0), spec, ShapeOptions())
    delay, steps = float(os.environ["DELAY"]), json.loads(os.environ["DELAY_STEPS"])
    now = {"step": -1}
    marks, delays = [], []
    def hold(module, args):
        if rank == 1 and now["step"] in steps:
            delays.append(time.monotonic_ns())
            time.sleep(delay)
    built.model[1].down.register_forward_pre_hook(hold)
    for i in range(int(os.environ["STEPS"])):
        now["step"] = i
        marks.append(time.monotonic_ns())
        built.step(i)
    marks.append(time.monotonic_ns())
    params = {k: v.to_local().detach().clone() if hasattr(v, "to_local") else v.detach().clone()
              for k, v in built.model.state_dict().items()}
    torch.save(params, os.environ["OUT"] + ".pt")
    with open(os.environ["OUT"] + ".json", "w") as f:
        json.dump({"marks": marks, "delays": delays}, f)
    from slurmguard.teardown import finish
    finish(barrier=False)  # gloo's exit race (README, "Exit race") is not these tests' subject; no barrier: it would be recorded
""")

# Every functional collective the hook must see, called as DTensor and
# torch.compile'd code call them (torch.ops._c10d_functional with a group
# name, then wait_tensor), plus the Python API whose AsyncCollectiveTensor
# waits on first use, and a plain all_reduce on inference-mode tensors
# (no autograd keys). Rank 1 arrives DELAY late at each of them.
FUNC_JOB = textwrap.dedent("""
    import json, os, time, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    delay = float(os.environ["DELAY"])
    F, g = torch.ops._c10d_functional, dist.group.WORLD.group_name
    x = torch.arange(8, dtype=torch.float32) + rank
    calls, out = [], {}
    def call(name, fn):
        if rank == 1:
            time.sleep(delay)
        t0 = time.monotonic_ns()
        out[name] = fn()
        calls.append((name, t0, time.monotonic_ns()))
    wait = F.wait_tensor
    call("all_reduce", lambda: wait(F.all_reduce(x, "max", g)))
    call("all_reduce_", lambda: wait(F.all_reduce_(x.clone(), "sum", g)))
    call("all_gather", lambda: wait(F.all_gather_into_tensor(x, world, g)))
    call("reduce_scatter", lambda: wait(F.reduce_scatter_tensor(x, "sum", world, g)))
    call("all_to_all", lambda: wait(F.all_to_all_single(x, [4, 4], [4, 4], g)))
    call("broadcast", lambda: wait(F.broadcast(x, 0, g)))
    call("all_reduce_coalesced",
         lambda: [wait(t) for t in F.all_reduce_coalesced([x, x[:3]], "sum", g)])
    call("all_gather_coalesced",
         lambda: [wait(t) for t in F.all_gather_into_tensor_coalesced([x, x[:2]], world, g)])
    call("reduce_scatter_coalesced",
         lambda: [wait(t) for t in F.reduce_scatter_tensor_coalesced([x, x[:2]], "sum", world, g)])
    call("act", lambda: fc.all_reduce(x.double(), "sum", dist.group.WORLD) * 1)
    def inference():  # tensors without autograd keys
        with torch.inference_mode():
            t = x.clone()
            dist.all_reduce(t)
            return t
    call("inference", inference)
    torch.save(out, os.environ["OUT"] + ".pt")
    with open(os.environ["OUT"] + ".json", "w") as f:
        json.dump({"calls": calls}, f)
    from slurmguard.teardown import finish
    finish(barrier=False)  # gloo's exit race (README, "Exit race") is not these tests' subject; no barrier: it would be recorded
""")


def run(
    tmp: Path, name: str, job: str, env_extra: dict, rings: Path | None, site: Path
) -> list[subprocess.CompletedProcess]:
    script = tmp / f"{name}.py"
    script.write_text(job)
    extra = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", **env_extra}
    if rings is not None:
        extra.update(ring_env(rings, 7, 4096))
    procs = start_ranks(script, extra, 2, lambda rank: {"OUT": str(tmp / f"{name}-{rank}")})
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "slurmguard:" not in r.stderr, r.stderr[-3000:]  # no hook failure
    return results


def records(rings: Path, rank: int) -> tuple[ring.RingHeader, list]:
    """The ring's header and its records in start (program) order."""
    with ring.RingReader(str(rings / f"rank-{rank}.step-0.torch.ring")) as r:
        recs = r.read().records
        return r.refresh_header(), sorted(recs, key=lambda x: x.start_ns)


def gaps_and_spans(recs: list) -> list[tuple]:
    """(record, time since the previous record ended (s), its own span (s))."""
    out, prev_end = [], None
    for x in recs:
        gap = None if prev_end is None else (x.start_ns - prev_end) / 1e9
        out.append((x, gap, (x.end_ns - x.start_ns) / 1e9))
        prev_end = max(prev_end or 0, x.end_ns)
    return out


def test_tensor_parallel_job_collectives_recorded_with_their_waits(spank_build, tmp_path):
    """DTensor TP (the project's tp shape): every step's forward and
    backward all-reduces are in both rings with their sizes, and a rank
    that waits for a late peer is seen waiting inside the all-reduce, not
    computing before it; results bitwise those of the unguarded job."""
    import torch

    steps, delayed = 6, [2, 3, 4]
    rings = tmp_path / "rings"
    rings.mkdir()
    env = {"STEPS": str(steps), "DELAY_STEPS": json.dumps(delayed)}
    run(tmp_path, "guarded", TP_JOB, {**env, "DELAY": str(DELAY_S)}, rings, spank_build.torch_site)
    run(tmp_path, "plain", TP_JOB, {**env, "DELAY": "0"}, None, spank_build.torch_site)
    for rank in range(2):
        g = torch.load(tmp_path / f"guarded-{rank}.pt")
        p = torch.load(tmp_path / f"plain-{rank}.pt")
        assert g.keys() == p.keys()
        assert all(torch.equal(g[k], p[k]) for k in g), rank

    # activations of 8 samples x width 32, float32: each block's
    # RowwiseParallel output (forward) and ColwiseParallel input gradient
    # (backward), 2 blocks
    per_step, count = 4, 8 * 32
    spans = {}
    for rank in range(2):
        header, recs = records(rings, rank)
        assert header.overwritten == 0
        job = json.loads((tmp_path / f"guarded-{rank}.json").read_text())
        marks = np.array(job["marks"])
        ars = [x for x in recs if x.op_name == "allreduce"]
        assert len({x.comm_id for x in ars}) == 1
        assert all(
            (x.count, x.bytes, ring.DATATYPE_NAMES[x.datatype], ring.REDOP_NAMES[x.redop])
            == (count, count * 4, "float32", "sum")
            and x.flags & ring.F_ASYNC
            for x in ars
        ), ars[:3]
        starts = np.array([x.start_ns for x in ars])
        assert (
            np.bincount(np.searchsorted(marks, starts, side="right") - 1, minlength=steps).tolist()
            == [per_step] * steps
        ), rank
        assert all(marks[0] <= x.start_ns <= x.end_ns <= marks[-1] for x in ars)
        # block 1's forward all-reduce: the second collective of each step
        spans[rank] = {
            i: row for i, row in enumerate(r for r in gaps_and_spans(recs) if r[0] in ars[1::per_step])
        }
    late = json.loads((tmp_path / "guarded-1.json").read_text())["delays"]
    assert len(late) == len(delayed)
    for i in delayed:
        _, gap0, span0 = spans[0][i]
        _, gap1, span1 = spans[1][i]
        # rank 0 got there in time and waited in the collective; rank 1 was
        # late (its sleep is a gap before its record) and did not wait
        assert span0 >= 0.8 * DELAY_S and gap0 < DELAY_S / 2, (i, gap0, span0)
        assert gap1 >= DELAY_S and span1 < DELAY_S / 2, (i, gap1, span1)
    for i in set(range(steps)) - set(delayed):
        assert spans[0][i][2] < DELAY_S / 2, (i, spans[0][i])


def test_functional_collectives_recorded_as_their_c10d_ops(spank_build, tmp_path):
    """Each functional collective: one record of its kind with the NCCL
    call's count, bytes, datatype and reduce op, coalesced ones flagged,
    the late peer's wait inside rank 0's record; results unchanged."""
    import torch

    rings = tmp_path / "rings"
    rings.mkdir()
    run(tmp_path, "guarded", FUNC_JOB, {"DELAY": str(DELAY_S)}, rings, spank_build.torch_site)
    run(tmp_path, "plain", FUNC_JOB, {"DELAY": "0"}, None, spank_build.torch_site)
    for rank in range(2):
        g = torch.load(tmp_path / f"guarded-{rank}.pt")
        p = torch.load(tmp_path / f"plain-{rank}.pt")
        for k in g:
            a, b = (g[k], p[k]) if isinstance(g[k], list) else ([g[k]], [p[k]])
            assert all(torch.equal(u, v) for u, v in zip(a, b)), (rank, k)
    assert torch.equal(g["all_reduce"], torch.arange(8.0) + 1)  # max over ranks

    # (op, count, datatype, redop, peer, coalesced) in call order
    expected = [
        ("allreduce", 8, "float32", "max", -1, False),
        ("allreduce", 8, "float32", "sum", -1, False),
        ("allgather", 8, "float32", "none", -1, False),
        ("reducescatter", 4, "float32", "sum", -1, False),
        ("alltoall", 4, "float32", "none", -1, False),
        ("broadcast", 8, "float32", "none", 0, False),
        ("allreduce", 11, "float32", "sum", -1, True),
        ("allgather", 10, "float32", "none", -1, True),
        ("reducescatter", 5, "float32", "sum", -1, True),
        ("allreduce", 8, "float64", "sum", -1, False),
        ("allreduce", 8, "float32", "sum", -1, False),
    ]
    by_rank = []
    for rank in range(2):
        header, recs = records(rings, rank)
        assert header.overwritten == 0
        recs = [x for x in recs if x.op_name != "comm_init"]
        by_rank.append(recs)
        got = [
            (
                x.op_name,
                x.count,
                ring.DATATYPE_NAMES[x.datatype],
                ring.REDOP_NAMES[x.redop],
                x.peer,
                bool(x.flags & ring.F_COALESCED),
            )
            for x in recs
        ]
        assert got == expected, rank
        assert all(x.bytes == x.count * ring.DATATYPE_SIZES[x.datatype] for x in recs)
        calls = json.loads((tmp_path / f"guarded-{rank}.json").read_text())["calls"]
        for (name, t0, t1), x in zip(calls, recs):
            # inside the call that issued it and waited for it
            assert t0 <= x.start_ns <= x.end_ns <= t1, name
    # Rank 1 sleeps DELAY_S before each call, so rank 0 is usually there
    # first and waits; but a rank's work after a collective (the first use
    # of an AsyncCollectiveTensor imports for seconds) can eat into that
    # lead. Whoever started first holds its record open until the other
    # starts: the peer's wait is inside the early rank's record.
    tol = 2_000_000  # ns: the collective's own time, both clocks CLOCK_MONOTONIC
    led = 0
    for name, x0, x1 in zip([c[0] for c in calls], *by_rank):
        early, late = (x0, x1) if x0.start_ns <= x1.start_ns else (x1, x0)
        assert early.end_ns + tol >= late.start_ns, (name, early, late)
        assert (late.end_ns - late.start_ns) / 1e9 < DELAY_S / 2, (name, late)
        led += (x1.start_ns - x0.start_ns) / 1e9 >= 0.5 * DELAY_S
    assert led >= len(expected) - 2, f"rank 0 waited for rank 1 in only {led} calls"


UNWAITED_JOB = textwrap.dedent("""
    import os, sys, tempfile, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    hook = sys.modules["_slurmguard_torchhook"]
    rec = hook._state["recorder"]
    F, g = torch.ops._c10d_functional, dist.group.WORLD.group_name
    x = torch.ones(4)
    for i in range(hook.MAX_UNWAITED + 100):
        F.reduce_scatter_tensor(x, "sum", 1, g)  # output dropped, never waited for
    for _ in range(10):
        F.wait_tensor(F.reduce_scatter_tensor(x, "sum", 1, g))
    print("held", len(rec._unwaited), hook.MAX_UNWAITED, flush=True)
    dist.destroy_process_group()
""")


def test_functional_outputs_never_waited_for_are_bounded_and_counted(spank_build, tmp_path):
    """gloo's reduce_scatter work has no future: its wrapper waits for
    wait_tensor. Outputs the job drops unwaited keep at most MAX_UNWAITED
    wrappers; past that, calls are recorded when they return, and the
    unwaited ones are counted lost once the last group is destroyed: every
    call is in the ring or counted, none held forever."""
    rings = tmp_path / "rings"
    rings.mkdir()
    script = tmp_path / "unwaited.py"
    script.write_text(UNWAITED_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update(
        PYTHONPATH=f"{spank_build.torch_site}{os.pathsep}{REPO}",
        SLURMGUARD_RING_DIR=str(rings),
        SLURMGUARD_STEP_ID="0",
    )
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "slurmguard:" not in res.stderr, res.stderr[-2000:]
    held, limit = map(int, res.stdout.split()[1:3])
    assert held == limit
    header, recs = records(rings, 0)
    scattered = [x for x in recs if x.op_name == "reducescatter"]
    assert len(scattered) == 110 and header.overwritten == limit
    assert all(x.count == 4 and not x.flags & ring.F_ASYNC for x in scattered)
