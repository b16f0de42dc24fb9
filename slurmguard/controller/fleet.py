"""The controller's in-memory view of what the agents reported.

The latest report of each node is kept for its step windows: reports carry
rolling windows, so the latest one is all the controller needs, and a restarted
controller is whole again after one report per node. Telemetry is different:
an agent sends only the samples since its previous report, so every report's
samples are kept until the next scoring takes them (`take_telemetry`): each
sample is scored once, none is lost when several reports arrive between two
scorings, and a report that arrives while a cycle runs waits for the next one.
The peer scorer compares each device's mean of a signal over the window
(detect.peers), so samples of the signals it scores are summed as they arrive,
one (sum, count) per node, device and signal (a node's as lists, a report with
the node's usual keys added a list at a time), and a window hands the scorer
the sums as they are (swapped out), each mean computed as the scorer reads it
(`DeviceMeans`): no dictionary of means is built, neither in the cycle (at
10,000 nodes that cost it 0.05-0.12 s, at 50,000 0.35-0.65 s) nor by the
ingesting thread (an entry per device signal and report, in a dictionary of the
fleet's device signals: 16 a report were 21k of the 121k instructions of keeping
one at 10,000 nodes; reading the means costs the cycle about 0.7k instructions a
mean more than reading a dictionary's, 11k a report of 16). The cycle's cost does
not grow with the sampling rate, and the ingesting thread does the adding. Samples
of other signals (hard failures: XIDs, a GPU lost, a link down) are kept as sent.
(epoch, seq) from one node must grow (epoch: the agent process's start): a
replayed or reordered report is refused, a restarted agent's first report is
taken.

What is kept is bounded by the policy: at most `keep_steps` iterations per rank
(the newest; stored as arrays, 24 bytes an iteration) and `keep_samples`
telemetry entries per node (device signal sums, and samples kept as sent: the
oldest of these are dropped, and a sum for one more device signal is refused,
both counted in `dropped_samples`). Nodes Slurm no longer knows are evicted
with everything kept for them.

Nothing a node reports about a job is trusted beyond that node: `job_ranks`
keeps only ranks reported by nodes Slurm allocated to the job, and counts the
others (`foreign_ranks`). Reports from nodes Slurm does not know are refused
(`set_known_nodes`), so the table cannot grow past the cluster.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import ItemsView, Iterable, Iterator, Mapping
from itertools import chain
from typing import NamedTuple

import numpy as np

from slurmguard.detect.peers import BAD_DIRECTION
from slurmguard.telemetry.base import TelemetrySample
from slurmguard.wire import (
    AgentReport,
    JobReport,
    RankReport,
    StepWindow,
    TelemetryColumns,
    TelemetryKey,
    UnavailableSignal,
)

#: signals the peer scorer averages per device over a window (summed at ingest)
_AVERAGED = frozenset(BAD_DIRECTION)
#: (node, signal, gpu, nic): one device signal of one node
_DeviceSignal = tuple[str, str, int | None, str | None]

DEFAULT_KEEP_STEPS = 256
DEFAULT_KEEP_SAMPLES = 4096


def compact_rank(rank: RankReport, keep: int) -> RankReport:
    """The rank with its newest `keep` iterations as a StepWindow (fields unchanged);
    a packed window (schema version 2) that fits is kept as it came."""
    w = StepWindow.of(rank.steps, keep)
    return rank if w is rank.steps else rank.model_copy(update={"steps": w})


class TelemetryWindow(NamedTuple):
    """What one peer window scores (FleetView.take_telemetry)."""

    means: DeviceMeans
    """(node, signal, gpu, nic) -> mean of that device signal's samples (PeerScorer.window)."""
    samples: list[TelemetrySample]
    """Samples kept as sent (hard-failure signals)."""
    # a field named count shadows tuple.count, which nothing calls on a window
    count: int  # type: ignore[assignment]
    """Samples the window stands for."""

    def __bool__(self) -> bool:
        return self.count > 0


def _compact(jobs: list[JobReport], keep: int) -> bool:
    """Whether every rank's window is a StepWindow of at most `keep` iterations (what
    decode_report reads from the agents of this release, at their default lengths)."""
    # loops, not any() over a generator: 18k instructions a report of 8 ranks, not 24k
    for j in jobs:
        for r in j.ranks:
            w = r.steps
            if type(w) is not StepWindow or len(w) > keep:
                return False
    return True


def _compact_job(job: JobReport, keep: int) -> JobReport:
    ranks = [compact_rank(r, keep) for r in job.ranks]
    if all(a is b for a, b in zip(ranks, job.ranks)):
        return job  # packed windows that fit (wire format 2): nothing to copy
    return job.model_copy(update={"ranks": ranks})


