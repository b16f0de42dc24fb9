"""`slurmguard bench hook`: what instrumentation costs a job.

1. NCCL hook, per call: ncclAllReduce into the fake libnccl, millions of
   calls, without the hook, with it recording, with it loaded but not
   recording, and with a minimal reference shim (two clock_gettime and a
   32-byte record), all in the same run, interleaved, medians of rounds.
   Both the calling thread's CPU time and wall time are reported; the
   target (at most 60 ns added per call) is checked on CPU time, which
   other processes' time slices on a shared machine do not inflate.
1b. NCCL hook with CUDA-event GPU timing, per call: the same calls on a
   CUDA stream of the fake CUDA runtime (kernels take no time), in bursts
   of --gpu-burst calls like a step's collectives, the stream synchronised
   and 2 ms asleep between bursts (untimed) so the completion thread keeps
   up as on a GPU; no hook, the hook with host timing only
   (SLURMGUARD_CUDA_EVENTS=0) and the hook with events, interleaved in
   the same run. Added by events = events - host only. Targets: under 2 us
   per call, and under 1% of a 50 ms step that issues 100 collectives.
   The fake runtime's own cudaEventRecord (a queue append and a thread
   wake-up) is part of the figure, as the real one's would be. Reference:
   no hook, the program itself records two events around each call (the
   least event timing can add).
   --real-cuda NCCL_LIB CUDART: on a GPU machine, the same measurement
   against the real libnccl.so.2 (in NCCL_LIB) and CUDA runtime (CUDART):
   a 1-rank communicator, each call an out-of-place all-reduce of one
   float on device memory (NCCL's one-rank path enqueues a real copy);
   this part alone runs (spank_plugin/gpu/run_real.sh passes torch's).
2. torch hook, per collective: a 2-rank gloo job on 127.0.0.1, started
   with a guarded job's environment, does all_reduce of a small tensor in
   blocks with the hook switched on and off between blocks (on, off, off,
   on, ...), so both sides see the same machine. Added per call = median
   over neighbouring on/off block pairs of the difference, on the calling
   thread's CPU time (the headline: the hook's own work on the caller's
   path), the process's CPU time (adds the completion callbacks, which
   describe and write the records) and wall time.
3. Step time of a guarded job against the same job unguarded on the local
   cluster: slurmguard_dev.devcluster.train (DDP over 2 nodes, gloo) with its
   accelerator compute modelled as a sleep (--compute-ms), so its step
   time does not swing with how busy the machine's cores are. A guarded
   and an unguarded job run at the same time on disjoint node pairs
   (swapped, and submitted in the other order, from one pair to the next);
   only steps both jobs of a pair ran in the same stretch of time count.
   Overhead = median guarded step / median unguarded step - 1, all pairs
   pooled, with a bootstrap 95% interval over steps. Target: under 1%.
   The report also derives the hook's cost per step from (2): collectives
   per step x added time per collective.
4. Exit race (--exit-runs N): N guarded and N unguarded runs of a short
   2-rank gloo job (slurmguard.hook.exits, DDP, destroy_process_group and
   normal exit through interpreter finalisation); each side's ranks are
   forked from one parent that imported torch once, both sides at the
   same time so both see the same machine. It counts runs that abort at interpreter
   finalisation (gloo's upstream race, pytorch issue 190489), other
   failures, and records missing from or counted lost in the rings, and
   tests (Fisher's exact, one-sided) whether guarded runs abort more often.

Every part reports the lost-record count of the rings it ran (records a
rank completed that its ring misses or counts as lost) and every job that
aborted, beside its timings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurmguard import datafiles
from slurmguard.errors import SlurmguardError
from slurmguard.runner import CommandRunner, SubprocessRunner

if TYPE_CHECKING:
    from slurmguard_dev.devcluster import DevCluster

SPANK = datafiles.checkout_root() / "spank_plugin"
BUILD = SPANK / "build"
SITE = datafiles.torch_hook_site()

NCCL_TARGET_NS = 60.0
STEP_TARGET_PCT = 1.0
GPU_EVENTS_TARGET_NS = 2000.0
GPU_STEP_MS = 50.0
GPU_STEP_COLLECTIVES = 100


@dataclass
class CallCost:
    """ns per ncclAllReduce, medians over rounds: thread CPU time (what the
    calling thread spends, not inflated when a shared machine gives time
    slices to other processes) and wall time."""

    calls_per_round: int
    rounds: int
    runs: int
    clocksource: str
    cpu_ns: dict
    wall_ns: dict

    def added(self, setup: str, wall: bool = False) -> float:
        d = self.wall_ns if wall else self.cpu_ns
        return d[setup] - d["base"]

    @property
    def added_ns(self) -> float:
        return self.added("hook")


@dataclass
class GpuCallCost:
    """ns per ncclAllReduce on a fake CUDA stream, medians over interleaved
    process runs: no hook ("base"), hook with host timing only ("host"),
    hook with CUDA events ("events"); thread CPU time and wall time."""

    calls_per_round: int
    rounds: int
    runs: int
    burst: int
    cpu_ns: dict
    wall_ns: dict
    #: "fake" (tests/fake_cudart.c) or "real" (the GPU's CUDA runtime and NCCL)
    runtime: str = "fake"

    def added(self, setup: str = "events", over: str = "host", wall: bool = False) -> float:
        d = self.wall_ns if wall else self.cpu_ns
        return d[setup] - d[over]

    @property
    def added_ns(self) -> float:
        """What event timing adds to a call over host timing (wall: the
        caller waits for all of it)."""
        return self.added(wall=True)

    @property
    def step_pct(self) -> float:
        """Share of a GPU_STEP_MS step with GPU_STEP_COLLECTIVES collectives."""
        return 100.0 * GPU_STEP_COLLECTIVES * max(self.added_ns, 0.0) / (GPU_STEP_MS * 1e6)


@dataclass
class TorchCallCost:
    """us per all_reduce (16 float32, gloo) with the torch hook on ("hooked")
    and off ("plain"), medians over interleaved blocks of `calls` calls:
    the calling thread's CPU time, the process's CPU time, wall time."""

    ranks: int
    calls: int
    blocks: int
    thread_us: dict
    process_us: dict
    wall_us: dict
    records: int = 0  # allreduce records in rank 0's ring afterwards
    lost: int = 0  # rank 0's ring: counted lost plus hooked calls it misses
    # clock -> [median, lower quartile, upper quartile] of hooked minus plain
    # over neighbouring block pairs (the blocks go on, off, off, on, ...);
    # empty: difference of the medians
    paired_us: dict = field(default_factory=dict)

    @property
    def plain_us(self) -> float:
        return self.thread_us["plain"]

    @property
    def hooked_us(self) -> float:
        return self.thread_us["hooked"]

    @property
    def added_us(self) -> float:
        """Added per call, calling thread's CPU time."""
        return self.added("thread")

    def added(self, clock: str) -> float:
        """Added per call on one clock (thread, process or wall): median of
        the neighbouring blocks' differences, which slow drift of the
        machine's load does not bias."""
        if clock in self.paired_us:
            return self.paired_us[clock][0]
        d = {"thread": self.thread_us, "process": self.process_us, "wall": self.wall_us}[clock]
        return d["hooked"] - d["plain"]


