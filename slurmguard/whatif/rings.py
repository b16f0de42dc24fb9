"""What-if input from slurmguard's own rings (archived job traces or a live ring dir).

A ring holds one rank's collectives only, so the per-rank op table the what-if
adapter takes (`adapter.trace_from_rank_ops`) is inferred, per rank and
iteration, from the gaps between collectives:

* one-off collectives (an (op, communicator, bytes) seen fewer than
  detection.period.min_repeats times: DDP's start-up parameter broadcast, its
  first-iteration buffer broadcasts, a final barrier) are set aside; time
  spent inside them is not compute (a fast rank waits there for a slow one);
* iterations of the remaining collectives: one per op when one (op,
  communicator, bytes) repeats; otherwise Greyhound's ACF period over (op,
  communicator, bytes) symbols, then the agent's own logic
  (`detect.period.iteration_anchors`, which codes ops by type and communicator
  only). Iteration k spans the collectives from its anchor (the first one after
  the longest typical gap) up to the next anchor; the first collective has no
  compute before it, so its iteration is left out;
* ``dp-collectives``: the iteration's exposed communication, one op, mapped to
  ``grads-reduce-scatter`` (the paper's grads-sync, a collective over all DP
  ranks): the time from its first collective call to the end of the last one
  to finish in which the rank can only have been waiting. A rank blocked in a
  collective cannot make its next call before that collective ends, so in the
  gap between two calls it waited at most from the earlier call until the last
  completion before the later one; with none in between (a DDP rank issuing
  bucket after bucket during its backward pass while earlier buckets are still
  in flight) the gap is compute. After the iteration's last call, all is
  waiting. One op, because the simulator runs a stage's DP ops back to back
  and idealises per op type: differently sized buckets would share one median;
* ``compute``: the rest of the iteration: from the end of the previous
  iteration's last collective to this one's first call (less the time inside
  one-off collectives in between), and the gaps between its calls that were
  not waiting. In a data-parallel job that is the optimizer step, forward and
  backward, also where the backward overlaps gradient buckets (a rank slowed
  there is seen as slow, not as communicating); mapped to the simulator's
  ``forward-compute``, one op placed before the communication. One op, not a
  made-up forward/backward split: any ratio would only invent S_t for the two
  types and a perfect forward/backward correlation (paper 004, 5.3). The
  bound takes the gap before a completion as waiting, so backward compute after
  the last bucket's call counts as communication (it is short: that bucket is
  called when the backward pass ends).

Steps are matched across ranks by time: iteration j of rank r is step k when
its collectives end nearest to those of the reference rank's iteration k and
the reverse holds too (a synchronous collective ends at the same instant on
every rank). Iterations without a partner on every rank, or with a different
number of collectives, are dropped. Each rank's times are first moved to
wall-clock (the ring's clock_offset_ns), then, per node, by the median
difference of those matched ends to the reference rank (rank 0's node stays
put), which removes the nodes' clock error; it must be well under half an
iteration for the matching to hold (NTP or PTP gives milliseconds).

The default metadata is pure data parallelism: dp = world size, pp = 1.
A `--meta` file may say tp/dsp > 1 (pp must stay 1); then only the ranks with
tp_rank = cp_rank = 0 are analysed, and only their DP communicators (ids that
all of them use and no other rank does).

Layouts read: <trace_store>/<job>/<node>[.restart-<n>]/*.ring (the epilog's
archive; the latest restart is analysed) or a directory of rings
(<ring_root>/<job>/*.ring while the job runs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from slurmguard.config import PeriodPolicy
from slurmguard.detect.period import find_period, iteration_anchors
from slurmguard.detect.records import RankOps
from slurmguard.detect.waiting import completions, gap_waits
from slurmguard.errors import InputError
from slurmguard.hook.ring import (
    NOT_COLLECTIVE,
    RingError,
    RingHeader,
    RingReader,
    step_name,
)
from slurmguard.whatif import optypes as ot
from slurmguard.whatif.trace import JobMeta

COMPUTE_OP = "compute"
DP_OP = "dp-collectives"
#: how the inferred ops map to the simulator's op types (see module docstring)
RING_OP_MAP = {COMPUTE_OP: ot.FORWARD_COMPUTE, DP_OP: ot.GRADS_REDUCE_SCATTER}

_RESTART = re.compile(r"\.restart-(\d+)(?:\.\d+)?$")


@dataclass(frozen=True)
class RingFile:
    path: Path
    header: RingHeader
    restart: int
    """SLURM_JOB_RESTART_COUNT of the run that wrote it (archive layout), else 0."""


@dataclass(frozen=True)
class RankIterations:
    """One rank's iterations, wall-clock ns (before skew correction)."""

    rank: int
    compute_start: np.ndarray
    comm_start: np.ndarray
    comm_end: np.ndarray
    n_ops: np.ndarray


