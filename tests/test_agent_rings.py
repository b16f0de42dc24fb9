"""The agent's ring reader and tracker against hostile and broken ring files.

Property tests (hypothesis) feed the reader arbitrary headers and record
bytes and the tracker+analysis arbitrary record sequences: nothing but a
RingError ever leaves the reader, nothing at all leaves the tracker or the
analysis, and every sample that comes out makes sense.
"""

from __future__ import annotations

import os
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmguard.agent.analysis import RankAnalyzer
from slurmguard.agent.rings import RingTracker
from slurmguard.config import Policy
from slurmguard.hook import ring

NODE = "node1"
UID = os.getuid()
POLICY = Policy()


def make_ring(path, *, rank=0, world=2, node=NODE, capacity=64, job_id=0, records=()):
    w = ring.RingWriter(
        str(path),
        capacity=capacity,
        job_id=job_id,
        step_id=0,
        global_rank=rank,
        local_rank=rank,
        world_size=world,
        node_name=node,
    )
    for r in records:
        w.append(**r)
    w.close()
    return path


def ddp_records(n, *, period_ns=50_000_000, comm_ns=5_000_000, t0=None):
    t = t0 if t0 is not None else time.monotonic_ns() - n * period_ns
    out = []
    for i in range(n):
        s = t + i * period_ns
        out.append(
            dict(op=ring.OP["allreduce"], comm_id=7, count=10, nbytes=40, start_ns=s, end_ns=s + comm_ns)
        )
    return out


def tracker(root, jobs=None):
    return RingTracker(
        str(root), NODE, (lambda: jobs) if jobs is not None else (lambda: {5: UID}), young_s=0.0
    )


# ------------------------------------------------------------ the reader


HEADER_FIELD_NAMES = [name for name, _, _ in ring.HEADER_FIELDS if name != "node_name"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(HEADER_FIELD_NAMES),
    value=st.integers(0, 2**64 - 1),
    cut=st.one_of(st.none(), st.integers(0, ring.HEADER_SIZE + 64 * 64 + 64)),
    garbage=st.lists(st.tuples(st.integers(0, 63), st.binary(min_size=1, max_size=64)), max_size=6),
)
def test_reader_never_raises_anything_but_ring_error(tmp_path, field, value, cut, garbage):
    path = tmp_path / "r.ring"
    if path.exists():
        path.unlink()
    make_ring(path, records=ddp_records(40))
    raw = bytearray(path.read_bytes())
    off, s = ring._HDR[field]
    s.pack_into(
        raw,
        off,
        value % (1 << (8 * s.size))
        if s.format[-1] in "QI"
        else (value % (1 << (8 * s.size))) - (1 << (8 * s.size - 1)),
    )
    for slot, data in garbage:  # scribble over records, seq fields included
        o = ring.HEADER_SIZE + slot * 64
        raw[o : o + len(data)] = data[: max(0, len(raw) - o)]
    if cut is not None:
        raw = raw[:cut]
    path.write_bytes(bytes(raw))
    try:
        r = ring.RingReader(str(path))
    except ring.RingError:
        return
    with r:
        batch = r.read()
        for rec in batch.records:
            assert 0 < rec.op < len(ring.OP_NAMES) and rec.end_ns >= rec.start_ns
        assert batch.cursor <= max(r.write_counter, batch.cursor)


def test_fifo_symlink_sparse_oversize_and_shrinking_rings(tmp_path):
    good = make_ring(tmp_path / "good.ring", records=ddp_records(10))
    fifo = tmp_path / "fifo.ring"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(ring.RingError, match="not a regular file"):
        ring.RingReader(str(fifo))  # and never blocks
    assert time.monotonic() - t0 < 1.0
    link = tmp_path / "link.ring"
    link.symlink_to(good)
    with pytest.raises(ring.RingError, match="cannot open"):
        ring.RingReader(str(link))
    # a 4 KiB header claiming the largest geometry, the rest a hole
    sparse = tmp_path / "sparse.ring"
    raw = bytearray(good.read_bytes()[: ring.HEADER_SIZE])
    struct.pack_into("<I", raw, 20, ring.MAX_CAPACITY)
    sparse.write_bytes(bytes(raw))
    os.truncate(sparse, ring.HEADER_SIZE + ring.MAX_CAPACITY * ring.RECORD_SIZE)
    with pytest.raises(ring.RingError, match="sparse"):
        ring.RingReader(str(sparse))
    # a ring file extended to 1 TiB (2^62 where the file system allows it): refused, nothing mapped
    huge = tmp_path / "huge.ring"
    huge.write_bytes(good.read_bytes())
    os.truncate(huge, 1 << 40)
    with pytest.raises(ring.RingError, match="size"):
        ring.RingReader(str(huge))
    # a ring truncated while the reader holds it: a RingError, not SIGBUS
    shrink = tmp_path / "shrink.ring"
    shrink.write_bytes(good.read_bytes())
    r = ring.RingReader(str(shrink))
    os.truncate(shrink, 100)
    with pytest.raises(ring.RingError, match="truncated while open"):
        r.read()
    r.close()


