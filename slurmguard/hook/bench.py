"""`slurmguard bench hook`: what instrumentation costs a job.

1. NCCL hook, per call: ncclAllReduce into the fake libnccl, millions of
   calls, without the hook, with it recording, with it loaded but not
   recording, and with a minimal reference shim (two clock_gettime and a
   32-byte record), all in the same run, interleaved, medians of rounds.
   Both the calling thread's CPU time and wall time are reported; the
   target (at most 60 ns added per call) is checked on CPU time, which
   other processes' time slices on a shared machine do not inflate.
2. torch hook, per collective: all_reduce on a 1-rank gloo group with and
   without the hook (microseconds added per call).
3. Step time of a guarded torch DDP job on the local cluster (2 nodes,
   gloo) against the same job unguarded, both running at the same time on
   disjoint node pairs (swapped between repetitions), in the same run;
   overhead = median guarded step / median unguarded step - 1 over all
   timed steps. Target: under 1%. On a shared machine the measured difference is
   noisy, so the report also gives the hook's cost per step derived from
   (2): collectives per step x added time per collective.
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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from slurmguard.errors import SlurmguardError
from slurmguard.runner import CommandRunner, SubprocessRunner

REPO = Path(__file__).resolve().parents[2]
SPANK = REPO / "spank_plugin"
BUILD = SPANK / "build"
SITE = Path(__file__).resolve().parent / "site"

NCCL_TARGET_NS = 60.0
STEP_TARGET_PCT = 1.0


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
class TorchCallCost:
    """microseconds per all_reduce on a 1-rank gloo group."""

    calls: int
    plain_us: float
    hooked_us: float

    @property
    def added_us(self) -> float:
        return self.hooked_us - self.plain_us


@dataclass
class StepCost:
    """Median step times (ms) of the same DDP job, guarded and not."""

    steps: int
    pairs: int
    params: int
    collectives_per_step: float
    guarded_ms: float
    unguarded_ms: float
    guarded_runs_ms: list = field(default_factory=list)
    unguarded_runs_ms: list = field(default_factory=list)
    hook_on_ms: float = 0.0   # in-job A/B: median step with the torch hook on
    hook_off_ms: float = 0.0  # ... and with it removed, alternating blocks
    ab_steps: int = 0

    @property
    def ab_overhead_pct(self) -> float:
        return 100.0 * (self.hook_on_ms / self.hook_off_ms - 1.0) if self.hook_off_ms else 0.0

    @property
    def overhead_pct(self) -> float:
        """Median guarded step over median unguarded step, all timed steps
        of all pairs pooled (both sides ran in the same time windows)."""
        return 100.0 * (self.guarded_ms - self.unguarded_ms) / self.unguarded_ms

    @property
    def pair_overheads_pct(self) -> list:
        return [100.0 * (g / u - 1.0) for g, u in zip(self.guarded_runs_ms, self.unguarded_runs_ms)]


def build(runner: CommandRunner) -> None:
    runner.run(["make", "-C", str(SPANK), "-s", "all", "tools"], timeout=300)


def _clocksource() -> str:
    try:
        return Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text().strip()
    except OSError:
        return "unknown"


def _ns_per_call(runner: CommandRunner, calls: int, rounds: int, env: dict) -> tuple:
    """(wall, cpu) ns per call of one process run: the best of its rounds,
    i.e. the round least disturbed by the rest of the machine."""
    res = runner.run([str(BUILD / "tests" / "bench_hook"), str(calls), str(rounds)],
                     timeout=600, env=env)
    pairs = [(float(w), float(c)) for w, c in re.findall(
        r"^ns_per_call ([0-9.]+) cpu_ns_per_call ([0-9.]+)$", res.stdout, re.MULTILINE)]
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
        "reference": {"LD_PRELOAD": str(BUILD / "tests" / "libref_shim.so"),
                      "SLURMGUARD_RING_DIR": ""},
    }
    samples: dict[str, list[tuple]] = {k: [] for k in configs}
    try:
        for rep in range(repeats):
            # rotate the order so slow drift of the machine hits all alike
            names = list(SETUPS[rep % 4:] + SETUPS[:rep % 4])
            for name in names:
                for f in os.listdir(ring_dir):
                    os.unlink(os.path.join(ring_dir, f))
                samples[name].append(_ns_per_call(runner, calls, rounds, configs[name]))
    finally:
        shutil.rmtree(ring_dir, ignore_errors=True)
    return CallCost(calls_per_round=calls, rounds=rounds, runs=repeats, clocksource=_clocksource(),
                    wall_ns={k: statistics.median(w for w, _ in v) for k, v in samples.items()},
                    cpu_ns={k: statistics.median(c for _, c in v) for k, v in samples.items()})


TORCH_CALLS = textwrap.dedent('''
    import os, sys, tempfile, time, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    t = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(t)
    n = int(sys.argv[1])
    best = None
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t0) / n
        best = dt if best is None else min(best, dt)
    print("us_per_call", best * 1e6)
    dist.destroy_process_group()
''')


def measure_torch_calls(runner: CommandRunner, calls: int) -> TorchCallCost:
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-torch-"))
    try:
        script = tmp / "calls.py"
        script.write_text(TORCH_CALLS)
        rings = tmp / "rings"
        rings.mkdir()
        out = {}
        for name, env in (("plain", {"SLURMGUARD_RING_DIR": ""}),
                          ("hooked", {"SLURMGUARD_RING_DIR": str(rings),
                                      "SLURMGUARD_RING_RECORDS": "65536"}),
                          ("plain2", {"SLURMGUARD_RING_DIR": ""})):
            env["PYTHONPATH"] = str(SITE)
            res = runner.run([sys.executable, str(script), str(calls)], timeout=600, env=env)
            out[name] = float(re.search(r"us_per_call ([0-9.e+-]+)", res.stdout).group(1))
        return TorchCallCost(calls=calls, plain_us=min(out["plain"], out["plain2"]),
                             hooked_us=out["hooked"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


DDP_JOB = textwrap.dedent('''
    import json, os, sys, time, torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = [torch.nn.Linear({width}, {width}) for _ in range({depth})]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn({batch}, {width})

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range({warmup}):
        step()
    # both jobs of a pair time their steps over the same stretch of time:
    # report ready, wait for the bench to say go (then every rank goes)
    if rank == 0:
        open(os.environ["SG_BENCH_READY"], "w").close()
        while not os.path.exists(os.environ["SG_BENCH_GO"]):
            time.sleep(0.01)
    dist.barrier()
    times = []
    for _ in range({steps}):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    # guarded jobs also switch the torch hook off and on in alternating
    # blocks of steps (all ranks at the same steps): neighbouring blocks
    # see the same machine, so this isolates the hook's own cost
    hook = sys.modules.get("_slurmguard_torchhook")
    ab = {{"on": [], "off": []}}
    if hook is not None:
        for block in range({ab_blocks}):
            on = block % 2 == 0
            (hook.patch if on else hook.unpatch)()
            dist.barrier()
            for _ in range({ab_steps}):
                t0 = time.perf_counter()
                step()
                ab["on" if on else "off"].append(time.perf_counter() - t0)
        hook.patch()
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        print("STEPS", json.dumps({{"times": times, "params": nparams, "ab": ab}}), flush=True)
    dist.destroy_process_group()
''')


def measure_step_time(cluster, ring_root: str, steps: int, pairs: int, width: int = 768,
                      depth: int = 4, batch: int = 32, warmup: int = 5, ab_blocks: int = 12,
                      ab_steps: int = 5) -> StepCost:
    """Run the same 2-node DDP job guarded and unguarded at the same time on
    disjoint node pairs of `cluster` (a DevCluster with the plugin
    installed, rings under ring_root), `pairs` times, swapping the node
    pairs each time; on a shared machine both then see the same load.
    Step times are medians over all timed steps; collectives per step are
    counted in the guarded jobs' rings."""
    from slurmguard.hook import ring as ringfmt

    nodes = cluster.node_names
    if len(nodes) < 4:
        raise SlurmguardError(f"the step-time benchmark needs 4 nodes, the cluster has {len(nodes)}")
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-ddp-"))
    try:
        script = tmp / "ddp.py"
        script.write_text(DDP_JOB.format(width=width, depth=depth, batch=batch, warmup=warmup,
                                         steps=steps, ab_blocks=ab_blocks, ab_steps=ab_steps))
        runs: dict[bool, list[list[float]]] = {True: [], False: []}
        params = 0
        per_step: list[float] = []
        ab_on: list[float] = []
        ab_off: list[float] = []
        for p in range(pairs):
            sets = [",".join(nodes[0:2]), ",".join(nodes[2:4])]
            if p % 2:
                sets.reverse()
            jobs = []
            go = tmp / f"pair{p}.go"
            # submission order alternates too: nothing systematic favours a side
            order = ((True, sets[0]), (False, sets[1])) if p % 2 == 0 else \
                ((False, sets[1]), (True, sets[0]))
            for guarded, nodelist in order:
                tag = f"pair{p}-{'g' if guarded else 'u'}"
                out = tmp / f"{tag}.out"
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                batch_script = (
                    "#!/bin/bash\n"
                    f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={port}\n"
                    f"export SG_BENCH_READY={tmp / (tag + '.ready')} SG_BENCH_GO={go}\n"
                    "srun --kill-on-bad-exit=1 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
                    f"exec {sys.executable} {script}'\n")
                args = ["-N2", "-n2", "-w", nodelist, "-o", str(out)]
                if guarded:
                    args.append("--straggler-guard")
                jobs.append((guarded, cluster.sbatch(batch_script, *args), out))
            deadline = time.monotonic() + 600
            while not all((tmp / f"pair{p}-{t}.ready").exists() for t in "gu"):
                if time.monotonic() > deadline or any(
                        cluster.job_state(jid) in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
                        for _, jid, _ in jobs):
                    break
                time.sleep(0.05)
            go.touch()
            for guarded, jid, out in jobs:
                state = cluster.wait_job(jid, timeout=900)
                text = out.read_text() if out.exists() else ""
                m = re.search(r"^STEPS (.*)$", text, re.MULTILINE)
                if state != "COMPLETED" or not m:
                    raise SlurmguardError(f"bench job {jid} ended {state}: {text[-500:]}")
                data = json.loads(m.group(1))
                runs[guarded].append(data["times"])
                ab_on += data["ab"]["on"]
                ab_off += data["ab"]["off"]
                params = data["params"]
                if guarded:
                    with ringfmt.RingReader(os.path.join(ring_root, str(jid),
                                                         "rank-0.step-0.torch.ring")) as r:
                        n = sum(1 for x in r.read().records if x.op_name == "allreduce")
                    per_step.append(n / (warmup + steps))
        med = {g: statistics.median([t for run in runs[g] for t in run]) * 1e3 for g in runs}
        return StepCost(steps=steps, pairs=pairs, params=params,
                        collectives_per_step=statistics.median(per_step),
                        guarded_ms=med[True], unguarded_ms=med[False],
                        guarded_runs_ms=[statistics.median(r) * 1e3 for r in runs[True]],
                        unguarded_runs_ms=[statistics.median(r) * 1e3 for r in runs[False]],
                        hook_on_ms=statistics.median(ab_on) * 1e3 if ab_on else 0.0,
                        hook_off_ms=statistics.median(ab_off) * 1e3 if ab_off else 0.0,
                        ab_steps=len(ab_on) + len(ab_off))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _GuardedCluster:
    """A temporary devcluster with the plugin installed (or an existing one
    named by slurm_conf, whose plugstack.conf is rewritten and restored)."""

    def __init__(self, state_dir: str | None) -> None:
        self.state_dir = state_dir
        self.cluster = None
        self.started = False
        self.ring_root = None
        self.old_plugstack = None

    def __enter__(self) -> _GuardedCluster:
        from slurmguard.devcluster import ClusterSpec, DevCluster

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
            f"torch_hook={SITE} ring_root={self.ring_root}/rings\n")
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