@dataclass
class StepCost:
    """Median step times (ms) of the same sleep-modelled DDP job, guarded
    and not, over the steps both jobs of each pair ran at the same time."""

    iters: int
    pairs: int
    compute_ms: float
    collectives_per_step: float
    guarded_ms: float
    unguarded_ms: float
    guarded_runs_ms: list = field(default_factory=list)
    unguarded_runs_ms: list = field(default_factory=list)
    steps_used: int = 0  # per side, all pairs
    ci_pct: tuple = (0.0, 0.0)  # bootstrap 95% interval of overhead_pct
    lost: int = 0  # guarded jobs' rings: records counted lost, all ranks
    #: jobs that aborted in gloo's teardown (pytorch issue 190489) after
    #: logging every step, per side ("guarded", "unguarded")
    aborted: dict = field(default_factory=lambda: {"guarded": 0, "unguarded": 0})

    @property
    def overhead_pct(self) -> float:
        """Median guarded step over median unguarded step, all counted
        steps of all pairs pooled (both sides ran in the same windows)."""
        return 100.0 * (self.guarded_ms - self.unguarded_ms) / self.unguarded_ms

    @property
    def pair_overheads_pct(self) -> list:
        return [100.0 * (g / u - 1.0) for g, u in zip(self.guarded_runs_ms, self.unguarded_runs_ms)]


@dataclass
class ExitRace:
    """Outcomes of `runs` guarded and `runs` unguarded short 2-rank jobs
    (one ending): aborts at finalisation, other failures, lost records,
    and the one-sided Fisher p-value that guarded runs abort more often."""

    runs: int
    shape: str
    ending: str
    aborts: dict  # "guarded"/"unguarded" -> runs with a rank aborted by the race
    failures: dict  # runs that ended otherwise than the ending says (race aside)
    lost: int  # guarded: completed collectives missing from or counted lost in rings
    p_value: float = 1.0
    examples: list = field(default_factory=list)  # first few failure descriptions


