"""Rings recorded on a real GPU, replayed through the Python ring reader and
the agent: the ground truth the fake CUDA runtime and fake NCCL must match.

Two recordings, each test run on both, made by spank_plugin/gpu/run_real.sh
with torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9 (nvidia-nccl-cu13) and a
1-rank NCCL communicator (run.log holds the whole run):
tests/data/gpu/h100-nccl2.28.9/ on one NVIDIA H100 80GB HBM3 (driver
580.159.04, 2026-11-24), tests/data/gpu/h200-nccl2.28.9/ on one NVIDIA H200
(driver 580.159.04, 2026-11-28, with the completion thread reading readiness
from the end event's elapsed time). Each directory is one process of
spank_plugin/gpu/real_nccl.py, its ring(s) gzipped, with torch's own
torch.cuda.Event timings of the same calls (calls.json):

- hook: LD_PRELOAD hook with CUDA events; hostonly: SLURMGUARD_CUDA_EVENTS=0;
- graph: an all-reduce captured into a CUDA graph and replayed under the hook;
- profiler: NCCL_PROFILER_PLUGIN alone; both: the plugin and the hook.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import os
import struct
import time
from pathlib import Path

import pytest

from slurmguard.agent.rings import RingTracker
from slurmguard.hook.ring import (
    F_CAPTURED,
    F_GPU_TIME,
    F_IN_GROUP,
    F_NO_EVENT,
    RingReader,
)

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = REPO / "tests" / "data" / "gpu"
MB = 1 << 20

_spec = importlib.util.spec_from_file_location("real_nccl", REPO / "spank_plugin" / "gpu" / "real_nccl.py")
real_nccl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_nccl)


@pytest.fixture(params=["h100-nccl2.28.9", "h200-nccl2.28.9"])
def data(request) -> Path:
    """One recording's directory."""
    return RECORDINGS / request.param


def unpack(data: Path, tmp_path: Path, run: str) -> Path:
    """The run's rings, gunzipped into a directory of their own."""
    out = tmp_path / run
    out.mkdir()
    for gz in (data / run).glob("*.ring.gz"):
        (out / gz.name[:-3]).write_bytes(gzip.decompress(gz.read_bytes()))
    return out


def records(ring_dir: Path, source: str = "nccl") -> list:
    (path,) = ring_dir.glob(f"*.{source}.ring")
    with RingReader(str(path)) as r:
        return r.header, list(r.records())


def calls(data: Path, run: str) -> list[dict]:
    return json.loads((data / run / "calls.json").read_text())["calls"]


def test_hook_gpu_durations_match_torch_events(data, tmp_path):
    """Issue 16.5: the hook's event-timed GPU durations agree with
    torch.cuda.Event timings of the same calls within 5%, for every call,
    when the calls are enqueued behind GPU work (the GPU reaches the call
    ~0.6 ms after the host enqueued it in ~10 us). On an idle GPU torch's
    span also holds torch's own launch work before the NCCL call, which the
    hook's events, around the NCCL call itself, leave out: 12% there."""
    res = real_nccl.compare(str(unpack(data, tmp_path, "hook")), str(data / "hook" / "calls.json"))
    assert set(res) == {
        "allreduce_avg_64MB",
        "allreduce_avg_256MB",
        "allreduce_avg_1GB",
        "allgather_256MB",
        "sendrecv_self_256MB",
        "allreduce_avg_256MB_idle_gpu",
    }
    for name, row in res.items():
        assert row["records"] == row["calls"] == 13, (name, row)
        if row["busy"]:
            assert row["max_err"] < real_nccl.AGREEMENT, (name, row)
            # enqueue << GPU time: the host's view of the call is not its duration
            assert row["enqueue_us"] < 0.5 * row["gpu_us"], (name, row)
            assert row["gpu_start_after_call_us"] > 100, (name, row)
        else:
            assert row["median_err"] > real_nccl.AGREEMENT, (name, row)
            assert abs(row["gpu_start_after_call_us"]) < 10, (name, row)
    assert res["allreduce_avg_1GB"]["median_err"] < 0.005