def report(c: CallCost | None, t: TorchCallCost | None, s: StepCost | None) -> str:
    lines = []
    if c is not None:
        ok = "meets" if c.added_ns <= NCCL_TARGET_NS else "MISSES"
        lines += [
            f"NCCL hook, ns per ncclAllReduce into the fake libnccl (median over {c.runs} "
            f"interleaved process runs of the best of {c.rounds} rounds x {c.calls_per_round} "
            f"calls; clocksource {c.clocksource}):",
            "                                   thread CPU time        wall time",
        ]
        labels = {"base": "no hook (baseline)", "hook": "hook recording",
                  "passthrough": "hook loaded, not recording",
                  "reference": "reference shim *"}
        for k in SETUPS:
            cpu_add = "" if k == "base" else f"+{c.added(k):6.1f}"
            wall_add = "" if k == "base" else f"+{c.added(k, wall=True):6.1f}"
            lines.append(f"  {labels[k]:<31} {c.cpu_ns[k]:7.1f} {cpu_add:>8}   "
                         f"{c.wall_ns[k]:7.1f} {wall_add:>8}")
        lines.append(f"  added by the hook: {c.added_ns:.1f} ns per call ({ok} target <= "
                     f"{NCCL_TARGET_NS:.0f} ns); the reference shim adds {c.added('reference'):.1f} ns "
                     f"in the same run")
        lines.append("  * the least a monitor can do: two clock_gettime(CLOCK_MONOTONIC) and a "
                     "32-byte record per call")
    if t is not None:
        lines += [
            f"torch hook, us per all_reduce (gloo, 1 rank, best of 5 x {t.calls} calls):",
            f"  plain {t.plain_us:.2f} us   hooked {t.hooked_us:.2f} us   added {t.added_us:.2f} us",
        ]
    if s is not None:
        ok = "meets" if s.overhead_pct < STEP_TARGET_PCT else "MISSES"
        lines += [
            f"Guarded DDP step time on the local cluster (2 nodes, gloo, {s.params} params, "
            f"{s.steps} steps x {s.pairs} concurrent job pairs):",
            f"  median step: unguarded {s.unguarded_ms:.2f} ms   guarded {s.guarded_ms:.2f} ms   "
            f"overhead {s.overhead_pct:+.2f}% ({ok} target < {STEP_TARGET_PCT:.0f}%)",
            f"  per pair: {', '.join(f'{x:+.1f}%' for x in s.pair_overheads_pct)} "
            f"(jobs of a pair share the machine with each other and everyone else)",
            f"  in-job A/B (guarded jobs, torch hook on/off in alternating blocks, {s.ab_steps} "
            f"steps): on {s.hook_on_ms:.2f} ms, off {s.hook_off_ms:.2f} ms, "
            f"overhead {s.ab_overhead_pct:+.2f}%",
            f"  per-job medians: unguarded {', '.join(f'{x:.1f}' for x in s.unguarded_runs_ms)} ms; "
            f"guarded {', '.join(f'{x:.1f}' for x in s.guarded_runs_ms)} ms",
        ]
        if t is not None:
            derived = s.collectives_per_step * max(t.added_us, 0.0) / 1e3
            lines.append(
                f"  hook cost per step from the per-call figure: {s.collectives_per_step:.1f} "
                f"collective(s) x {max(t.added_us, 0):.1f} us = {derived * 1e3:.1f} us "
                f"= {100 * derived / s.unguarded_ms:.3f}% of a step")
    return "\n".join(lines)