def measure_exit_race(
    runs: int, shape: str = "ddp", ending: str = "destroy", timeout: float = 7200
) -> ExitRace:
    """Run the exit scenario `runs` times guarded and `runs` times not; each
    side's runs are forked from one warm parent, both sides at once."""
    from slurmguard.hook import exits

    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-exit-"))
    try:
        results = exits.forked_runs(tmp, shape, ending, runs, SITE, timeout=timeout)
        aborts: dict[str, int] = {}
        failures: dict[str, int] = {}
        lost = 0
        examples: list[str] = []
        for side, outcomes in results.items():
            aborts[side] = sum(o.aborted for o in outcomes)
            failures[side] = 0
            for i, o in enumerate(outcomes):
                if o.guarded:
                    for rank in range(2):
                        want = exits.expected_counts(shape, ending, rank)
                        got = o.counts.get(rank, {})
                        lost += sum(max(0, n - got.get(op, 0)) for op, n in want.items())
                        lost += o.lost.get(rank, 0)
                problems = o.problems()
                if problems:
                    failures[side] += 1
                    if len(examples) < 3:
                        examples.append(f"{side} run {i}: {problems[0][:300]}")
        n = {side: len(outcomes) for side, outcomes in results.items()}
        if n["guarded"] != runs or n["unguarded"] != runs:
            raise SlurmguardError(f"exit-race runs ended early: {n}")
        return ExitRace(
            runs=runs,
            shape=shape,
            ending=ending,
            aborts=aborts,
            failures=failures,
            lost=lost,
            examples=examples,
            p_value=exits.fisher_greater(aborts["guarded"], runs, aborts["unguarded"], runs),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build(runner: CommandRunner) -> None:
    datafiles.checkout_path("spank_plugin", "Makefile", what="bench hook")
    runner.run(["make", "-C", str(SPANK), "-s", "all", "tools"], timeout=300)


def _clocksource() -> str:
    try:
        return Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text().strip()
    except OSError:
        return "unknown"


def _ns_per_call(
    runner: CommandRunner, calls: int, rounds: int, env: dict, program: str = "bench_hook", extra: tuple = ()
) -> tuple:
    """(wall, cpu) ns per call of one process run: the best of its rounds,
    i.e. the round least disturbed by the rest of the machine."""
    res = runner.run([str(BUILD / "tests" / program), str(calls), str(rounds), *extra], timeout=600, env=env)
    pairs = [
        (float(w), float(c))
        for w, c in re.findall(r"^ns_per_call ([0-9.]+) cpu_ns_per_call ([0-9.]+)$", res.stdout, re.MULTILINE)
    ]
    if not pairs:
        raise SlurmguardError(f"bench_hook printed no timings: {res.stdout[-300:]} {res.stderr[-300:]}")
    return min(w for w, _ in pairs), min(c for _, c in pairs)


SETUPS = ("base", "hook", "passthrough", "reference")


def measure_nccl_calls(runner: CommandRunner, calls: int, rounds: int, repeats: int) -> CallCost:
    ring_dir = tempfile.mkdtemp(prefix="sg-bench-rings-")
    hook = str(BUILD / "libslurmguard_nccl.so")
    configs = {
        "base": {"LD_PRELOAD": "", "SLURMGUARD_RING_DIR": ""},
        "hook": {"LD_PRELOAD": hook, "SLURMGUARD_RING_DIR": ring_dir},
        "passthrough": {"LD_PRELOAD": hook, "SLURMGUARD_RING_DIR": ""},
        "reference": {"LD_PRELOAD": str(BUILD / "tests" / "libref_shim.so"), "SLURMGUARD_RING_DIR": ""},
    }
    wall, cpu = _rotated_medians(
        SETUPS, configs, ring_dir, repeats, lambda env: _ns_per_call(runner, calls, rounds, env)
    )
    return CallCost(
        calls_per_round=calls,
        rounds=rounds,
        runs=repeats,
        clocksource=_clocksource(),
        wall_ns=wall,
        cpu_ns=cpu,
    )


def _rotated_medians(
    setups: tuple[str, ...], configs: dict[str, dict[str, str]], ring_dir: str, repeats: int, measure
) -> tuple[dict[str, float], dict[str, float]]:
    """Median (wall ns, CPU ns) per call of each setup over `repeats` runs of
    measure(env), the setups' order rotated each run so slow drift of the
    machine hits all alike, the ring directory emptied before each run and
    removed at the end."""
    samples: dict[str, list[tuple]] = {k: [] for k in configs}
    try:
        for rep in range(repeats):
            for name in setups[rep % len(setups) :] + setups[: rep % len(setups)]:
                for f in os.listdir(ring_dir):
                    os.unlink(os.path.join(ring_dir, f))
                samples[name].append(measure(configs[name]))
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)
    return (
        {k: statistics.median(w for w, _ in v) for k, v in samples.items()},
        {k: statistics.median(c for _, c in v) for k, v in samples.items()},
    )


GPU_SETUPS = ("base", "host", "events", "reference")


def measure_gpu_calls(
    runner: CommandRunner, calls: int, rounds: int, repeats: int, burst: int, real: bool = False
) -> GpuCallCost:
    """real: bench_hook_real (`make gpu`, the real NCCL and CUDA runtime)
    instead of bench_hook_cuda (the fakes)."""
    program = "bench_hook_real" if real else "bench_hook_cuda"
    ring_dir = tempfile.mkdtemp(prefix="sg-bench-rings-")
    hook = str(BUILD / "libslurmguard_nccl.so")
    configs = {
        "base": {"LD_PRELOAD": "", "SLURMGUARD_RING_DIR": ""},
        "host": {"LD_PRELOAD": hook, "SLURMGUARD_RING_DIR": ring_dir, "SLURMGUARD_CUDA_EVENTS": "0"},
        "events": {"LD_PRELOAD": hook, "SLURMGUARD_RING_DIR": ring_dir, "SLURMGUARD_CUDA_EVENTS": ""},
        # no hook; the program records two events around each call itself
        "reference": {"LD_PRELOAD": "", "SLURMGUARD_RING_DIR": "", "BENCH_REF_EVENTS": "1"},
    }
    wall, cpu = _rotated_medians(
        GPU_SETUPS,
        configs,
        ring_dir,
        repeats,
        lambda env: _ns_per_call(runner, calls, rounds, env, program, (str(burst),)),
    )
    return GpuCallCost(
        calls_per_round=calls,
        rounds=rounds,
        runs=repeats,
        burst=burst,
        runtime="real" if real else "fake",
        wall_ns=wall,
        cpu_ns=cpu,
    )