# ------------------------------------------------------------ the tracker


def test_job_id_comes_from_the_directory_and_slurm_not_the_header(tmp_path):
    d = tmp_path / "5"
    d.mkdir()
    make_ring(d / "rank-0.step-0.torch.ring", job_id=999, records=ddp_records(30))
    tr = tracker(tmp_path)
    rings = tr.poll()
    assert [r.job_id for r in rings] == [5]
    # the same directory, but Slurm says job 5 does not run here: ignored (left for the epilog)
    gone = tracker(tmp_path, jobs={6: UID})
    assert gone.poll() == [] and gone.ignored_jobs == {5} and not any(gone.errors.values())
    # Slurm never answered yet: nothing is trusted
    assert RingTracker(str(tmp_path), NODE, lambda: None).poll() == []


def test_directory_of_another_user_or_a_symlink_is_untrusted(tmp_path):
    d = tmp_path / "5"
    d.mkdir()
    make_ring(d / "rank-0.step-0.torch.ring", records=ddp_records(30))
    tr = tracker(tmp_path, jobs={5: UID + 1})
    assert tr.poll() == [] and tr.errors["untrusted"] == 1
    assert tr.poll() == [] and tr.errors["untrusted"] == 1  # counted and logged once
    os.rename(d, tmp_path / "elsewhere")
    (tmp_path / "5").symlink_to(tmp_path / "elsewhere")
    tr = tracker(tmp_path)
    assert tr.poll() == [] and tr.errors["untrusted"] == 1


def test_broken_rings_are_skipped_counted_once_and_the_good_one_read(tmp_path, caplog):
    d = tmp_path / "5"
    d.mkdir()
    make_ring(d / "rank-0.step-0.torch.ring", records=ddp_records(30))
    os.mkfifo(d / "rank-1.step-0.torch.ring")
    (d / "rank-2.step-0.torch.ring").write_bytes(b"\0" * 5000)  # no magic, old
    make_ring(d / "rank-3.step-0.torch.ring", rank=7, world=2)  # not a rank of the job
    make_ring(d / "rank-4.step-0.torch.ring", node="node2")  # another node's: not an error
    raw = bytearray((d / "rank-0.step-0.torch.ring").read_bytes())
    struct.pack_into("<q", raw, 48, -(1 << 62))  # another boot's clock
    (d / "rank-5.step-0.torch.ring").write_bytes(bytes(raw))
    tr = tracker(tmp_path)
    for _ in range(3):
        rings = tr.poll()
    assert [r.header.global_rank for r in rings] == [0]
    assert tr.errors["invalid"] == 4
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 4  # once per file
    # replaced by a new file (new inode): looked at again
    (d / "rank-2.step-0.torch.ring").unlink()
    make_ring(d / "rank-2.step-0.torch.ring", rank=1, records=ddp_records(30))
    assert sorted(r.header.global_rank for r in tr.poll()) == [0, 1]


def test_records_in_completion_order_are_read_in_issue_order(tmp_path):
    d = tmp_path / "5"
    d.mkdir()
    recs = ddp_records(40)
    # async work completes out of issue order and the hook writes on completion
    recs = sorted(recs, key=lambda r: r["end_ns"] + (30_000_000 if r["start_ns"] % 3 else 0))
    w = ring.RingWriter(
        str(d / "rank-0.step-0.torch.ring"), capacity=64, global_rank=0, world_size=1, node_name=NODE
    )
    tr = tracker(tmp_path)
    for i, r in enumerate(recs):
        w.append(**r)
        if i % 7 == 0:
            tr.poll()
    rings = tr.poll()
    assert np.all(np.diff(rings[0].start_ns) >= 0)
    an = RankAnalyzer(POLICY.agent, POLICY.detection)
    rep = an.report(rings[0])
    assert rep.steps and all(s.step_s == pytest.approx(0.05, rel=1e-6) for s in rep.steps)
    w.close()