class _Layout(NamedTuple):
    """A node's usual telemetry keys (its agent sends the same devices and signals each
    report) and the device signal each is summed in, key i in gkeys[i]: every key
    summed, none twice."""

    keys: list[TelemetryKey]
    gkeys: tuple[_DeviceSignal, ...]


class _NodeSums:
    """One node's device signals summed this window: slot i is (node, signal, gpu, nic)
    gkeys[i] with the sum total[i] of count[i] samples. `layout`: the node's layout
    while its slots are that layout's, else None (a report with the layout's keys
    then adds its columns a list at a time); `index`: slot by device signal, built
    when a report is added key by key."""

    __slots__ = ("layout", "gkeys", "index", "total", "count")

    def __init__(
        self, layout: _Layout | None = None, total: list[float] | None = None, count: list[int] | None = None
    ) -> None:
        self.layout = layout
        self.gkeys: list[_DeviceSignal] | tuple[_DeviceSignal, ...] = () if layout is None else layout.gkeys
        self.index: dict[_DeviceSignal, int] | None = None
        self.total: list[float] = total or []
        self.count: list[int] = count or []


class DeviceMeans(Mapping[_DeviceSignal, float]):
    """(node, signal, gpu, nic) -> the mean of that device signal's samples in one
    window (TelemetryWindow.means), from the window's sums, which nothing changes
    once taken. The peer scorer reads each mean once, through `items()`, which
    computes them as they are read; looking one up builds the dictionary, once."""

    __slots__ = ("_sums", "_built")

    def __init__(self, sums: dict[str, _NodeSums]) -> None:
        self._sums = sums
        self._built: dict[_DeviceSignal, float] | None = None

    def items(self) -> _MeanItems:
        return _MeanItems(self)

    def _pairs(self) -> Iterator[tuple[_DeviceSignal, float]]:
        # iterators of C throughout, a Python frame resumed a node and not a mean (read
        # through a generator's `yield from` a mean cost 1.4k instructions, so 1.2k)
        return chain.from_iterable(
            zip(acc.gkeys, map(operator.truediv, acc.total, acc.count)) for acc in self._sums.values()
        )

    def __getitem__(self, key: _DeviceSignal) -> float:
        if self._built is None:
            self._built = dict(self._pairs())
        return self._built[key]

    def __iter__(self) -> Iterator[_DeviceSignal]:
        return chain.from_iterable(acc.gkeys for acc in self._sums.values())

    def __len__(self) -> int:
        return sum(len(acc.gkeys) for acc in self._sums.values())


class _MeanItems(ItemsView[_DeviceSignal, float]):
    """DeviceMeans' (device signal, mean) pairs, each mean computed as it is read."""

    def __init__(self, means: DeviceMeans) -> None:
        super().__init__(means)
        self._means = means

    def __iter__(self) -> Iterator[tuple[_DeviceSignal, float]]:
        return self._means._pairs()  # noqa: SLF001 - its own view


class Received(NamedTuple):
    report: AgentReport
    received_at: float