def test_gpu_times_lie_on_the_host_clock(data, tmp_path):
    """GPU start/end are mapped to CLOCK_MONOTONIC: on an idle GPU the work
    starts within a few microseconds of the host call (the reference
    event's calibration error), never before the previous call ended."""
    _, recs = records(unpack(data, tmp_path, "hook"))
    timed = [r for r in recs if r.flags & F_GPU_TIME]
    assert len(timed) == 13 * 5 + 13  # 5 collective cases + 13 p2p groups (group_end)
    for a, b in itertools.pairwise(timed):
        assert a.gpu_start_ns <= a.gpu_end_ns <= b.gpu_start_ns
    idle = [c for c in calls(data, "hook") if not c["busy"]]
    for c in idle:
        (r,) = [r for r in timed if c["host_start_ns"] <= r.start_ns <= c["host_end_ns"]]
        assert abs(r.gpu_start_ns - r.start_ns) < 10_000
        assert r.begin_ns == r.gpu_start_ns and r.finish_ns == r.gpu_end_ns
        assert r.duration_ns == r.gpu_end_ns - r.gpu_start_ns


def test_p2p_batch_is_timed_as_its_outermost_group(data, tmp_path):
    """torch's batch_isend_irecv nests three NCCL groups around the send and
    the recv: only the outermost group_end carries the GPU time; the calls
    inside keep their host (enqueue) times and in_group."""
    _, recs = records(unpack(data, tmp_path, "hook"))
    for r in recs:
        if r.op_name in ("send", "recv"):
            assert r.flags & F_IN_GROUP and not r.flags & (F_GPU_TIME | F_NO_EVENT)
            assert r.bytes == 256 * MB and r.peer == 0
    ends = [r for r in recs if r.op_name == "group_end"]
    assert sum(1 for r in ends if r.flags & F_GPU_TIME) == 13
    assert all(not r.flags & F_IN_GROUP for r in ends if r.flags & F_GPU_TIME)


def test_host_only_timing_sees_only_the_enqueue(data, tmp_path):
    """Without events the same calls last microseconds in the ring: what
    the hook recorded on every GPU job before issue 16."""
    h, recs = records(unpack(data, tmp_path, "hostonly"))
    assert h.gpu_state_name == "disabled" and h.gpu_lost == 0
    colls = [r for r in recs if r.op_name in ("allreduce", "allgather")]
    assert len(colls) == 13 * 5
    assert all(r.flags & F_NO_EVENT and not r.flags & F_GPU_TIME for r in colls)
    big = [c for c in calls(data, "hostonly") if c["case"] == "allreduce_avg_1GB" and not c["warmup"]]
    for c in big:
        (r,) = [r for r in colls if c["host_start_ns"] <= r.start_ns <= c["host_end_ns"]]
        assert r.duration_ns < 0.1 * c["torch_ms"] * 1e6


def test_graph_capture_is_left_intact(data, tmp_path):
    """A captured all-reduce is recorded without events and flagged; the
    graph replays correctly, and calls after it are timed on the GPU."""
    res = json.loads((data / "graph" / "graph.json").read_text())
    assert res["graph_ok"] is True and res["replays"] == 5
    h, recs = records(unpack(data, tmp_path, "graph"))
    assert h.gpu_state_name == "on" and h.gpu_lost == 0
    ar = [r for r in recs if r.op_name == "allreduce"]
    assert [bool(r.flags & F_CAPTURED) for r in ar] == [False, True, False]
    assert [bool(r.flags & F_GPU_TIME) for r in ar] == [True, False, True]
    after = res["eager_after"]
    assert after["host_start_ns"] <= ar[-1].start_ns <= after["host_end_ns"]


