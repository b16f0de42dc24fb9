"""Recognise a ring file by its header (spank_plugin/sg_ring.h), without reading records.

The epilog only needs to know that a file is a ring (the magic), whose node
wrote it (node_name) and how big it may be (header_size + capacity *
record_size, the size sg_ring_create allocates), so it reads the first 136
bytes: magic .. node_name. Records are never parsed here.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# The layout comes from the one Python mirror of sg_ring.h (checked field by
# field against the C header in tests/test_hook_ring_format.py).
from slurmguard.hook.ring import HEADER_FIELDS, MAGIC, MAX_CAPACITY, NODE_NAME_LEN
from slurmguard.hook.ring import SOURCE_NAMES as SOURCES

#: magic .. node_name: the contiguous leading fields of struct sg_ring_header
_LEADING = HEADER_FIELDS[: [name for name, _, _ in HEADER_FIELDS].index("node_name") + 1]
PREFIX = struct.Struct("<" + "".join(code for _, _, code in _LEADING))
assert PREFIX.size == _LEADING[-1][1] + NODE_NAME_LEN  # no gaps before node_name


@dataclass(frozen=True)
class RingHeader:
    version: int
    header_size: int
    record_size: int
    capacity: int
    job_id: int
    step_id: int
    global_rank: int
    local_rank: int
    world_size: int
    pid: int
    source: str
    node_name: str

    @property
    def file_size(self) -> int:
        """Bytes sg_ring_create allocates for this header."""
        return self.header_size + self.capacity * self.record_size


class NotARing(Exception):
    """The file is not a (complete) ring; the message says why, in a few words."""


def parse_header(prefix: bytes, size: int) -> RingHeader:
    """Header of a ring whose first bytes are `prefix` and whose length is `size` bytes."""
    if len(prefix) < 8 or int.from_bytes(prefix[:8], "little") != MAGIC:
        raise NotARing("no ring magic")
    if len(prefix) < PREFIX.size:
        raise NotARing(f"truncated header ({len(prefix)} bytes)")
    (_magic, version, header_size, record_size, capacity, job_id, step_id, grank, lrank,
     world, pid, _off, _created, source, _flags, raw_name) = PREFIX.unpack_from(prefix)
    if header_size < PREFIX.size or record_size == 0 or capacity == 0 or \
            capacity & (capacity - 1) or capacity > MAX_CAPACITY:
        raise NotARing(f"implausible header (header_size {header_size}, record_size "
                       f"{record_size}, capacity {capacity})")
    hdr = RingHeader(version, header_size, record_size, capacity, job_id, step_id, grank, lrank,
                     world, pid, SOURCES.get(source, str(source)),
                     raw_name.split(b"\0", 1)[0].decode("utf-8", "replace"))
    if size != hdr.file_size:
        raise NotARing(f"size {size} bytes, header says {hdr.file_size}")
    return hdr


def read_header(fd: int) -> RingHeader:
    """Header of the open regular file `fd` (position unchanged)."""
    size = os.fstat(fd).st_size
    return parse_header(os.pread(fd, PREFIX.size, 0), size)