def test_the_window_holds_the_newest_ops_in_issue_order_however_they_arrive(tmp_path):
    """Batches that arrive in issue order are appended as they are (no sort);
    a batch with a late completion is merged by start time: either way the
    tracker holds the newest max_ops ops, as a stable sort of all of them would."""
    d = tmp_path / "5"
    d.mkdir()
    recs = ddp_records(300, period_ns=1_000_000)
    for i in range(200, 300, 10):  # in the newer part, every tenth completes late
        recs[i], recs[i + 1] = recs[i + 1], recs[i]
    w = ring.RingWriter(
        str(d / "rank-0.step-0.torch.ring"), capacity=512, global_rank=0, world_size=1, node_name=NODE
    )
    tr = RingTracker(str(tmp_path), NODE, lambda: {5: UID}, max_ops=64, young_s=0.0)
    written = []
    for i, r in enumerate(recs):
        w.append(**r)
        written.append(r["start_ns"])
        if i % 23 == 22 or i == len(recs) - 1:
            (t,) = tr.poll()
            want = sorted(written)[-64:]
            assert t.start_ns.tolist() == want and t.begin_ns.tolist() == want
            assert (t.end_ns - t.start_ns == 5_000_000).all()
    w.close()


def test_the_report_says_what_the_writer_has_in_flight(tmp_path):
    """A writer that keeps the header's in-flight count (the torch hook): the
    rank's report carries when its call entered, and none once it is left;
    a writer that does not keep it (the NCCL hook) reports nothing known."""
    d = tmp_path / "5"
    d.mkdir()
    w = ring.RingWriter(
        str(d / "rank-0.step-0.torch.ring"),
        capacity=64,
        global_rank=0,
        world_size=2,
        node_name=NODE,
        tracks_in_flight=True,
    )
    make_ring(d / "rank-1.step-0.nccl.ring", rank=1, records=ddp_records(20))
    for r in ddp_records(20):
        w.append(**r)
    tr = tracker(tmp_path)
    an = {0: RankAnalyzer(POLICY.agent, POLICY.detection), 1: RankAnalyzer(POLICY.agent, POLICY.detection)}

    offset = {}

    def reports():
        tracked = tr.poll()
        offset.update({t.header.global_rank: t.header.clock_offset_ns for t in tracked})
        return {t.header.global_rank: an[t.header.global_rank].report(t) for t in tracked}

    rep = reports()
    assert rep[0].in_flight_known and rep[0].in_flight_since is None  # between collectives
    assert not rep[1].in_flight_known and rep[1].in_flight_since is None
    entered = time.monotonic_ns()
    w.enter(entered)
    w.enter(entered + 5)  # a second call in flight keeps the first one's start
    rep = reports()
    since = rep[0].in_flight_since
    assert since == pytest.approx((entered + offset[0]) / 1e9, abs=1e-6)
    w.leave()
    assert reports()[0].in_flight_since == since
    w.leave()
    assert reports()[0].in_flight_since is None
    # the NCCL hook keeps the count only while its GPU timing is on, and
    # clears the flag when timing goes off: read afresh, the rank is unknown again
    w.enter(time.monotonic_ns())
    w._put("header_flags", 0)
    rep = reports()
    assert not rep[0].in_flight_known and rep[0].in_flight_since is None
    w.close()


WRITER = """
import sys, time
from slurmguard.hook import ring
w = ring.RingWriter(sys.argv[1], capacity=64, global_rank=0, world_size=1, node_name=sys.argv[2])
print("ready", flush=True)
time.sleep(60)
"""