def test_profiler_plugin_under_nccl_2_28(data, tmp_path):
    """NCCL 2.28.9 loads the plugin as ncclProfiler_v5. On a communicator of
    one rank NCCL short-cuts every collective (no profiler event: NCCL's
    one-rank path never reaches its kernel plan) and runs send/recv to
    oneself without proxy or kernel-channel events, so the p2p records
    carry host times and no_event: the plugin's GPU timing needs 2+ GPUs."""
    log = (data / "profiler" / "nccl.log").read_text()
    assert "PROFILER/Plugin: Loaded slurmguard (v5)" in log
    h, recs = records(unpack(data, tmp_path, "profiler"), "ncclprof")
    assert h.source_name == "ncclprof" and h.gpu_state_name == "on"
    ops = [r.op_name for r in recs]
    assert ops[0] == "comm_init" and ops[-1] == "comm_destroy"
    p2p = recs[1:-1]
    assert [r.op_name for r in p2p] == ["send", "recv"] * 13
    for r in p2p:
        assert r.flags == F_NO_EVENT and r.bytes == 256 * MB and r.peer == 0
        assert 0 < r.end_ns - r.start_ns < 1_000_000


def test_hook_defers_to_the_plugin(data, tmp_path):
    """Hook and plugin both loaded: the plugin records, the hook nothing."""
    d = unpack(data, tmp_path, "both")
    h, recs = records(d, "nccl")
    assert recs == [] and h.gpu_state_name == "untried"
    _, prof = records(d, "ncclprof")
    assert sum(r.op_name == "send" for r in prof) == 13


@pytest.mark.parametrize("run", ["hook", "hostonly", "graph", "profiler", "both"])
def test_recorded_rings_are_complete(data, tmp_path, run):
    """Nothing lost or torn in any recorded ring (exit with events in
    flight included: the process ends 0.2 s after its last call)."""
    d = unpack(data, tmp_path, run)
    for path in d.glob("*.ring"):
        with RingReader(str(path)) as r:
            batch = r.read()
            assert batch.lost == 0 and batch.corrupt == 0
            assert r.header.overwritten == 0 and r.header.gpu_lost == 0


def test_agent_reads_the_real_hook_ring(data, tmp_path):
    """The recorded ring through the agent's tracker (its header's clock
    offset set to this boot's, as a replay must): collectives are timed by
    their GPU work, the calls inside each p2p batch take the GPU span of
    the batch's outermost group_end, bookkeeping stays out."""
    job = tmp_path / "16"
    job.mkdir()
    src = unpack(data, tmp_path, "hook")
    (ring_file,) = src.glob("*.ring")
    data = bytearray(ring_file.read_bytes())
    struct.pack_into("<q", data, 48, time.time_ns() - time.monotonic_ns())
    (job / ring_file.name).write_bytes(bytes(data))
    tr = RingTracker(str(tmp_path), "vm", lambda: {16: os.getuid()}, young_s=0.0)
    (t,) = tr.poll()
    assert t.corrupt == 0 and t.lost == 0
    _, recs = records(src)
    timed = {r.start_ns: r for r in recs if r.flags & F_GPU_TIME}
    names = [r.op_name for r in recs if r.op_name in ("allreduce", "allgather", "send", "recv")]
    assert len(t.op) == len(names) == 13 * 5 + 26
    groups = sorted((r.start_ns, r) for r in recs if r.op_name == "group_end" and r.flags & F_GPU_TIME)
    for i in range(len(t.op)):
        if t.start_ns[i] in timed:
            r = timed[t.start_ns[i]]
            assert (t.begin_ns[i], t.finish_ns[i]) == (r.gpu_start_ns, r.gpu_end_ns)
        else:  # a send or recv of a batch: its group's span
            g = next(r for s, r in groups if s >= t.start_ns[i])
            assert (t.begin_ns[i], t.finish_ns[i]) == (g.gpu_start_ns, g.gpu_end_ns)
            assert t.finish_ns[i] - t.begin_ns[i] > 100_000  # 256 MB: over 0.1 ms on the GPU