TORCH_CALLS = textwrap.dedent("""
    # a guarded job's ranks (the hook loaded by sitecustomize.py); rank 0
    # starts rank 1 as a copy of itself with the same environment
    import json, os, subprocess, sys, time, torch, torch.distributed as dist
    torch.set_num_threads(1)
    n, blocks, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ.get("RANK", "0"))
    peers = []
    if rank == 0 and world > 1:
        for r in range(1, world):
            peers.append(subprocess.Popen([sys.executable] + sys.argv, env=dict(os.environ, RANK=str(r))))
    from slurmguard.rendezvous import init_process_group
    init_process_group("gloo", rank, world)
    hook = sys.modules.get("_slurmguard_torchhook")
    if hook is None or not hook.patch():
        sys.exit("the torch hook is not loaded")
    t = torch.ones(16)
    for _ in range(200):
        dist.all_reduce(t)
    out = {"hooked": [], "plain": []}
    for b in range(blocks):
        on = b % 4 in (0, 3)  # on, off, off, on: drift hits both alike
        (hook.patch if on else hook.unpatch)()
        dist.barrier()
        for _ in range(10):
            dist.all_reduce(t)
        w0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(n):
            dist.all_reduce(t)
        c1, p1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
        out["hooked" if on else "plain"].append(
            [(c1 - c0) / n * 1e6, (p1 - p0) / n * 1e6, (w1 - w0) / n * 1e6])
    hook.patch()
    hook._state["recorder"].settle()
    if rank == 0:
        print("CALLS", json.dumps(out), flush=True)
    # barrier, destroy (the hook writes its last records), then leave without
    # interpreter finalisation: gloo's upstream exit race must not fail the run
    from slurmguard.teardown import finish
    if rank != 0:
        finish(0)
    dist.barrier()
    dist.destroy_process_group()
    failed = [p.args for p in peers if p.wait() != 0]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
    finish(1 if failed else 0)
""")