def test_the_report_says_when_the_writer_is_stopped(tmp_path):
    """A rank frozen with SIGSTOP (as a hung node would hold it): its report says
    it is stopped, and no longer once it runs again. A stopped process whose PID
    a ring names but that started after the ring was created (a PID reused by
    another process) is not taken for the rank."""
    import signal
    import subprocess
    import sys

    d = tmp_path / "5"
    d.mkdir()
    path = d / "rank-0.step-0.torch.ring"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), NODE], stdout=subprocess.PIPE, text=True
    )
    other = None
    try:
        assert writer.stdout.readline().strip() == "ready"
        tr = tracker(tmp_path)
        an = RankAnalyzer(POLICY.agent, POLICY.detection)

        def report():
            (t,) = tr.poll()
            return an.report(t)

        def signal_and_wait(p, sig, state):
            """A signal is delivered asynchronously: wait for its state."""
            p.send_signal(sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with open(f"/proc/{p.pid}/stat", "rb") as fh:
                    if fh.read().rsplit(b")", 1)[1].split()[0] in state:
                        return
                time.sleep(0.01)
            raise AssertionError(f"process {p.pid} never reached state {state!r}")

        assert not report().stopped
        signal_and_wait(writer, signal.SIGSTOP, (b"T",))
        assert report().stopped
        signal_and_wait(writer, signal.SIGCONT, (b"S", b"R"))
        assert not report().stopped
        time.sleep(0.05)  # five clock ticks after the ring's creation at least
        other = subprocess.Popen(["sleep", "60"])
        signal_and_wait(other, signal.SIGSTOP, (b"T",))
        with open(path, "r+b") as fh:  # the ring now names the later process
            fh.seek(dict((n, o) for n, o, _ in ring.HEADER_FIELDS)["pid"])
            fh.write(struct.pack("<I", other.pid))
        tr = tracker(tmp_path)
        assert not report().stopped
    finally:
        for p in (writer, other):
            if p is not None:
                p.kill()
                p.wait()


IO_WRITER = """
import sys, time
from slurmguard.hook import ring
w = ring.RingWriter(sys.argv[1], capacity=64, global_rank=0, world_size=1, node_name=sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    with open(sys.argv[3], "wb") as fh:
        fh.write(b"x" * (int(line) << 20))  # a checkpoint's bytes
    print("written", flush=True)
"""


def test_the_report_says_when_the_writer_was_last_busy_with_io(tmp_path):
    """A rank writing megabytes (a checkpoint save) between two looks of the
    agent is busy with I/O at the second; one that only waits is not, and its
    report keeps the last busy look. A process whose PID the ring names but that
    started after the ring was created is not the rank: its I/O is never read."""
    import subprocess
    import sys

    from slurmguard.agent.rings import IO_ACTIVE_BYTES_S

    d = tmp_path / "5"
    d.mkdir()
    path = d / "rank-0.step-0.torch.ring"
    writer = subprocess.Popen(
        [sys.executable, "-c", IO_WRITER, str(path), NODE, str(tmp_path / "ckpt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    other = None
    try:
        assert writer.stdout.readline().strip() == "ready"
        (t,) = tracker(tmp_path).poll()
        an = RankAnalyzer(POLICY.agent, POLICY.detection)

        def write(mb: int) -> None:
            writer.stdin.write(f"{mb}\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "written"

        assert t.look_at_io(1000.0) is None  # a first look has nothing to compare with
        write(8)  # 8 MiB in the 2 s to the next look: 4 MiB/s
        assert t.look_at_io(1002.0) == 1002.0
        assert an.report(t).last_io == 1002.0
        assert t.look_at_io(1003.0) == 1002.0  # idle since: the last busy look stays
        # under the rate over a long gap: 1 MiB in 10 s is not a save
        write(1)
        assert 10 * IO_ACTIVE_BYTES_S > 1 << 20
        assert t.look_at_io(1013.0) == 1002.0
        assert an.report(t).last_io == 1002.0

        time.sleep(0.05)  # five clock ticks after the ring's creation at least
        other = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; [open('/dev/null', 'wb').write(b'x' * (64 << 20)) for _ in sys.stdin]",
            ],
            stdin=subprocess.PIPE,
            text=True,
        )
        with open(path, "r+b") as fh:  # the ring now names the later process
            fh.seek(dict((n, o) for n, o, _ in ring.HEADER_FIELDS)["pid"])
            fh.write(struct.pack("<I", other.pid))
        (t,) = tracker(tmp_path).poll()
        assert t.look_at_io(2000.0) is None
        other.stdin.write("go\n")
        other.stdin.flush()
        time.sleep(0.3)
        assert t.look_at_io(2001.0) is None and t.io_bytes is None
    finally:
        for p in (writer, other):
            if p is not None:
                p.kill()
                p.wait()


# ------------------------------------------------------- tracker + analysis

record = st.fixed_dictionaries(
    {
        "op": st.sampled_from([1, 2, 3, 4, 7, 8, 11, 14]),
        "comm_id": st.sampled_from([0, 1, 2, 2**64 - 1]),
        "count": st.integers(0, 2**20),
        "nbytes": st.sampled_from([0, 4, 4000, 2**63 + 5]),
        "start_ns": st.integers(0, 2**64 - 1),
        "dur": st.integers(0, 2**40),
        "peer": st.integers(-1, 8),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=st.lists(record, max_size=120), mode=st.sampled_from(["random", "near", "ddp"]))
def test_tracker_and_analysis_never_raise_and_samples_make_sense(tmp_path, recs, mode):
    root = tmp_path / f"r{time.monotonic_ns()}"
    d = root / "5"
    d.mkdir(parents=True)
    now = time.monotonic_ns()
    rows = []
    for i, r in enumerate(recs):
        start = r["start_ns"]
        if mode == "near":  # plausible times, arbitrary order and ops
            start = now - (start % 10**10)
        elif mode == "ddp":  # a periodic job with random jitter and reordering
            start = now - 10**10 + i * 50_000_000 + (start % 20_000_000)
        end = min(start + r["dur"], 2**64 - 1)
        rows.append(
            dict(
                op=r["op"],
                comm_id=r["comm_id"],
                count=r["count"],
                nbytes=r["nbytes"],
                start_ns=start,
                end_ns=end,
                peer=r["peer"],
            )
        )
    make_ring(d / "rank-0.step-0.torch.ring", world=1, capacity=256, records=rows)
    tr = tracker(root)
    an = RankAnalyzer(POLICY.agent, POLICY.detection)
    for _ in range(2):
        for t in tr.poll():
            rep = an.report(t)
            for s in rep.steps:
                assert np.isfinite(s.step_s) and 0 < s.step_s <= 86400
                assert 0 <= s.comm_s <= s.step_s and np.isfinite(s.end)


def test_a_writer_killed_mid_record_leaves_a_readable_ring(tmp_path):
    """The hook's writer is SIGKILLed between reserving a record and
    committing it: the hole is skipped once later records exist, never an error."""
    d = tmp_path / "5"
    d.mkdir()
    path = d / "rank-0.step-0.torch.ring"
    make_ring(path, world=1, records=ddp_records(30))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 192, 31)  # record 30 reserved, never committed
    path.write_bytes(bytes(raw))
    tr = tracker(tmp_path)
    rings = tr.poll()
    assert len(rings) == 1 and len(rings[0].start_ns) == 30 and not any(tr.errors.values())


def test_poll_survives_the_ring_root_changing_underneath(tmp_path):
    """Rings appear and vanish (epilog) while the tracker polls from another thread."""
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            d = tmp_path / "5"
            d.mkdir(exist_ok=True)
            p = d / f"rank-{i % 2}.step-0.torch.ring"
            try:
                make_ring(p, rank=i % 2, records=ddp_records(20))
            except FileExistsError:
                pass
            if i % 3 == 0:
                for f in d.iterdir():
                    f.unlink(missing_ok=True)
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        tr = tracker(tmp_path)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            tr.poll()
    finally:
        stop.set()
        t.join()
    tr.close()


def test_the_iteration_count_keeps_up_past_the_period_window(tmp_path):
    """The anchors come from the newest period.window_ops ops; the tracker
    holds up to agent.max_ops_per_rank. Between the two the count must go
    on: a GPipe stage's (8 ops an iteration, 8,192-op window, 16,384 held)
    stood at 1,024 for its next 1,024 iterations."""
    policy = Policy.model_validate({"detection": {"period": {"window_ops": 256}}})
    d = tmp_path / "5"
    d.mkdir()
    # two ops an iteration: a long gap (compute), then two collectives 1 ms apart
    t0 = time.monotonic_ns() - 2_000 * 20_000_000
    recs = []
    for i in range(2_000):
        s = t0 + i * 20_000_000
        for j, op in enumerate(("allreduce", "broadcast")):
            recs.append(
                dict(
                    op=ring.OP[op],
                    comm_id=7,
                    count=10,
                    nbytes=40,
                    start_ns=s + j * 1_000_000,
                    end_ns=s + j * 1_000_000 + 500_000,
                )
            )
    w = ring.RingWriter(
        str(d / "rank-0.step-0.torch.ring"), capacity=8192, global_rank=0, world_size=1, node_name=NODE
    )
    tr = RingTracker(str(tmp_path), NODE, lambda: {5: UID}, max_ops=1024, young_s=0.0)
    an = RankAnalyzer(policy.agent, policy.detection)
    counts = []
    for i, r in enumerate(recs):
        w.append(**r)
        if i % 100 == 99:
            (t,) = tr.poll()
            an.report(t)
            counts.append((i + 1) // 2 - an.total_steps)
    w.close()
    # every poll: all the iterations started, the one in progress at most uncounted
    assert max(counts) <= 1 and min(counts) >= 0, counts