@dataclass
class RingJob:
    """A job's rings turned into the adapter's per-rank op table."""

    path: Path
    job_id: int
    step_id: int
    restart: int
    world_size: int
    meta: JobMeta
    table: pd.DataFrame
    """Columns rank, step, op, start_ns, end_ns (op: compute | dp-collectives)."""
    nodes: dict[int, str]
    """global rank -> node name (from the ring headers)."""
    iterations: dict[int, int]
    """rank -> iterations found on it."""
    steps: int
    """Steps matched on every analysed rank."""
    clock_skew_ns: dict[int, int]
    """rank -> correction applied (ns): its node's median collective-end difference to
    the reference rank (0 on the reference rank's node)."""
    lost_records: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "rings": str(self.path),
            "job_id": self.job_id,
            "job_step": step_name(self.step_id),
            "restart": self.restart,
            "world_size": self.world_size,
            "nodes": {str(r): n for r, n in sorted(self.nodes.items())},
            "iterations_per_rank": {str(r): n for r, n in sorted(self.iterations.items())},
            "steps_matched": self.steps,
            "clock_skew_ns": {str(r): v for r, v in sorted(self.clock_skew_ns.items())},
            "lost_records": self.lost_records,
            "op_map": dict(RING_OP_MAP),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------- finding rings
