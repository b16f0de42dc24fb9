"""Find the rings of this node's guarded jobs and read what is new in them.

Layout (written by the SPANK plugin and the hooks): <ring_root>/<job_id>/*.ring,
one file per rank and source. Several nodes may share one ring root (the
development cluster shares /dev/shm), so a ring is taken only when its
header names this node. A file is identified by (inode, created_ns): a
requeued job that writes a ring under the same name is a new ring.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slurmguard.hook.ring import RingError, RingHeader, RingReader

log = logging.getLogger("slurmguard.agent.rings")

# op codes that are bookkeeping, not collectives (sg_ring.h)
_NOT_COLLECTIVE = {0, 9, 10, 11, 12, 13, 17, 18}
# Records written before completion would carry this bit; today's hooks write
# on completion only, so no op is ever seen in flight (stalls are found from
# the lack of progress instead, see controller/assess.py).
_PENDING = 0x02


@dataclass
class TrackedRing:
    """One rank's ring and the collectives read from it so far (bounded)."""

    key: tuple[int, int]
    reader: RingReader
    header: RingHeader
    cursor: int | None = None
    lost: int = 0
    corrupt: int = 0
    op: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    comm: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    start_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    end_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    in_flight_since_ns: int | None = None

    @property
    def job_id(self) -> int:
        return self.header.job_id

    def to_unix_s(self, mono_ns: int | float) -> float:
        return (mono_ns + self.header.clock_offset_ns) / 1e9


class RingTracker:
    """Polls ring_root for this node's rings; keeps at most max_ops per rank."""

    def __init__(self, ring_root: str | Path, node: str, max_ops: int = 16384) -> None:
        self.root = Path(ring_root)
        self.node = node
        self.max_ops = max_ops
        self.rings: dict[str, TrackedRing] = {}
        self.skipped: dict[str, str] = {}

    def poll(self) -> list[TrackedRing]:
        """Discover new rings, drop vanished ones, read new records; returns live rings."""
        seen: set[str] = set()
        for path in self._candidates():
            seen.add(path)
            try:
                st = os.stat(path)
            except OSError:
                continue
            tr = self.rings.get(path)
            if tr is not None and tr.key[0] != st.st_ino:
                self._drop(path)
                tr = None
            if tr is None:
                if path in self.skipped:
                    continue
                tr = self._open(path, st.st_ino)
                if tr is None:
                    continue
            self._read(path, tr)
        for path in list(self.rings):
            if path not in seen:
                self._drop(path)
        self.skipped = {p: why for p, why in self.skipped.items() if p in seen}
        return list(self.rings.values())

    def _candidates(self) -> list[str]:
        if not self.root.is_dir():
            return []
        out = []
        for job_dir in self.root.iterdir():
            if not job_dir.name.isdigit():
                continue
            try:
                out.extend(str(p) for p in job_dir.glob("*.ring"))
            except OSError:
                continue  # removed by the epilog while we looked
        return sorted(out)

    def _open(self, path: str, ino: int) -> TrackedRing | None:
        try:
            reader = RingReader(path)
        except RingError as exc:
            # a ring being created has no magic (or size) yet: retry for a few
            # seconds; after that a bad file is skipped and reported once
            try:
                young = time.time() - os.stat(path).st_mtime < 10.0
            except OSError:
                return None
            if not young:
                self.skipped[path] = str(exc)
                log.warning("skipping ring: %s", exc)
            return None
        h = reader.header
        if h.node_name and h.node_name != self.node:
            reader.close()
            self.skipped[path] = f"ring of node {h.node_name}"
            return None
        tr = TrackedRing((ino, h.created_ns), reader, h)
        self.rings[path] = tr
        return tr

    def _drop(self, path: str) -> None:
        tr = self.rings.pop(path, None)
        if tr is not None:
            tr.reader.close()

    def _read(self, path: str, tr: TrackedRing) -> None:
        try:
            batch = tr.reader.read(tr.cursor)
        except (OSError, ValueError) as exc:
            log.warning("ring %s unreadable: %s", path, exc)
            self._drop(path)
            return
        tr.cursor = batch.cursor
        tr.lost += batch.lost
        tr.corrupt += batch.corrupt
        recs = [r for r in batch.records if r.op not in _NOT_COLLECTIVE]
        pending = [r for r in recs if r.flags & _PENDING]
        done = [r for r in recs if not r.flags & _PENDING]
        tr.in_flight_since_ns = min((r.start_ns for r in pending), default=None)
        if not done:
            return
        # communicator ids are unsigned 64-bit: fold to int64 (only equality matters)
        a = np.array([(r.op, r.comm_id - (1 << 64) if r.comm_id >= 1 << 63 else r.comm_id,
                       r.bytes, r.start_ns, r.end_ns) for r in done], dtype=np.int64)
        tr.op = np.concatenate([tr.op, a[:, 0]])[-self.max_ops:]
        tr.comm = np.concatenate([tr.comm, a[:, 1]])[-self.max_ops:]
        tr.nbytes = np.concatenate([tr.nbytes, a[:, 2]])[-self.max_ops:]
        tr.start_ns = np.concatenate([tr.start_ns, a[:, 3]])[-self.max_ops:]
        tr.end_ns = np.concatenate([tr.end_ns, a[:, 4]])[-self.max_ops:]

    def close(self) -> None:
        for path in list(self.rings):
            self._drop(path)