@click.command("hook")
@click.option("--calls", default=2_000_000, show_default=True, help="ncclAllReduce calls per round.")
@click.option("--rounds", default=3, show_default=True, help="Rounds per process run.")
@click.option("--repeats", default=5, show_default=True, help="Interleaved process runs per setup.")
@click.option("--torch-calls", default=2000, show_default=True, help="all_reduce calls per torch round.")
@click.option("--steps", default=40, show_default=True, help="Timed DDP steps per job.")
@click.option("--pairs", default=3, show_default=True,
              help="Concurrent guarded/unguarded job pairs (node pairs swapped each time).")
@click.option("--cluster/--no-cluster", default=True, show_default=True,
              help="Also measure step time on the local cluster (needs root).")
@click.option("--devcluster-dir", default=None,
              help="Use this running devcluster instead of starting a temporary one.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench_hook(calls: int, rounds: int, repeats: int, torch_calls: int, steps: int, pairs: int,
               cluster: bool, devcluster_dir: str | None, as_json: bool) -> None:
    """Per-call cost of the NCCL and torch hooks and guarded step-time overhead."""
    runner = SubprocessRunner()
    build(runner)
    c = measure_nccl_calls(runner, calls, rounds, repeats)
    t = measure_torch_calls(runner, torch_calls)
    s = None
    if cluster:
        if os.geteuid() != 0:
            raise SlurmguardError("the step-time benchmark starts slurmd, which needs root; "
                                  "run as root or pass --no-cluster")
        with _GuardedCluster(devcluster_dir) as g:
            s = measure_step_time(g.cluster, os.path.join(g.ring_root, "rings"), steps, pairs)
    if as_json:
        out = {"nccl": dict(asdict(c), added_cpu_ns={k: c.added(k) for k in SETUPS[1:]},
                            added_wall_ns={k: c.added(k, wall=True) for k in SETUPS[1:]},
                            target_ns=NCCL_TARGET_NS),
               "torch": dict(asdict(t), added_us=t.added_us)}
        if s is not None:
            out["step"] = dict(asdict(s), overhead_pct=s.overhead_pct,
                               ab_overhead_pct=s.ab_overhead_pct,
                               pair_overheads_pct=s.pair_overheads_pct, target_pct=STEP_TARGET_PCT)
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(report(c, t, s))
