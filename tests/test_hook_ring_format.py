"""The Python ring reader/writer against the C definition (sg_ring.h):
same layout, same enums, each reads what the other wrote, no torn record
while the C writer runs, damaged files reported and skipped."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import time

import pytest
from click.testing import CliRunner

from slurmguard.hook import ring
from tests.fixtures.hook import SPANK_DIR

HEADER_H = (SPANK_DIR / "sg_ring.h").read_text()


def c_fill(i: int) -> dict:
    """The record sg_ringtool writes as number i (tests/ringtool.c fill())."""
    d = {
        "comm_id": 0x1000 + i % 3,
        "count": i,
        "bytes": i * 4,
        "start_ns": 1_000_000_000 + i * 1000,
        "end_ns": 1_000_000_000 + i * 1000 + 500,
        "peer": i % 5 - 1,
        "op": 1 + i % 8,
        "datatype": ring.DATATYPE["float32"],
        "redop": ring.REDOP["sum"],
        "flags": ring.F_IN_GROUP if i % 2 else 0,
        "status": 0,
        "gpu_start_ns": 0,
        "gpu_end_ns": 0,
        "coll_seq": 0,
        "xfer_net_ns": 0,
        "xfer_peer_wait_ns": 0,
        "xfer_gpu_wait_ns": 0,
        "xfer_channels": 0,
        "xfer_ops": 0,
        "reserved": 0,
    }
    if i % 3 == 0:
        d.update(
            flags=d["flags"] | ring.F_GPU_TIME,
            gpu_start_ns=d["start_ns"] + 200,
            gpu_end_ns=d["end_ns"] + 20000 + i,
            coll_seq=i + 1,
            xfer_net_ns=i * 7,
            xfer_peer_wait_ns=i * 5,
            xfer_gpu_wait_ns=i * 3,
            xfer_channels=1 << (i % 64),
            xfer_ops=i,
        )
    return d


def as_dict(rec: ring.RingRecord) -> dict:
    d = {f: getattr(rec, f) for f, _, _ in ring.RECORD_FIELDS}
    d.pop("seq")
    return d


def test_layout_matches_c_compiler(spank_build):
    out = subprocess.run(
        [str(spank_build.ringtool), "layout"], capture_output=True, text=True, check=True
    ).stdout
    c = json.loads(out)
    assert c["header_size"] == ring.HEADER_SIZE and c["record_size"] == ring.RECORD_SIZE
    assert c["magic"] == ring.MAGIC and c["version"] == ring.VERSION
    assert c["node_name_len"] == ring.NODE_NAME_LEN
    for name, off, _ in ring.HEADER_FIELDS:
        assert c[f"sg_ring_header.{name}"] == off, name
    for name, off, _ in ring.RECORD_FIELDS:
        assert c[f"sg_record.{name}"] == off, name
    # the struct codes add up to the offsets the compiler chose
    pos = 0
    for name, off, code in ring.RECORD_FIELDS:
        assert pos == off, name
        pos += struct.calcsize("<" + code)
    assert ring.MAGIC.to_bytes(8, "little") == b"SGRING01"


def _c_enum(name: str) -> dict[str, int]:
    body = re.search(rf"enum {name} \{{(.*?)\}};", HEADER_H, re.DOTALL).group(1)
    return {m.group(2): int(m.group(1)) for m in re.finditer(r"= (\d+),?\s*/\* ([a-z0-9_]+)", body)}


def test_enum_names_match_header():
    ops = _c_enum("sg_op")
    assert ops == {n: i for i, n in enumerate(ring.OP_NAMES)}
    dts = _c_enum("sg_datatype")
    assert dts == {n: i for i, n in enumerate(ring.DATATYPE_NAMES)}
    redops = _c_enum("sg_redop")
    assert list(redops.values()) == list(range(len(ring.REDOP_NAMES)))
    assert [k.split()[0] for k in redops] == list(ring.REDOP_NAMES)
    flags = {
        m.group(1).lower(): int(m.group(2), 16)
        for m in re.finditer(r"#define SG_F_([A-Z_]+)\s+0x([0-9a-f]+)u", HEADER_H)
    }
    assert flags == {name: bit for bit, name in ring.FLAG_NAMES.items()}
    sizes = re.search(r"sizes\[SG_DT_COUNT\] = \{(.*?)\}", HEADER_H, re.DOTALL).group(1)
    assert tuple(int(x) for x in sizes.replace(",", " ").split()) == ring.DATATYPE_SIZES
    for const in ("HEADER_SIZE", "RECORD_SIZE", "DEFAULT_CAPACITY"):
        m = re.search(rf"#define SG_RING_{const}\s+(\d+)u", HEADER_H)
        assert int(m.group(1)) == getattr(ring, const)


def test_python_reads_a_ring_written_by_c(spank_build, tmp_path):
    path = tmp_path / "c.ring"
    subprocess.run(
        [str(spank_build.ringtool), "write", str(path), "100", "64"], check=True, capture_output=True
    )
    with ring.RingReader(str(path)) as r:
        h = r.header
        assert (h.job_id, h.step, h.global_rank, h.local_rank, h.world_size) == (31337, "batch", 5, 1, 16)
        assert h.node_name == "node-c" and h.source_name == "test" and h.capacity == 64
        assert h.write_counter == 100 and h.overwritten == 36
        # wall clock = monotonic + offset, within a second of now
        assert abs(time.monotonic_ns() + h.clock_offset_ns - time.time_ns()) < 1e9
        batch = r.read()
        assert [rec.number for rec in batch.records] == list(range(36, 100))
        assert all(as_dict(rec) == c_fill(rec.number) for rec in batch.records)
        assert batch.cursor == 100 and batch.lost == 0
        # a reader that was at 0 learns it lost the 36 overwritten ones
        assert r.read(cursor=0).lost == 36
        assert r.read(cursor=100).records == []


def test_c_reads_a_ring_written_by_python(spank_build, tmp_path):
    path = tmp_path / "py.ring"
    w = ring.RingWriter(
        str(path), capacity=16, job_id=7, step_id=3, global_rank=2, world_size=4, node_name="node9"
    )
    for i in range(20):
        w.append(
            ring.OP["allgather"],
            comm_id=99,
            count=i,
            nbytes=2 * i,
            start_ns=10 * i,
            end_ns=10 * i + 3,
            peer=i % 4,
            datatype=ring.DATATYPE["float16"],
            flags=ring.F_ASYNC,
        )
    w.close()
    out = subprocess.run(
        [str(spank_build.ringtool), "read", str(path)], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    rows = [list(map(int, line.split())) for line in out if line]
    assert [row[0] for row in rows] == list(range(4, 20))  # capacity 16: 4 overwritten
    n = 7
    assert rows[3] == [
        n,
        ring.OP["allgather"],
        99,
        n,
        2 * n,
        10 * n,
        10 * n + 3,
        n % 4,
        ring.DATATYPE["float16"],
        0,
        ring.F_ASYNC,
        0,
        0,
        0,
        0,
    ]


def test_no_torn_record_while_c_writes(spank_build, tmp_path):
    """The C writer appends 200k self-describing records into a 1024-slot
    ring while Python reads behind it: every accepted record is exactly
    the one its number says, gaps are counted as lost, never misread."""
    path = tmp_path / "live.ring"
    n = 200_000
    proc = subprocess.Popen(
        [str(spank_build.ringtool), "write", str(path), str(n), "1024", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        r = ring.RingReader(str(path))
        cursor, seen, lost, reads_during_write = 0, 0, 0, 0
        while True:
            running = proc.poll() is None
            batch = r.read(cursor)
            for rec in batch.records:
                assert as_dict(rec) == c_fill(rec.number)
            assert batch.corrupt == 0
            if running and batch.records:
                reads_during_write += 1
            seen += len(batch.records)
            lost += batch.lost
            cursor = batch.cursor
            if not running and cursor == r.write_counter:
                break
            time.sleep(0.001)
        assert reads_during_write > 5, "the reader never overlapped the writer"
        assert cursor == n and seen + lost == n
        r.close()
    finally:
        proc.kill()
        proc.wait()


def test_truncated_and_corrupt_files_are_reported_not_fatal(spank_build, tmp_path):
    good = tmp_path / "job" / "rank-0.step-0.nccl.ring"
    good.parent.mkdir()
    subprocess.run(
        [str(spank_build.ringtool), "write", str(good), "10", "16"], check=True, capture_output=True
    )
    data = good.read_bytes()
    (tmp_path / "job" / "rank-1.step-0.nccl.ring").write_bytes(data[:100])
    (tmp_path / "job" / "rank-2.step-0.nccl.ring").write_bytes(data[: ring.HEADER_SIZE + 64])
    (tmp_path / "job" / "rank-3.step-0.nccl.ring").write_bytes(b"\0" * 8 + data[8:])
    bad_cap = bytearray(data)
    struct.pack_into("<I", bad_cap, 20, 100)
    (tmp_path / "job" / "rank-4.step-0.nccl.ring").write_bytes(bytes(bad_cap))

    found = list(ring.scan(str(tmp_path)))
    problems = {os.path.basename(p.path): p.problem for p in found if isinstance(p, ring.RingProblem)}
    headers = [h for h in found if isinstance(h, ring.RingHeader)]
    assert [os.path.basename(h.path) for h in headers] == ["rank-0.step-0.nccl.ring"]
    assert "truncated" in problems["rank-1.step-0.nccl.ring"]
    assert "truncated" in problems["rank-2.step-0.nccl.ring"]
    assert "magic" in problems["rank-3.step-0.nccl.ring"]
    assert "capacity" in problems["rank-4.step-0.nccl.ring"]
    with pytest.raises(ring.RingError, match="truncated"):
        ring.RingReader(str(tmp_path / "job" / "rank-1.step-0.nccl.ring"))

    # a committed record with impossible contents is skipped and counted
    corrupt = bytearray(data)
    off = ring.HEADER_SIZE + 3 * ring.RECORD_SIZE
    struct.pack_into("<H", corrupt, off + 52, 999)  # op out of range, seq intact
    path = tmp_path / "corrupt.ring"
    path.write_bytes(bytes(corrupt))
    with ring.RingReader(str(path)) as r:
        batch = r.read()
    assert batch.corrupt == 1 and [rec.number for rec in batch.records] == [0, 1, 2, 4, 5, 6, 7, 8, 9]

    # padding records (op none) are skipped silently
    padded = bytearray(data)
    struct.pack_into("<H", padded, off + 52, 0)
    path.write_bytes(bytes(padded))
    with ring.RingReader(str(path)) as r:
        batch = r.read()
    assert batch.corrupt == 0 and [rec.number for rec in batch.records] == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_abandoned_record_is_skipped_after_stall(tmp_path, fake_clock):
    """A writer killed between reserving and committing leaves a hole. At
    the tail the reader just waits (writers reserve ahead); once later
    records are committed it waits stall_s more, then skips and counts it."""
    path = tmp_path / "hole.ring"
    w = ring.RingWriter(str(path), capacity=16)
    for i in range(3):
        w.append(ring.OP["send"], count=i, start_ns=i, end_ns=i)
    w.close()
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 192, 5)  # records 3 and 4 reserved ...
    path.write_bytes(bytes(raw))
    r = ring.RingReader(str(path), stall_s=5.0, clock=fake_clock.monotonic)
    b = r.read(0)
    assert len(b.records) == 3 and b.cursor == 3 and b.abandoned == 0
    fake_clock.advance(60.0)
    assert r.read(3).cursor == 3  # a tail reservation: never given up
    # ... and record 4 gets committed by another writer, 3 never
    rec4 = struct.pack("<QQQQQQiHBBIi", 5, 0, 4, 0, 4, 4, -1, ring.OP["send"], 0, 0, 0, 0)
    rec4 += bytes(ring.RECORD_SIZE - len(rec4))
    raw[ring.HEADER_SIZE + 4 * ring.RECORD_SIZE : ring.HEADER_SIZE + 5 * ring.RECORD_SIZE] = rec4
    path.write_bytes(bytes(raw))
    r = ring.RingReader(str(path), stall_s=5.0, clock=fake_clock.monotonic)
    assert r.read(3).cursor == 3
    fake_clock.advance(1.0)
    assert r.read(3).cursor == 3  # still waiting for it
    fake_clock.advance(5.0)
    b = r.read(3)
    assert b.abandoned == 1 and b.cursor == 5 and [x.count for x in b.records] == [4]


def test_python_writer_hold_and_timeout(tmp_path):
    path = tmp_path / "h.ring"
    w = ring.RingWriter(str(path), capacity=16)
    ctl = ring.RingControl(str(path))
    assert not w.hold_requested()
    ctl.hold(timeout_ms=30)
    assert w.hold_requested() and ctl.state()["held"]
    t0 = time.monotonic()
    assert w.hold_wait() is True  # nobody released: timed out
    assert time.monotonic() - t0 >= 0.03
    st = ctl.state()
    assert not st["held"] and st["holds"] == 1 and st["hold_timeouts"] == 1
    with ring.RingReader(str(path)) as r:
        rec = r.read().records[-1]
    assert rec.op_name == "hold" and rec.flags & ring.F_TIMEOUT and rec.duration_ns >= 30e6


def test_ring_dump_cli(spank_build, tmp_path):
    from slurmguard.cli import cli

    path = tmp_path / "d.ring"
    subprocess.run(
        [str(spank_build.ringtool), "write", str(path), "5", "16"], check=True, capture_output=True
    )
    res = CliRunner().invoke(cli, ["ring", "dump", str(path)])
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.output.splitlines()]
    assert lines[0]["header"]["job_id"] == 31337 and lines[0]["header"]["step"] == "batch"
    recs = lines[1:-1]
    assert [r["op"] for r in recs] == ["allreduce", "allgather", "reducescatter", "broadcast", "reduce"]
    assert recs[1] == {
        "seq": 2,
        "op": "allgather",
        "comm_id": 0x1001,
        "count": 1,
        "bytes": 4,
        "start_ns": 1_000_001_000,
        "end_ns": 1_000_001_500,
        "peer": 0,
        "datatype": "float32",
        "redop": "sum",
        "flags": ["in_group"],
        "status": 0,
    }
    assert lines[-1]["summary"]["records"] == 5

    bad = tmp_path / "bad.ring"
    bad.write_bytes(b"x" * 10)
    res = subprocess.run(["slurmguard", "ring", "dump", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"slurmguard: error: ring {bad}: truncated: 10 bytes, the header alone is 4096"
    ]


def test_older_ring_version_is_rejected_with_a_clear_error(spank_build, tmp_path):
    """A v1 ring (64-byte records, no GPU times) left by an older hook is
    refused by name, by both readers, instead of being misread."""
    path = tmp_path / "rank-0.step-0.nccl.ring"
    subprocess.run(
        [str(spank_build.ringtool), "write", str(path), "3", "16"], check=True, capture_output=True
    )
    raw = bytearray(path.read_bytes())
    struct.pack_into("<II", raw, 8, 1, ring.HEADER_SIZE)
    struct.pack_into("<I", raw, 16, 64)
    path.write_bytes(bytes(raw))
    with pytest.raises(ring.RingError, match=r"version 1 was written by an older slurmguard"):
        ring.RingReader(str(path))
    res = subprocess.run([str(spank_build.ringtool), "read", str(path)], capture_output=True, text=True)
    assert res.returncode == 1 and "older ring format version" in res.stderr


def test_duration_rule_prefers_gpu_time(spank_build, tmp_path):
    """duration_ns is the GPU execution when the record has it (a collective
    that enqueued in 500 ns but ran 20 us on the stream), else host time."""
    path = tmp_path / "g.ring"
    subprocess.run(
        [str(spank_build.ringtool), "write", str(path), "4", "16"], check=True, capture_output=True
    )
    with ring.RingReader(str(path)) as r:
        recs = r.read().records
    gpu, host = recs[3], recs[1]
    assert gpu.has_gpu_time and gpu.host_duration_ns == 500
    assert gpu.gpu_duration_ns == gpu.duration_ns == (500 + 20000 + 3) - 200
    assert gpu.begin_ns == gpu.start_ns + 200 and gpu.finish_ns == gpu.gpu_end_ns
    assert not host.has_gpu_time and host.gpu_duration_ns is None
    assert host.duration_ns == host.host_duration_ns == 500 and host.begin_ns == host.start_ns
    j = gpu.to_json()
    assert "gpu_time" in j["flags"] and j["gpu_end_ns"] - j["gpu_start_ns"] == 20303
    assert "gpu_start_ns" not in host.to_json()


def test_python_reads_profiler_plugin_records(spank_build, tmp_path):
    """What the NCCL profiler plugin writes under the fake NCCL core
    (spank_plugin/tests/test_profiler.c) reads back in Python: collectives
    with GPU times (duration = GPU time), NCCL sequence numbers, per-link
    peer_xfer aggregates that are not calls, and the in-flight count the
    plugin keeps (nothing in flight once every communicator is finalised)."""
    build = spank_build.hook.parent
    env = dict(
        os.environ,
        LD_PRELOAD=str(spank_build.hook),
        SG_TEST_RING_DIR=str(tmp_path),
        NCCL_PROFILER_PLUGIN=str(build / "libslurmguard_nccl_profiler.so"),
    )
    res = subprocess.run(
        [str(build / "tests" / "test_profiler")], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr
    with ring.RingReader(str(tmp_path / "rank-0.step-0.ncclprof.ring")) as r:
        assert r.header.source_name == "ncclprof" and r.header.gpu_state_name == "on"
        assert r.header.header_flags & ring.HF_IN_FLIGHT and r.in_flight() == (True, None)
        recs = r.read().records
    colls = [x for x in recs if x.op_name == "allreduce"]
    assert [x.coll_seq for x in colls] == [1, 2, 3, 4, 5, 6]
    for x in colls:
        assert x.has_gpu_time and not x.is_peer_xfer
        assert x.host_duration_ns < 3_000_000 <= 20_000_000 <= x.duration_ns == x.gpu_duration_ns
    links = {(x.peer, "xfer_send" in x.to_json()["flags"]): x for x in recs if x.is_peer_xfer}
    assert set(links) == {(1, True), (3, False)}
    slow, fine = links[(1, True)], links[(3, False)]
    assert slow.count == 52 and fine.count == 48 and slow.bytes == 52 * 524288
    assert slow.xfer_net_ns - fine.xfer_net_ns >= 48 * 5_000_000
    j = slow.to_json()
    assert j["op"] == "peer_xfer" and j["xfer_channels"] == 3 and j["xfer_ops"] == 13
    send = next(x for x in recs if x.op_name == "send")
    assert send.peer == 1 and send.has_gpu_time and send.duration_ns >= 2_000_000 + 4 * 8_000_000
