"""The vectorised ring reader (RingReader.read_array, and read() built on it)
against a per-record reference: same records, same cursor, same lost /
corrupt / abandoned counts, on random rings that wrapped, were corrupted,
hold holes a dead writer left and records rewritten while being copied.

`reference_read` is the test oracle only: the reader as it was before it
took a batch as one array (one struct.unpack and one object per record),
kept here so that the fast path is checked against a plain statement of the
rules, not against itself."""

from __future__ import annotations

import struct
from dataclasses import astuple

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmguard.hook import ring

_REC = struct.Struct("<" + "".join(code for _, _, code in ring.RECORD_FIELDS))
_U64 = struct.Struct("<Q")


def _plausible(r: ring.RingRecord) -> bool:
    return (
        0 < r.op < len(ring.OP_NAMES)
        and r.datatype < len(ring.DATATYPE_NAMES)
        and r.redop < len(ring.REDOP_NAMES)
        and r.end_ns >= r.start_ns
        and (not r.flags & ring.F_GPU_TIME or r.gpu_end_ns >= r.gpu_start_ns)
    )


def reference_read(rd: ring.RingReader, cursor: int | None, max_records: int | None) -> ring.ReadBatch:
    """One record at a time, in order (the oracle; see the module docstring)."""
    wc = rd.write_counter
    out = ring.ReadBatch()
    if cursor is None:
        cursor = max(0, wc - rd.capacity)
    if wc - cursor > rd.capacity:
        out.lost += wc - rd.capacity - cursor
        cursor = wc - rd.capacity
    while cursor < wc and (max_records is None or len(out.records) < max_records):
        count = min(wc - cursor, ring._CHUNK, rd.capacity - (cursor & rd._mask))
        if max_records is not None:
            count = min(count, max_records - len(out.records))
        a, b = rd._chunk(cursor, count)
        stop = False
        for i in range(count):
            n, o = cursor, i * ring.RECORD_SIZE
            s1 = _U64.unpack_from(a, o)[0]
            if s1 < n + 1:
                if rd._give_up(cursor, wc):
                    out.abandoned += 1
                    cursor += 1
                    continue
                stop = True
                break
            if s1 > n + 1 or _U64.unpack_from(b, o)[0] != s1:
                out.lost += 1
            else:
                rec = ring.RingRecord(*_REC.unpack_from(a, o))
                if rec.op == 0:
                    pass
                elif _plausible(rec):
                    out.records.append(rec)
                else:
                    out.corrupt += 1
            cursor += 1
        if stop:
            break
    out.cursor = cursor
    return out


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _TornReader(ring.RingReader):
    """A reader whose second copy of the records finds some rewritten (a
    writer lapping the reader between the two copies): by record number."""

    torn: frozenset[int] = frozenset()

    def _chunk(self, cursor: int, count: int) -> tuple[bytes, bytes]:
        a, b = super()._chunk(cursor, count)
        bb = bytearray(b)
        for i in range(count):
            if cursor + i in self.torn:
                _U64.pack_into(bb, i * ring.RECORD_SIZE, 0)
        return a, bytes(bb)