def measure_torch_calls(runner: CommandRunner, calls: int, blocks: int = 24, ranks: int = 2) -> TorchCallCost:
    """Run TORCH_CALLS as a guarded job would run (the plugin's environment:
    PYTHONPATH=site dir, ring dir, job and step id); `blocks` blocks of
    `calls` all_reduce, half of them with the hook removed."""
    from slurmguard.hook import ring as ringfmt

    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-torch-"))
    try:
        script = tmp / "calls.py"
        script.write_text(TORCH_CALLS)
        rings = tmp / "rings"
        rings.mkdir()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {
            "PYTHONPATH": str(SITE),
            "SLURMGUARD_RING_DIR": str(rings),
            "SLURMGUARD_JOB_ID": "1",
            "SLURMGUARD_STEP_ID": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": str(ranks),
        }
        res = runner.run(
            [sys.executable, str(script), str(calls), str(blocks), str(ranks)], timeout=900, env=env
        )
        m = re.search(r"^CALLS (.*)$", res.stdout, re.MULTILINE)
        if not m:
            raise SlurmguardError(f"torch call benchmark printed no timings: {res.stderr[-500:]}")
        data = json.loads(m.group(1))
        with ringfmt.RingReader(str(rings / "rank-0.step-0.torch.ring")) as r:
            records = sum(1 for x in r.read().records if x.op_name == "allreduce")
            counted_lost = r.refresh_header().overwritten
        # hooked: 200 warm-up calls, then per hooked block 10 + calls
        hooked_blocks = sum(1 for b in range(blocks) if b % 4 in (0, 3))
        missing = max(0, 200 + hooked_blocks * (10 + calls) - records)
        clocks = ("thread", "process", "wall")
        med = {
            clock: {side: statistics.median(b[i] for b in data[side]) for side in data}
            for i, clock in enumerate(clocks)
        }
        # the j-th hooked and the j-th plain block are neighbours (2j, 2j+1)
        paired = {}
        for i, clock in enumerate(clocks):
            d = [h[i] - p[i] for h, p in zip(data["hooked"], data["plain"])]
            q = statistics.quantiles(d, n=4, method="inclusive") if len(d) > 1 else [d[0]] * 3
            paired[clock] = [statistics.median(d), q[0], q[2]]
        return TorchCallCost(
            ranks=ranks,
            calls=calls,
            blocks=blocks,
            thread_us=med["thread"],
            process_us=med["process"],
            wall_us=med["wall"],
            records=records,
            lost=counted_lost + missing,
            paired_us=paired,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _window_steps(log: Path, warmup: int) -> list[tuple[float, float]]:
    """(wall-clock end time s, step time ms) of rank 0's logged iterations
    after the first `warmup`."""
    rows = []
    for line in log.read_text().splitlines():
        d = json.loads(line)
        rows.append((float(d["t"]), float(d["step_s"]) * 1e3))
    return rows[warmup:]


def _bootstrap_ci(g: list[float], u: list[float], n: int = 1000, seed: int = 0) -> tuple:
    """95% percentile interval of 100*(median g / median u - 1), steps
    resampled with replacement on both sides."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ga, ua = np.asarray(g), np.asarray(u)
    ratios = [np.median(rng.choice(ga, ga.size)) / np.median(rng.choice(ua, ua.size)) for _ in range(n)]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return (float(100 * (lo - 1)), float(100 * (hi - 1)))


def measure_step_time(
    cluster, ring_root: str, iters: int, pairs: int, compute_ms: float = 80.0, warmup: int = 5
) -> StepCost:
    """Run slurmguard_dev.devcluster.train over 2 nodes guarded and unguarded at
    the same time on disjoint node pairs of `cluster` (a DevCluster with the
    plugin installed, rings under ring_root), `pairs` times, swapping the
    node pairs and the submission order each time. Step times are rank 0's
    logged iterations (after `warmup`) that ended while both jobs of the
    pair were stepping; collectives per step are counted in the guarded
    jobs' rings."""
    from slurmguard.hook import exits
    from slurmguard.hook import ring as ringfmt

    nodes = cluster.node_names
    if len(nodes) < 4:
        raise SlurmguardError(f"the step-time benchmark needs 4 nodes, the cluster has {len(nodes)}")
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-ddp-"))
    try:
        runs: dict[bool, list[list[float]]] = {True: [], False: []}
        per_step: list[float] = []
        lost = 0
        aborted = {"guarded": 0, "unguarded": 0}
        for p in range(pairs):
            sets = [",".join(nodes[0:2]), ",".join(nodes[2:4])]
            if p % 2:
                sets.reverse()
            order = (True, False) if p % 2 == 0 else (False, True)
            jobs = []
            for guarded, nodelist in zip(order, sets):
                tag = f"pair{p}-{'g' if guarded else 'u'}"
                batch_script = (
                    "#!/bin/bash\n"
                    "export MASTER_ADDR=127.0.0.1\n"
                    f"srun --kill-on-bad-exit=1 {sys.executable} -m slurmguard_dev.devcluster.train "
                    f"--iters {iters} --compute-ms {compute_ms} --ckpt {tmp / (tag + '-ckpt')} "
                    f"--ckpt-every {iters + 1} --log {tmp / (tag + '.jsonl')}\n"
                )
                args = ["-N2", "-n2", "-w", nodelist, "-o", str(tmp / f"{tag}.out")]
                if guarded:
                    args.append("--straggler-guard")
                jobs.append((guarded, tag, cluster.sbatch(batch_script, *args)))
            steps = {}
            for guarded, tag, jid in jobs:
                state = cluster.wait_job(jid, timeout=max(900.0, iters * compute_ms / 100))
                log = tmp / f"{tag}.jsonl"
                out = tmp / f"{tag}.out"
                text = out.read_text() if out.exists() else ""
                logged = len(log.read_text().splitlines()) if log.exists() else 0
                if state != "COMPLETED" and exits.ABORT_MESSAGE in text and logged == iters:
                    # done and logged, then the upstream teardown race: counted, its
                    # steps kept
                    aborted["guarded" if guarded else "unguarded"] += 1
                elif state != "COMPLETED" or not logged:
                    raise SlurmguardError(f"bench job {jid} ended {state}: {text[-500:]}")
                steps[guarded] = _window_steps(log, warmup)
                if guarded:
                    for rank in (0, 1):
                        with ringfmt.RingReader(
                            os.path.join(ring_root, str(jid), f"rank-{rank}.step-0.torch.ring")
                        ) as r:
                            n = sum(1 for x in r.read().records if x.op_name == "allreduce")
                            lost += r.refresh_header().overwritten
                        if rank == 0:
                            per_step.append(n / iters)
            # the steps both jobs ran at the same time: each step ends at t
            # and began step_ms earlier
            lo = max(steps[g][0][0] - steps[g][0][1] / 1e3 for g in steps)
            hi = min(steps[g][-1][0] for g in steps)
            for g in steps:
                window = [ms for t, ms in steps[g] if lo <= t - ms / 1e3 and t <= hi]
                if len(window) < 10:
                    raise SlurmguardError(
                        f"the guarded and unguarded jobs of pair {p} overlapped for only "
                        f"{len(window)} steps; was the cluster busy with other jobs?"
                    )
                runs[g].append(window)
        pooled = {g: [t for run in runs[g] for t in run] for g in runs}
        med = {g: statistics.median(pooled[g]) for g in runs}
        return StepCost(
            iters=iters,
            pairs=pairs,
            compute_ms=compute_ms,
            collectives_per_step=statistics.median(per_step),
            guarded_ms=med[True],
            unguarded_ms=med[False],
            guarded_runs_ms=[statistics.median(r) for r in runs[True]],
            unguarded_runs_ms=[statistics.median(r) for r in runs[False]],
            steps_used=min(len(pooled[True]), len(pooled[False])),
            ci_pct=_bootstrap_ci(pooled[True], pooled[False]),
            lost=lost,
            aborted=aborted,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _GuardedCluster:
    """A temporary devcluster with the plugin installed (or an existing one
    named by slurm_conf, whose plugstack.conf is rewritten and restored)."""

    def __init__(self, state_dir: str | None) -> None:
        self.state_dir = state_dir
        self.cluster: DevCluster | None = None
        self.started = False
        self.ring_root: str | None = None
        self.old_plugstack: str | None = None

    def __enter__(self) -> _GuardedCluster:
        from slurmguard_dev.devcluster import ClusterSpec, DevCluster

        if self.state_dir:
            self.cluster = DevCluster.attach(self.state_dir)
        else:
            self.tmp = tempfile.mkdtemp(prefix="sg-bench-cluster-")
            os.chmod(self.tmp, 0o755)
            self.cluster = DevCluster(ClusterSpec(state_dir=Path(self.tmp), nodes=4))
            self.cluster.up()
            self.started = True
        self.ring_root = tempfile.mkdtemp(prefix="sg-bench-", dir="/dev/shm")
        os.chmod(self.ring_root, 0o755)
        path = self.cluster.plugstack_path
        self.old_plugstack = path.read_text() if path.exists() else ""
        self.cluster.set_plugstack(
            f"optional {BUILD / 'slurmguard_spank.so'} nccl_hook={BUILD / 'libslurmguard_nccl.so'} "
            f"torch_hook={SITE} ring_root={self.ring_root}/rings\n"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            if self.started:
                self.cluster.down()
                shutil.rmtree(self.tmp, ignore_errors=True)
            else:
                self.cluster.set_plugstack(self.old_plugstack or "")
        if self.ring_root:
            shutil.rmtree(self.ring_root, ignore_errors=True)


def report(
    c: CallCost | None,
    t: TorchCallCost | None,
    s: StepCost | None,
    g: GpuCallCost | None = None,
    e: ExitRace | None = None,
) -> str:
    lines = []
    if c is not None:
        ok = "meets" if c.added_ns <= NCCL_TARGET_NS else "MISSES"
        lines += [
            f"NCCL hook, ns per ncclAllReduce into the fake libnccl (median over {c.runs} "
            f"interleaved process runs of the best of {c.rounds} rounds x {c.calls_per_round} "
            f"calls; clocksource {c.clocksource}):",
            "                                   thread CPU time        wall time",
        ]
        labels = {
            "base": "no hook (baseline)",
            "hook": "hook recording",
            "passthrough": "hook loaded, not recording",
            "reference": "reference shim *",
        }
        for k in SETUPS:
            cpu_add = "" if k == "base" else f"+{c.added(k):6.1f}"
            wall_add = "" if k == "base" else f"+{c.added(k, wall=True):6.1f}"
            lines.append(
                f"  {labels[k]:<31} {c.cpu_ns[k]:7.1f} {cpu_add:>8}   {c.wall_ns[k]:7.1f} {wall_add:>8}"
            )
        lines.append(
            f"  added by the hook: {c.added_ns:.1f} ns per call ({ok} target <= "
            f"{NCCL_TARGET_NS:.0f} ns); the reference shim adds {c.added('reference'):.1f} ns "
            f"in the same run"
        )
        lines.append(
            "  * the least a monitor can do: two clock_gettime(CLOCK_MONOTONIC) and a 32-byte record per call"
        )
    if g is not None:
        ok = "meets" if g.added_ns < GPU_EVENTS_TARGET_NS and g.step_pct < STEP_TARGET_PCT else "MISSES"
        where = (
            "the REAL CUDA runtime and NCCL (1-rank communicator, out-of-place, device memory"
            if g.runtime == "real"
            else "the FAKE CUDA runtime (no GPU"
        )
        lines += [
            f"NCCL hook with CUDA-event GPU timing, ns per ncclAllReduce on a stream of {where}; "
            f"median over {g.runs} interleaved process runs of the best of "
            f"{g.rounds} rounds x {g.calls_per_round} calls in bursts of {g.burst}):",
            "                                   thread CPU time        wall time",
        ]
        labels = {
            "base": "no hook (baseline)",
            "host": "hook, host timing only",
            "events": "hook, CUDA events",
            "reference": "2 cudaEventRecord, no hook *",
        }
        for k in (k for k in GPU_SETUPS if k in g.wall_ns):
            cpu_add = "" if k == "base" else f"+{g.added(k, 'base'):6.1f}"
            wall_add = "" if k == "base" else f"+{g.added(k, 'base', wall=True):6.1f}"
            lines.append(
                f"  {labels[k]:<31} {g.cpu_ns[k]:7.1f} {cpu_add:>8}   {g.wall_ns[k]:7.1f} {wall_add:>8}"
            )
        lines.append(
            f"  added by event timing over host timing: {g.added_ns:.0f} ns per call wall "
            f"({g.added():.0f} ns thread CPU) = {g.step_pct:.3f}% of a "
            f"{GPU_STEP_MS:g} ms step with {GPU_STEP_COLLECTIVES} collectives ({ok} "
            f"targets < {GPU_EVENTS_TARGET_NS / 1000:g} us per call, < "
            f"{STEP_TARGET_PCT:g}% of the step)"
        )
        if "reference" in g.wall_ns:
            lines.append(
                f"  * the least event timing can add: the program records two events "
                f"around each call itself (+{g.added('reference', 'base', wall=True):.0f} "
                f"ns wall)"
            )
    if t is not None:
        lines += [
            f"torch hook, us per all_reduce (gloo, {t.ranks} rank(s) on 127.0.0.1, 16 float32; "
            f"medians over {t.blocks} interleaved blocks of {t.calls} calls, hook on/off):",
            "                      thread CPU   process CPU     wall",
        ]
        for side, label in (("plain", "hook off"), ("hooked", "hook on")):
            lines.append(
                f"  {label:<18} {t.thread_us[side]:10.1f} {t.process_us[side]:13.1f} {t.wall_us[side]:8.1f}"
            )
        lines.append(
            f"  added per call *   {t.added('thread'):+10.1f} {t.added('process'):+13.1f} "
            f"{t.added('wall'):+8.1f}   ({t.records} allreduce records in rank 0's ring, "
            f"{t.lost} lost)"
        )
        if t.paired_us:
            iqr = "   ".join(
                f"{clock} {t.paired_us[clock][1]:+.1f} .. {t.paired_us[clock][2]:+.1f}"
                for clock in ("thread", "process", "wall")
            )
            lines.append(f"  * median over neighbouring on/off block pairs; quartiles: {iqr}")
        if t.ranks > 1:
            lines.append(
                "  (with fewer free cores than the ranks' threads, gloo's polling and the "
                "scheduler dominate process CPU and wall time; thread CPU is the hook's "
                "own work)"
            )
    if s is not None:
        ok = "meets" if s.overhead_pct < STEP_TARGET_PCT else "MISSES"
        lo, hi = s.ci_pct
        lines += [
            f"Guarded step time on the local cluster (slurmguard_dev.devcluster.train, 2 nodes, gloo, "
            f"compute modelled as {s.compute_ms:g} ms asleep; {s.iters} iterations x {s.pairs} "
            f"concurrent guarded/unguarded job pairs, {s.steps_used} overlapping steps per side):",
            f"  median step: unguarded {s.unguarded_ms:.2f} ms   guarded {s.guarded_ms:.2f} ms   "
            f"overhead {s.overhead_pct:+.2f}% (95% interval {lo:+.2f}% .. {hi:+.2f}%; "
            f"{ok} target < {STEP_TARGET_PCT:.0f}%)",
            f"  per pair: {', '.join(f'{x:+.2f}%' for x in s.pair_overheads_pct)}",
            f"  per-job medians: unguarded {', '.join(f'{x:.2f}' for x in s.unguarded_runs_ms)} ms; "
            f"guarded {', '.join(f'{x:.2f}' for x in s.guarded_runs_ms)} ms",
            f"  jobs: {s.pairs} guarded, {s.pairs} unguarded; aborted in teardown (pytorch "
            f"issue 190489): guarded {s.aborted['guarded']}, unguarded "
            f"{s.aborted['unguarded']}; guarded rings: {s.lost} records lost",
        ]
        if t is not None:
            derived = s.collectives_per_step * max(t.added_us, 0.0) / 1e3
            lines.append(
                f"  hook cost per step from the per-call figure: {s.collectives_per_step:.1f} "
                f"collective(s) x {max(t.added_us, 0):.1f} us = {derived * 1e3:.1f} us "
                f"= {100 * derived / s.unguarded_ms:.3f}% of a step"
            )
    if e is not None:
        ga, ua = e.aborts["guarded"], e.aborts["unguarded"]
        verdict = "no evidence that the hook raises it" if e.p_value >= 0.05 else "the hook RAISES it"
        lines += [
            f"Exit race ({e.runs} guarded and {e.runs} unguarded 2-rank gloo jobs on 127.0.0.1, "
            f"{e.shape}, ending '{e.ending}'; ranks forked from a warm parent per side, sides "
            f"side by side):",
            f"  aborted at finalisation (pytorch issue 190489): guarded {ga}/{e.runs} "
            f"({100 * ga / e.runs:.1f}%), unguarded {ua}/{e.runs} ({100 * ua / e.runs:.1f}%); "
            f"Fisher's exact test, one-sided (guarded > unguarded): p = {e.p_value:.3f}, {verdict}",
            f"  other failures: guarded {e.failures['guarded']}, unguarded "
            f"{e.failures['unguarded']}; guarded rings: {e.lost} records lost",
        ]
        lines += [f"  {x}" for x in e.examples]
    return "\n".join(lines)


def _bench_real_cuda(libs: tuple, calls: int, rounds: int, repeats: int, burst: int, as_json: bool) -> None:
    nccl_lib, cudart = libs
    if not os.path.isfile(os.path.join(nccl_lib, "libnccl.so.2")) or not os.path.isfile(cudart):
        raise SlurmguardError(
            f"--real-cuda: {nccl_lib} must hold libnccl.so.2 and {cudart} be the CUDA runtime library"
        )
    datafiles.checkout_path("spank_plugin", "Makefile", what="bench hook")
    runner = SubprocessRunner()
    runner.run(
        ["make", "-C", str(SPANK), "-s", "gpu", f"NCCL_LIB={nccl_lib}", f"CUDART={cudart}"], timeout=300
    )
    g = measure_gpu_calls(runner, calls, rounds, repeats, burst, real=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "nccl_gpu_events": dict(
                        asdict(g),
                        added_ns=g.added_ns,
                        added_cpu_ns=g.added(),
                        step_pct=g.step_pct,
                        target_ns=GPU_EVENTS_TARGET_NS,
                        step_ms=GPU_STEP_MS,
                        collectives_per_step=GPU_STEP_COLLECTIVES,
                    )
                },
                indent=2,
            )
        )
    else:
        click.echo(report(None, None, None, g))


@click.command("hook")
@click.option("--calls", default=2_000_000, show_default=True, help="ncclAllReduce calls per round.")
@click.option("--rounds", default=3, show_default=True, help="Rounds per process run.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved process runs per setup.")
@click.option(
    "--gpu-calls",
    default=20_000,
    show_default=True,
    help="ncclAllReduce calls per round of the CUDA-event part (fake CUDA runtime).",
)
@click.option(
    "--gpu-burst",
    default=GPU_STEP_COLLECTIVES,
    show_default=True,
    help="Calls per burst (a step's collectives) of the CUDA-event part.",
)
@click.option(
    "--torch-calls",
    default=400,
    show_default=True,
    help="all_reduce calls per block of the torch per-call part.",
)
@click.option(
    "--torch-blocks",
    default=24,
    show_default=True,
    help="Blocks of the torch per-call part (half with the hook off).",
)
@click.option(
    "--torch-ranks",
    default=2,
    show_default=True,
    type=click.IntRange(1, 8),
    help="gloo ranks of the torch per-call part.",
)
@click.option(
    "--steps", default=300, show_default=True, help="Training iterations per job of the step-time part."
)
@click.option(
    "--compute-ms",
    default=80.0,
    show_default=True,
    help="Modelled accelerator time per iteration (ms, spent asleep).",
)
@click.option(
    "--pairs",
    default=4,
    show_default=True,
    help="Concurrent guarded/unguarded job pairs (node pairs swapped each time).",
)
@click.option(
    "--cluster/--no-cluster",
    default=True,
    show_default=True,
    help="Also measure step time on the local cluster (needs root).",
)
@click.option(
    "--devcluster-dir", default=None, help="Use this running devcluster instead of starting a temporary one."
)
@click.option(
    "--exit-runs",
    default=0,
    show_default=True,
    type=click.IntRange(0, 10000),
    help="Guarded and unguarded runs each of the exit-race part (0: skip).",
)
@click.option(
    "--real-cuda",
    nargs=2,
    default=None,
    metavar="NCCL_LIB CUDART",
    type=click.Path(exists=True, resolve_path=True),
    help="On a GPU: only the CUDA-event part, against the real NCCL (directory "
    "holding libnccl.so.2) and CUDA runtime (library file).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench_hook(
    calls: int,
    rounds: int,
    repeats: int,
    gpu_calls: int,
    gpu_burst: int,
    torch_calls: int,
    torch_blocks: int,
    torch_ranks: int,
    steps: int,
    compute_ms: float,
    pairs: int,
    cluster: bool,
    devcluster_dir: str | None,
    exit_runs: int,
    real_cuda: tuple | None,
    as_json: bool,
) -> None:
    """Per-call cost of the NCCL and torch hooks and guarded step-time overhead."""
    if real_cuda:
        _bench_real_cuda(real_cuda, gpu_calls, rounds, repeats, gpu_burst, as_json)
        return
    if steps < 20 or pairs < 1 or torch_calls < 1 or torch_blocks < 2:
        raise SlurmguardError(
            "--steps must be at least 20, --pairs and --torch-calls at least 1, --torch-blocks at least 2"
        )
    if gpu_calls < 1 or gpu_burst < 1:
        raise SlurmguardError("--gpu-calls and --gpu-burst must be at least 1")
    runner = SubprocessRunner()
    build(runner)
    c = measure_nccl_calls(runner, calls, rounds, repeats)
    g = measure_gpu_calls(runner, gpu_calls, rounds, repeats, gpu_burst)
    t = measure_torch_calls(runner, torch_calls, torch_blocks, torch_ranks)
    s = None
    if cluster:
        if os.geteuid() != 0:
            raise SlurmguardError(
                "the step-time benchmark starts slurmd, which needs root; run as root or pass --no-cluster"
            )
        with _GuardedCluster(devcluster_dir) as gc:
            assert gc.cluster is not None and gc.ring_root is not None  # set by __enter__
            s = measure_step_time(gc.cluster, os.path.join(gc.ring_root, "rings"), steps, pairs, compute_ms)
    e = measure_exit_race(exit_runs) if exit_runs else None
    if as_json:
        out = {
            "nccl": dict(
                asdict(c),
                added_cpu_ns={k: c.added(k) for k in SETUPS[1:]},
                added_wall_ns={k: c.added(k, wall=True) for k in SETUPS[1:]},
                target_ns=NCCL_TARGET_NS,
            ),
            "nccl_gpu_events": dict(
                asdict(g),
                added_ns=g.added_ns,
                added_cpu_ns=g.added(),
                step_pct=g.step_pct,
                target_ns=GPU_EVENTS_TARGET_NS,
                step_ms=GPU_STEP_MS,
                collectives_per_step=GPU_STEP_COLLECTIVES,
            ),
            "torch": dict(
                asdict(t),
                plain_us=t.plain_us,
                hooked_us=t.hooked_us,
                added_us=t.added_us,
                added={k: t.added(k) for k in ("thread", "process", "wall")},
            ),
        }
        if s is not None:
            out["step"] = dict(
                asdict(s),
                overhead_pct=s.overhead_pct,
                pair_overheads_pct=s.pair_overheads_pct,
                target_pct=STEP_TARGET_PCT,
            )
        if e is not None:
            out["exit"] = asdict(e)
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(report(c, t, s, g, e))