class FleetView:
    """Thread-safe: the HTTP server ingests while the control loop reads.

    keep_steps: iterations kept per rank (controller.keep_steps_per_rank);
    keep_samples: telemetry samples queued per node until scored
    (controller.keep_samples_per_node)."""

    def __init__(
        self,
        stale_s: float = 120.0,
        *,
        keep_steps: int = DEFAULT_KEEP_STEPS,
        keep_samples: int = DEFAULT_KEEP_SAMPLES,
    ) -> None:
        self.stale_s = stale_s
        self.keep_steps = keep_steps
        self.keep_samples = keep_samples
        self._latest: dict[str, Received] = {}
        self._seq: dict[str, tuple[int, int]] = {}
        self._samples: dict[str, deque[TelemetrySample]] = {}
        self._sums: dict[str, _NodeSums] = {}
        """node -> the sums and counts of its device signals' samples, until scored."""
        self._layouts: dict[str, _Layout] = {}
        """node -> its usual telemetry keys (kept across windows: an agent's first report
        of a window is added a list at a time too)."""
        self._summed = 0
        """Samples in _sums."""
        self.samples_taken = 0
        """Telemetry samples handed to scoring (cumulative): a sum of k samples counts k."""
        self._lock = threading.Lock()
        self._known: frozenset[str] | None = None
        self.rejected = 0
        self.unknown_nodes = 0
        self.dropped_samples = 0
        """Telemetry samples dropped because a node queued more than keep_samples (cumulative)."""
        self.foreign_ranks = 0
        """Ranks dropped because their node is not in the job's allocation (cumulative)."""

    def set_known_nodes(self, nodes: Iterable[str] | None) -> list[str]:
        """The nodes Slurm knows (from the last cycle); None = accept any node.
        Returns the nodes evicted (reported before, unknown to Slurm now)."""
        with self._lock:
            self._known = None if nodes is None else frozenset(nodes)
            if self._known is None:
                return []
            gone = [n for n in self._latest if n not in self._known]
            gone += [
                n
                for n in {*self._samples, *self._sums, *self._layouts}
                if n not in self._known and n not in self._latest
            ]
            for n in gone:
                self._latest.pop(n, None)
                self._seq.pop(n, None)
                self._samples.pop(n, None)
                self._layouts.pop(n, None)
                acc = self._sums.pop(n, None)
                if acc is not None:
                    self._summed -= sum(acc.count)
            return gone

    def known(self, node: str) -> bool:
        k = self._known
        return k is None or node in k

    def ingest(self, report: AgentReport, received_at: float) -> bool:
        """Keep the report unless (epoch, seq) is not newer than the node's last one,
        or Slurm does not know the node. Its step windows are kept compact (the
        newest keep_steps per rank), its telemetry is queued for scoring."""
        node = report.node
        key = (report.epoch, report.seq)
        if not self.known(node):
            with self._lock:
                self.unknown_nodes += 1
            return False
        # the copying is done outside the lock, the check repeated inside
        last = self._seq.get(node)
        if last is not None and key <= last:
            with self._lock:
                self.rejected += 1
            return False
        jobs = report.jobs
        keep = self.keep_steps
        if not _compact(jobs, keep):
            jobs = [_compact_job(j, keep) for j in jobs]  # windows longer than kept, or lists (format 1)
        cols = report.telemetry
        if cols and type(cols) is not TelemetryColumns:
            cols = TelemetryColumns.of(cols)  # a list: from an agent of format 1 or 2
        kept = report.model_copy(update={"jobs": jobs, "telemetry": []})
        with self._lock:
            if not self.known(node):
                self.unknown_nodes += 1
                return False
            last = self._seq.get(node)
            if last is not None and key <= last:
                self.rejected += 1
                return False
            self._seq[node] = key
            self._latest[node] = Received(kept, received_at)
            if cols:
                self._add_telemetry(node, cols)  # type: ignore[arg-type]
            return True

    def _add_telemetry(self, node: str, cols: TelemetryColumns) -> None:
        """Queue a report's samples (the lock is held): per device signal its sum and
        count where the peer scorer averages the signal, else the samples as sent.
        Done here, in the ingesting thread, so that the cycle does not do it for the fleet."""
        keys = cols.keys
        n = len(keys)
        counts = np.bincount(cols.k, minlength=n).tolist()
        totals = np.bincount(cols.k, weights=cols.value, minlength=n).tolist()
        # the node's usual keys (every key summed, key i in slot i): added a list at a
        # time, not a key at a time (the loop was a quarter of the cost of keeping a
        # report, 16 keys at 8 GPUs)
        acc = self._sums.get(node)
        if acc is not None:
            if acc.layout is not None and acc.layout.keys == keys:
                acc.total = list(map(operator.add, acc.total, totals))
                acc.count = list(map(operator.add, acc.count, counts))
                self._summed += len(cols.k)
                return
        else:
            lay = self._layouts.get(node)
            # the window's first report of the node: a slot a key, each with samples
            if lay is not None and lay.keys == keys and 0 not in counts:
                self._sums[node] = _NodeSums(lay, totals, counts)
                self._summed += len(cols.k)
                return
            acc = self._sums[node] = _NodeSums()
        self._add_slowly(node, acc, cols, counts, totals)

    def _add_slowly(
        self, node: str, acc: _NodeSums, cols: TelemetryColumns, counts: list[int], totals: list[float]
    ) -> None:
        """_add_telemetry for a report whose keys are not its node's layout: key by key."""
        keys = cols.keys
        if acc.index is None:  # slots set up a list at a time (gkeys: the layout's)
            acc.gkeys = list(acc.gkeys)
            acc.index = {k: i for i, k in enumerate(acc.gkeys)}
        gkeys, index, total, count = acc.gkeys, acc.index, acc.total, acc.count
        assert isinstance(gkeys, list)
        fresh = not gkeys  # the first report of the node this window: it may set the layout
        slots = len(gkeys)
        room = self.keep_samples - len(gkeys)
        added = 0
        raw_keys: list[int] = []
        for i, (signal, _unit, gpu, nic), t, c in zip(range(len(keys)), keys, totals, counts):
            if not c:
                fresh = False  # a key without samples has no slot: no layout
                continue
            if signal not in _AVERAGED:
                raw_keys.append(i)
                continue
            k = (node, signal, gpu, nic)
            at = index.get(k)
            if at is not None:
                fresh = False  # two keys of one device signal (units differ): no layout
                total[at] += t
                count[at] += c
            elif room > 0:
                room -= 1
                at = index[k] = len(gkeys)
                gkeys.append(k)
                total.append(t)
                count.append(c)
            else:  # a flood of made-up devices or signals: bounded, counted
                self.dropped_samples += c
                continue
            added += c
        self._summed += added
        if fresh and not raw_keys and len(gkeys) == len(keys):
            # key i is slot i: the node's next reports, this window and later, are added a list at a time
            acc.layout = self._layouts[node] = _Layout(keys, tuple(gkeys))
        elif len(gkeys) != slots:
            acc.layout = None  # slots past the layout's: a list at a time would leave them out
        if not gkeys:
            del self._sums[node]  # nothing summed (samples kept as sent only)
        if raw_keys:
            q = self._samples.get(node)
            if q is None:
                q = self._samples[node] = deque(maxlen=self.keep_samples)
            before = len(q)
            q.extend(
                TelemetrySample(node, signal, v, unit, ts, gpu, nic)
                for (signal, unit, gpu, nic), ts, v in cols.samples_of(raw_keys)
            )
            over = before + sum(counts[i] for i in raw_keys) - self.keep_samples
            if over > 0:
                self.dropped_samples += over

    def _live(self, now: float) -> list[Received]:
        with self._lock:
            return [r for r in self._latest.values() if now - r.received_at <= self.stale_s]

    def nodes_reporting(self, now: float) -> set[str]:
        return {r.report.node for r in self._live(now)}

    def report_lag(self, now: float) -> dict[str, float]:
        with self._lock:
            return {n: now - r.received_at for n, r in self._latest.items()}

    def ring_errors(self) -> dict[str, dict[str, int]]:
        """node -> ring problems its agent counted, by kind (latest report)."""
        with self._lock:
            return {n: dict(r.report.ring_errors) for n, r in self._latest.items()}

    def job_index(self, now: float) -> dict[int, list[tuple[str, JobReport]]]:
        """job id -> (node, its report of the job) of every live agent: one pass over
        the fleet per cycle, so finding a job's ranks costs its own nodes only."""
        out: dict[int, list[tuple[str, JobReport]]] = {}
        for r in self._live(now):
            for j in r.report.jobs:
                out.setdefault(j.job_id, []).append((r.report.node, j))
        return out

    def job_ids(self, now: float) -> set[int]:
        return set(self.job_index(now))

    def job_ranks(
        self,
        job_id: int,
        now: float,
        allocation: tuple[str, ...] | None = None,
        index: dict[int, list[tuple[str, JobReport]]] | None = None,
    ) -> tuple[list[tuple[str, RankReport]], int]:
        """(node, rank report) for every rank of the job reported by a live agent on a
        node of `allocation` (Slurm's node list of the job; None = any), and how many
        ranks other nodes claimed for the job (dropped, added to foreign_ranks).
        index: this cycle's job_index (built here when None)."""
        if index is None:
            index = self.job_index(now)
        allowed = None if allocation is None else frozenset(allocation)
        out: list[tuple[str, RankReport]] = []
        dropped = 0
        for node, j in index.get(job_id, ()):
            if allowed is not None and node not in allowed:
                dropped += len(j.ranks)
                continue
            out.extend((node, rk) for rk in j.ranks)
        if dropped:
            with self._lock:
                self.foreign_ranks += dropped
        return out, dropped

    def unavailable(self, now: float) -> dict[str, list[UnavailableSignal]]:
        """node -> the signals its agent cannot read now (latest live report)."""
        return {r.report.node: list(r.report.unavailable) for r in self._live(now)}

    def take_telemetry(self) -> TelemetryWindow:
        """Everything kept since the last call, once: the mean of each node's device
        signal that is summed here, and the samples kept as sent. Reports arriving
        meanwhile wait for the next call; samples_taken grows by the number of
        samples the window stands for."""
        with self._lock:
            taken, self._samples = self._samples, {}
            sums, self._sums = self._sums, {}
            summed, self._summed = self._summed, 0
        samples = [t for q in taken.values() for t in q]
        n = len(samples) + summed
        self.samples_taken += n
        return TelemetryWindow(DeviceMeans(sums), samples, n)

    def queued_samples(self) -> int:
        """Samples waiting for scoring (a sum of k samples counts k)."""
        with self._lock:
            return sum(len(q) for q in self._samples.values()) + self._summed