# one damage to one slot: (field offset, struct code, value)
_DAMAGE = st.sampled_from(
    [
        (0, "Q", "seq-"),  # not committed (a hole, or the tail)
        (0, "Q", "seq+"),  # overwritten by a later lap
        (52, "H", 0),  # padding
        (52, "H", 999),  # op out of range
        (54, "B", 200),  # datatype out of range
        (55, "B", 77),  # redop out of range
        (40, "Q", 0),  # ends before it starts
        (56, "I", ring.F_GPU_TIME),  # GPU time ...
        (64, "Q", 1 << 62),  # ... starting after it ends
        (72, "Q", 1 << 63),  # a GPU end past int64
        (8, "Q", (1 << 64) - 1),  # harmless: a huge communicator id
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    capacity=st.sampled_from([16, 32]),
    n=st.integers(0, 100),
    reserved=st.integers(0, 4),
    damage=st.lists(st.tuples(st.integers(0, 31), _DAMAGE), max_size=12),
    torn=st.frozensets(st.integers(0, 110), max_size=6),
    reads=st.lists(
        st.tuples(st.one_of(st.none(), st.integers(0, 110)), st.one_of(st.none(), st.integers(1, 40))),
        min_size=1,
        max_size=4,
    ),
    advance=st.sampled_from([0.0, 10.0]),
    chunk=st.sampled_from([3, 4096]),
)
def test_array_reader_equals_the_per_record_reference(
    tmp_path_factory, monkeypatch, capacity, n, reserved, damage, torn, reads, advance, chunk
):
    path = tmp_path_factory.mktemp("ring") / "r.ring"
    w = ring.RingWriter(str(path), capacity=capacity, source=ring.SOURCE_TEST)
    for i in range(n):
        w.append(
            ring.OP["allreduce"] if i % 5 else ring.OP["send"],
            comm_id=i % 3 + 1,
            count=i,
            nbytes=4 * i,
            start_ns=1000 + i,
            end_ns=1010 + 2 * i,
            peer=i % 4 - 1,
            datatype=i % len(ring.DATATYPE_NAMES),
            redop=i % len(ring.REDOP_NAMES),
            flags=ring.F_GPU_TIME if i % 7 == 0 else 0,
            gpu_start_ns=2000 + i,
            gpu_end_ns=2005 + i,
            coll_seq=i,
        )
    w.close()
    raw = bytearray(path.read_bytes())
    _U64.pack_into(raw, 192, n + reserved)  # numbers reserved past the newest record
    for slot, (off, code, value) in damage:
        at = ring.HEADER_SIZE + (slot % capacity) * ring.RECORD_SIZE + off
        if value == "seq-":
            value = max(0, _U64.unpack_from(raw, at)[0] - 1)
        elif value == "seq+":
            value = _U64.unpack_from(raw, at)[0] + capacity
        struct.pack_into("<" + code, raw, at, value)
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(ring, "_CHUNK", chunk)  # records copied per pread: chunk edges too

    clocks = _Clock(), _Clock()
    fast = _TornReader(str(path), stall_s=5.0, clock=clocks[0])
    ref = _TornReader(str(path), stall_s=5.0, clock=clocks[1])
    fast.torn = ref.torn = torn
    try:
        fast_cur: int | None = None
        ref_cur: int | None = None
        for cursor, max_records in reads:
            # a read from where the last one ended, or from anywhere
            fc = fast_cur if cursor is None else cursor
            rc = ref_cur if cursor is None else cursor
            got = fast.read_array(fc, max_records)
            want = reference_read(ref, rc, max_records)
            assert (got.cursor, got.lost, got.corrupt, got.abandoned) == (
                want.cursor,
                want.lost,
                want.corrupt,
                want.abandoned,
            )
            assert got.records.dtype == ring.record_dtype()
            assert got.records.tolist() == [astuple(r) for r in want.records]
            fast_cur, ref_cur = got.cursor, want.cursor
            for c in clocks:
                c.t += advance  # holes with committed records after them are given up
        # read() is read_array's records as RingRecords
        objs = fast.read(0)
        arr = ref.read_array(0)
        assert [r.seq for r in objs.records] == arr.records["seq"].tolist()
        assert (objs.cursor, objs.lost, objs.corrupt) == (arr.cursor, arr.lost, arr.corrupt)
    finally:
        fast.close()
        ref.close()


def test_record_dtype_is_the_record_layout():
    dt = ring.record_dtype()
    assert dt.itemsize == ring.RECORD_SIZE
    assert [(name, dt.fields[name][1]) for name in dt.names] == [
        (name, off) for name, off, _ in ring.RECORD_FIELDS
    ]
    assert dt.fields["peer"][0] == np.dtype("<i4") and dt.fields["op"][0] == np.dtype("<u2")