def _restart_of(node_dir: Path) -> int:
    try:
        data = json.loads((node_dir / "manifest.json").read_text(encoding="utf-8"))
        return int(data["restart_count"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _RESTART.search(node_dir.name)
        return int(m.group(1)) if m else 0


def find_rings(path: str | Path) -> list[RingFile]:
    """Ring files of DIR (a ring dir) or DIR/*/ (an archived job); InputError when none."""
    root = Path(path)
    if not root.exists():
        raise InputError(f"{root}: no such directory")
    if not root.is_dir():
        raise InputError(f"{root}: not a directory (give <trace_store>/<job> or a ring dir)")
    try:
        candidates = [(p, 0) for p in sorted(root.glob("*.ring"))]
        for sub in sorted(root.iterdir()):
            # the epilog's .staging-* dirs are archives still being written
            if sub.is_dir() and not sub.name.startswith("."):
                restart = _restart_of(sub)
                candidates += [(p, restart) for p in sorted(sub.glob("*.ring"))]
    except OSError as exc:
        raise InputError(f"{root}: cannot list: {exc.strerror or exc}") from None
    if not candidates:
        empty = not any(root.iterdir())
        raise InputError(
            f"{root}: {'empty directory' if empty else 'no ring files'}"
            " (expected <trace_store>/<job>/<node>/rank-*.ring or a dir of rank-*.ring)"
        )
    out = []
    for p, restart in candidates:
        try:
            with RingReader(p) as r:
                out.append(RingFile(p, r.header, restart))
        except RingError as exc:
            raise InputError(str(exc)) from None
    return out


def _read_rank(files: list[RingFile]) -> tuple[RankOps, int]:
    """All collectives of one rank (its rings merged), wall-clock ns, and records lost."""
    rows: list[tuple[int, int, int, int, int]] = []
    lost = 0
    for f in files:
        try:
            with RingReader(f.path) as r:
                batch = r.read()
        except (RingError, OSError, ValueError) as exc:
            raise InputError(f"{f.path}: cannot read: {exc}") from None
        lost += batch.lost + batch.corrupt + batch.abandoned
        off = f.header.clock_offset_ns
        for rec in batch.records:
            if rec.op in NOT_COLLECTIVE:
                continue
            # communicator ids are unsigned 64-bit: fold to int64 (only equality matters)
            cid = rec.comm_id - (1 << 64) if rec.comm_id >= 1 << 63 else rec.comm_id
            # when the work ran: on the GPU where the ring has it (the agent's rule)
            rows.append((rec.op, cid, rec.bytes, rec.begin_ns + off, rec.finish_ns + off))
    rank = files[0].header.global_rank
    if not rows:
        return RankOps(rank, *(np.zeros(0, np.int64) for _ in range(5))), lost
    a = np.array(rows, dtype=np.int64)
    a = a[np.argsort(a[:, 3], kind="stable")]
    return RankOps(rank, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]), lost


def _select(files: list[RingFile], root: Path, job_step: str | None) -> tuple[list[RingFile], list[str]]:
    """One job, its latest run, one job step."""
    notes: list[str] = []
    jobs = sorted({f.header.job_id for f in files})
    if len(jobs) > 1:
        raise InputError(
            f"{root}: rings of several jobs ({', '.join(map(str, jobs[:6]))}); give one job's directory"
        )
    restarts = sorted({f.restart for f in files})
    if len(restarts) > 1:
        notes.append(f"restarts {', '.join(map(str, restarts))} archived; analysed restart {restarts[-1]}")
        files = [f for f in files if f.restart == restarts[-1]]
    steps = sorted({f.header.step_id for f in files})
    if job_step is not None:
        files = [f for f in files if f.header.step == job_step]
        if not files:
            raise InputError(
                f"{root}: no rings of job step {job_step} (steps: {', '.join(step_name(s) for s in steps)})"
            )
    elif len(steps) > 1:
        raise InputError(
            f"{root}: rings of job steps {', '.join(step_name(s) for s in steps)}; choose one with --job-step"
        )
    return files, notes


# ---------------------------------------------------------------- iterations
def _symbols(ops: RankOps) -> np.ndarray:
    """Integer code per op of (op type, communicator, bytes)."""
    _, code = np.unique(np.stack([ops.op, ops.comm, ops.nbytes], axis=1), axis=0, return_inverse=True)
    return code.ravel()


def _take(ops: RankOps, idx: np.ndarray) -> RankOps:
    return RankOps(ops.rank, ops.op[idx], ops.comm[idx], ops.nbytes[idx], ops.start_ns[idx], ops.end_ns[idx])


def _sized_period_starts(ops: RankOps, period: PeriodPolicy) -> np.ndarray | None:
    """Iteration starts from the ACF of (op, communicator, bytes) symbols.

    The agent's period detection codes ops by type and communicator only, so a
    DDP iteration of bucket all-reduces and a small loss all-reduce on one
    communicator looks constant there; the message sizes tell them apart. A
    phase of one repeated symbol is one collective per iteration (the ACF
    cannot say so: every lag scores 1 and the smallest allowed one wins).
    """
    code = _symbols(ops)
    got = find_period(code, period)
    if got is None:
        return None
    k, first = got[0], got[1]
    if (code[first:] == code[-1]).all():
        return ops.start_ns[first:].copy()
    # An iteration is k calls from one phase of the period: the one after the
    # longest idle time (from the last completion to the call), by its median
    # over the iterations. Taken per iteration, as step_times does, a rank
    # whose gaps a CPU cap makes uneven lands on other phases in some of them
    # and merges iterations (25 steps as one, in a capped DDP rank's ring).
    # the periodic phase: the longest run of ops that repeat k later
    # (find_period's phase start looks at its last window of ops only)
    same = np.concatenate([[False], code[:-k] == code[k:], [False]])
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    runs = edges.reshape(-1, 2)
    if runs.size == 0:
        return None
    a, b = runs[int(np.argmax(runs[:, 1] - runs[:, 0]))]
    first = int(a)
    n = (int(b - a) + k) // k
    if n < 2:
        return None
    t, end = ops.start_ns, ops.end_ns
    done = np.concatenate([[t[0]], np.maximum.accumulate(end)[:-1]])
    idle = (t - np.minimum(done, t))[first : first + n * k].reshape(n, k)
    phase = int(np.argmax(np.median(idle, axis=0)))
    return t[first + phase + k * np.arange(n - (1 if phase else 0))].copy()


def _busy_ns(start: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per window [lo_i, hi_i), ns spent inside the intervals [start_j, end_j)
    (start ascending)."""
    out = np.zeros(lo.size, dtype=np.int64)
    if start.size == 0:
        return out
    longest = int((end - start).max())
    first = np.searchsorted(start, lo - longest)
    last = np.searchsorted(start, hi)
    for i in np.flatnonzero(last > first):
        s = np.maximum(start[first[i] : last[i]], lo[i])
        e = np.minimum(end[first[i] : last[i]], hi[i])
        out[i] = np.clip(e - s, 0, None).sum()
    return out


def rank_iterations(ops: RankOps, period: PeriodPolicy, source: str) -> RankIterations:
    """Iterations of one rank (see module docstring); InputError when none are found.

    One-off collectives (an (op, communicator, bytes) seen fewer than
    period.min_repeats times: DDP's start-up parameter broadcast, its
    first-iteration buffer broadcasts, a final barrier) are not part of the
    repeating iteration: they are left out of the period, the iterations and
    the communication op, and the time spent inside them is taken off the
    compute of the iteration they fall in (a fast rank waits there for a slow
    one; that wait is not its compute).
    """
    n = len(ops)
    if n == 0:
        raise InputError(f"{source}: rank {ops.rank} recorded no collectives")
    code = _symbols(ops)
    rare = np.bincount(code)[code] < period.min_repeats
    core = _take(ops, np.flatnonzero(~rare))
    m = len(core)
    starts = None
    if m >= 4:
        if len(np.unique(core.nbytes)) > 1:
            starts = _sized_period_starts(core, period)
        if starts is None:
            idx = iteration_anchors(core, period)
            starts = None if idx is None else core.start_ns[idx]
    if starts is None or len(starts) < 2:
        raise InputError(f"{source}: rank {ops.rank}: no repeating iteration found in its {n} collectives")
    # anchors as op indices (the sized-period starts may round a start by a nanosecond)
    t = core.start_ns
    pos = np.clip(np.searchsorted(t, starts), 1, m - 1)
    pos = np.unique(np.where(np.abs(t[pos - 1] - starts) <= np.abs(t[pos] - starts), pos - 1, pos))
    if len(pos) >= 2 and m - pos[-1] == int(np.median(np.diff(pos))):
        pos = np.append(pos, m)  # the last iteration is whole: close it
    seg = pos[pos >= 1]  # the first collective has no compute before it
    if len(seg) < 2:
        raise InputError(f"{source}: rank {ops.rank}: fewer than two whole iterations in its {n} collectives")
    end = core.end_ns
    comm_start = t[seg[:-1]]
    comm_end = np.maximum.reduceat(end[: seg[-1]], seg[:-1])
    # an async op of the previous iteration may end after this one started
    prev_end = np.minimum(np.maximum.accumulate(end)[seg[:-1] - 1], comm_start)
    waited = _busy_ns(ops.start_ns[rare], ops.end_ns[rare], prev_end, comm_start)
    compute_start = np.minimum(prev_end + waited, comm_start)
    inner = _computed_between_calls(t, end, seg)
    return RankIterations(ops.rank, compute_start, comm_start + inner, comm_end, np.diff(seg))


def _computed_between_calls(t: np.ndarray, end: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Per iteration [seg_i, seg_i+1), ns of the gaps between its consecutive
    collective calls (t ascending, end: each call's end) in which the rank
    cannot have been waiting (each gap less its detect.waiting.gap_waits)."""
    j = np.arange(1, seg[-1])
    computing = np.diff(t[: seg[-1]]) - gap_waits(t[: seg[-1]], completions(t, end))
    # gap j lies inside iteration i when calls j - 1 and j both do (seg_i <= j - 1,
    # j < seg_i+1; j < seg[-1] always): gaps before the first iteration have i = -1
    it = np.searchsorted(seg, j, side="right") - 1
    inside = (it >= 0) & (it == np.searchsorted(seg, j - 1, side="right") - 1)
    per = np.zeros(len(seg) - 1, dtype=np.int64)
    np.add.at(per, it[inside], computing[inside])
    return per


def match_steps(its: dict[int, RankIterations], ref: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Step k = the reference rank's iteration k where every rank has a mutual nearest
    iteration (by collective end) with as many collectives, that number being the
    reference's usual one. Returns (ref iteration index per kept step, rank -> its
    iteration index per kept step).

    An iteration with another number of collectives is not one step: where the
    boundaries of a throttled stretch were missed on every rank alike, two or more
    steps read as one (twice the collectives), and kept as a step they would add
    their whole length to the mean step time the what-if reports as the actual one."""
    r0 = its[ref]
    counts, freq = np.unique(r0.n_ops, return_counts=True)
    keep = r0.n_ops == counts[np.argmax(freq)]
    picks: dict[int, np.ndarray] = {}
    for rank, ri in its.items():
        if rank == ref:
            picks[rank] = np.arange(len(r0.comm_end))
            continue
        j = _nearest(ri.comm_end, r0.comm_end)
        back = _nearest(r0.comm_end, ri.comm_end[j])
        keep &= (back == np.arange(len(r0.comm_end))) & (ri.n_ops[j] == r0.n_ops)
        picks[rank] = j
    idx = np.flatnonzero(keep)
    return idx, {r: p[idx] for r, p in picks.items()}


def _nearest(sorted_values: np.ndarray, x: np.ndarray) -> np.ndarray:
    i = np.clip(np.searchsorted(sorted_values, x), 1, max(len(sorted_values) - 1, 1))
    if len(sorted_values) == 1:
        return np.zeros(len(x), dtype=np.int64)
    left = np.abs(x - sorted_values[i - 1]) <= np.abs(sorted_values[i] - x)
    return np.where(left, i - 1, i)


# ---------------------------------------------------------------- the job
def _dp_comms(ops: dict[int, RankOps], reps: list[int]) -> set[int]:
    on_reps = set.intersection(*(set(np.unique(ops[r].comm).tolist()) for r in reps))
    others = set().union(*(set(np.unique(o.comm).tolist()) for r, o in ops.items() if r not in reps))
    return on_reps - others


def load_ring_job(
    path: str | Path,
    meta: JobMeta | None = None,
    *,
    period: PeriodPolicy | None = None,
    job_step: str | None = None,
    meta_source: str = "--meta",
) -> RingJob:
    """Read a job's rings and infer the per-rank op table (module docstring).

    `meta`: parallelism; None = dp = world size, pp = 1. `job_step`: Slurm step
    name (0, 1, batch, ...) when the rings hold several. Every problem is an
    InputError naming the directory or ring file.
    """
    root = Path(path)
    period = period or PeriodPolicy()
    files, notes = _select(find_rings(root), root, job_step)
    h0 = files[0].header
    sizes = sorted({f.header.world_size for f in files})
    if len(sizes) > 1:
        raise InputError(f"{root}: rings disagree on the world size ({', '.join(map(str, sizes))})")
    world = sizes[0]
    if world < 1:
        raise InputError(f"{files[0].path}: ring header has world_size {world}")
    by_rank: dict[int, list[RingFile]] = {}
    for f in files:
        by_rank.setdefault(f.header.global_rank, []).append(f)
    outside = sorted(r for r in by_rank if not 0 <= r < world)
    if outside:
        raise InputError(f"{by_rank[outside[0]][0].path}: rank {outside[0]} is outside world size {world}")
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise InputError(
            f"{root}: job {h0.job_id} step {h0.step}: no ring of rank(s) {shown} "
            f"(world size {world}, {len(by_rank)} ring(s) found)"
        )
    if meta is None:
        meta = JobMeta(dp_size=world, pp_size=1, name=f"job {h0.job_id}")
    else:
        if meta.pp_size != 1:
            raise InputError(
                f"{meta_source}: pp_size={meta.pp_size}: rings give compute and DP "
                "communication only; pipeline-parallel jobs need per-op traces"
            )
        if meta.world_size != world:
            raise InputError(
                f"{meta_source}: world_size={meta.world_size} but the rings in {root} are of {world} ranks"
            )
        if not meta.name:
            meta = JobMeta(**{**meta.__dict__, "name": f"job {h0.job_id}"})
    inner = meta.tp_size * meta.dsp_size
    reps = [r for r in range(world) if r % inner == 0]
    ops: dict[int, RankOps] = {}
    lost = 0
    for r in range(world):
        ops[r], n_lost = _read_rank(by_rank[r])
        lost += n_lost
    if inner > 1:
        comms = _dp_comms(ops, reps)
        if not comms:
            raise InputError(
                f"{root}: no communicator is used by exactly the ranks with tp_rank = cp_rank = 0 "
                f"({meta_source}: tp_size={meta.tp_size}, dsp_size={meta.dsp_size})"
            )
        for r in reps:
            o = ops[r]
            m = np.isin(o.comm, list(comms))
            ops[r] = RankOps(r, o.op[m], o.comm[m], o.nbytes[m], o.start_ns[m], o.end_ns[m])
    if lost:
        notes.append(f"{lost} ring record(s) were lost or corrupt")
    its = {r: rank_iterations(ops[r], period, str(by_rank[r][0].path)) for r in reps}
    ref = reps[0]
    idx, picks = match_steps(its, ref)
    if len(idx) < 2:
        raise InputError(
            f"{root}: only {len(idx)} iteration(s) line up across all {len(reps)} ranks "
            "(ranks ran different collectives, or their clocks are far apart)"
        )
    dropped = len(its[ref].comm_end) - len(idx)
    if dropped:
        notes.append(f"{dropped} iteration(s) of rank {ref} without a partner on every rank dropped")
    # clock error is a node's: one correction per node, none on the reference's
    node_of = {r: by_rank[r][0].header.node_name for r in reps}
    diff = {r: np.median(its[r].comm_end[picks[r]] - its[ref].comm_end[idx]) for r in reps}
    node_skew = {
        nd: 0 if nd == node_of[ref] else int(np.median([diff[r] for r in reps if node_of[r] == nd]))
        for nd in set(node_of.values())
    }
    skew = {r: node_skew[node_of[r]] for r in reps}
    frames = []
    for r in reps:
        ri, j = its[r], picks[r]
        d = skew[r]
        n = len(j)
        frames.append(
            pd.DataFrame(
                {
                    "rank": np.full(2 * n, r, dtype=np.int64),
                    "step": np.tile(np.arange(n, dtype=np.int64), 2),
                    "op": np.repeat([COMPUTE_OP, DP_OP], n),
                    "start_ns": np.concatenate([ri.compute_start[j], ri.comm_start[j]]) - d,
                    "end_ns": np.concatenate([ri.comm_start[j], ri.comm_end[j]]) - d,
                }
            )
        )
    table = pd.concat(frames, ignore_index=True)
    return RingJob(
        path=root,
        job_id=h0.job_id,
        step_id=files[0].header.step_id,
        restart=files[0].restart,
        world_size=world,
        meta=meta,
        table=table,
        nodes={r: fs[0].header.node_name for r, fs in sorted(by_rank.items())},
        iterations={r: len(its[r].comm_end) for r in reps},
        steps=len(idx),
        clock_skew_ns=skew,
        lost_records=lost,
        notes=notes,
    )
