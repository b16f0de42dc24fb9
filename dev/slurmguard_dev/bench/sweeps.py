"""`slurmguard bench sweeps`: time and node-hours to verify and return a drained node.

On the development cluster (a temporary one, or a running one with --state-dir) with
short CPU sweeps: node1 is first swept by a rolling sweep (the class baseline and a
trusted reference); then each measured node is drained the way the controller does it
(audited drain, lifecycle `draining`) and the scheduler is ticked every --tick seconds
until the node is `healthy` again.

Figures, per node and summarised:

* return_s: wall time from the drain to lifecycle healthy (reservation deleted, node back
  in its partition);
* jobs_s: the sweep jobs' own runtimes (1-node + 2-node), the baseline measured in the same
  run: what the return would take if the scheduler added nothing;
* overhead_s = return_s - jobs_s: quarantine, submission, Slurm's queue wait (queue_s,
  submit -> start), judging, and one tick of latency per step (the scheduler advances a
  node by one step per tick);
* sweep node-hours per returned node: sum over its sweep jobs of nodes x runtime;
* ref_held_s: how long the reference was out of service (its pair reservation's life),
  against the 2-node job's runtime.

Before those, with an empty database (a fresh install, issue 15.1): the cold-start case,
one node drained and returned with no seeding step (the scheduler sweeps an idle peer
itself), time from the drain to lifecycle healthy and the reference its verdict used.
After them, the verdict's false-fail rate: `--healthy-sweeps` 1-node sweeps of idle
healthy nodes (the sweep job exactly as the scheduler renders it), each judged as a
suspected node's sweep against the class baseline the runs above left in the database;
target 0 failures in 20 on the development cluster.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from slurmguard.clock import SystemClock
from slurmguard.config import ModelFloor, SweepPolicy, TriagePolicy
from slurmguard.errors import SlurmguardError
from slurmguard.store import NodeState, Store, SweepKind, db
from slurmguard.sweeps import records as rec
from slurmguard.sweeps.quarantine import pair_name


def devcluster_sweep_policy(workdir: Path, *, duration: float = 0.5) -> SweepPolicy:
    """Short CPU sweeps for the shared development machine. The tolerance is wide (85%):
    CPU timings on a 2-core host shared with other work swing by 2-5x, and this benchmark
    measures the path back to service, not the detector's sensitivity. Peers: one is
    enough here (4 nodes); the CPU floor is about a tenth of a healthy node's figures."""
    return SweepPolicy(
        device="cpu",
        gemm_duration_s=duration,
        gemm_dtypes=("float32",),
        gemm_size=96,
        membw_bytes=2 << 20,
        message_sizes_mb=(4,),
        repeats=5,
        comm_timeout_s=60.0,
        time_limit_min=3,
        start_timeout_min=2,
        pass_tolerance=0.85,
        bootstrap_min_nodes=1,
        peer_min_nodes=1,
        master_addr="127.0.0.1",
        comm_iters=5,
        comm_warmup=2,
        floors=(DEV_CPU_FLOOR,),
        workload_args=("--threads", "1"),
        result_dir=str(workdir / "results"),
    )


#: The development cluster's CPU floor: about a tenth of a healthy node's figures on the
#: shared 2-core machine (fp32 GEMM 0.013-0.022 TFLOP/s at 96x96, copy 12-20 GB/s, 1 thread).
DEV_CPU_FLOOR = ModelFloor(model="cpu *", fraction=1.0, gemm_tflops={"float32": 0.0015}, membw_gbps=1.0)


@dataclass
class NodeRun:
    node: str
    returned: bool
    return_s: float
    jobs_s: float
    node_s: float
    ref_held_s: float | None
    pair_job_s: float | None
    sweeps: int
    queue_s: float
    """Seconds the sweep jobs waited in Slurm's queue (submit -> start)."""
    ticks: int
    tick_s: float
    """Mean wall time of one scheduler tick (Slurm reads + decisions), seconds."""

    @property
    def overhead_s(self) -> float:
        return self.return_s - self.jobs_s


def summarise(runs: list[NodeRun]) -> dict[str, float | int | None]:
    done = [r for r in runs if r.returned]
    node_s = sum(r.node_s for r in runs)
    held = [r.ref_held_s for r in done if r.ref_held_s is not None]
    pair = [r.pair_job_s for r in done if r.pair_job_s is not None]
    return {
        "returned": len(done),
        "measured": len(runs),
        "median_return_s": statistics.median(r.return_s for r in done) if done else None,
        "median_jobs_s": statistics.median(r.jobs_s for r in done) if done else None,
        "median_overhead_s": statistics.median(r.overhead_s for r in done) if done else None,
        "median_queue_s": statistics.median(r.queue_s for r in done) if done else None,
        "node_hours_per_returned": node_s / 3600.0 / len(done) if done else None,
        "median_ref_held_s": statistics.median(held) if held else None,
        "median_pair_job_s": statistics.median(pair) if pair else None,
        "mean_tick_s": statistics.mean(r.tick_s for r in runs) if runs else None,
    }


def _episode_figures(
    store: Store, node: str, t_drain: float
) -> tuple[float, float, float | None, float | None, int, float]:
    """(jobs_s, node_s, ref_held_s, pair_job_s, sweeps, queue_s) of the node's last episode."""
    sweeps = [s for s in store.sweeps(node=node) if s.created_at.timestamp() >= t_drain - 1]
    jobs_s = sum(float(s.metrics.get("runtime_s") or 0.0) for s in sweeps)
    node_s = sum(rec.sweep_cost(s).node_seconds for s in sweeps)
    pair = [s for s in sweeps if s.kind is SweepKind.TWO_NODE and rec.passed(s)]
    pair_job = float(pair[-1].metrics.get("runtime_s") or 0.0) if pair else None
    # the pair reservation's create row names no single node; match it by name
    audit = [
        a
        for a in store.audit_entries(action=("reservation_create", "reservation_delete"), since=t_drain - 1)
        if a.reason == pair_name(node)
    ]
    made = [a.at.timestamp() for a in audit if a.action == "reservation_create"]
    gone = [a.at.timestamp() for a in audit if a.action == "reservation_delete"]
    held = gone[-1] - made[-1] if made and gone and gone[-1] >= made[-1] else None
    queue_s = sum(
        max(0.0, (s.started_at - s.submitted_at).total_seconds())
        for s in sweeps
        if s.started_at is not None and s.submitted_at is not None
    )
    return jobs_s, node_s, held, pair_job, len(sweeps), queue_s


class _Rig:
    def __init__(self, cluster, workdir: Path, policy: SweepPolicy) -> None:
        from slurmguard.respond.actions import ActionExecutor
        from slurmguard.slurm.commands import CommandSlurmClient
        from slurmguard.sweeps.scheduler import SweepScheduler

        url = f"sqlite:///{workdir / 'bench.db'}"
        db.upgrade(url)
        self.clock = SystemClock()
        self.store = Store.open(url, self.clock)
        self.slurm = CommandSlurmClient(env=cluster.env, timeout_s=30)
        self.executor = ActionExecutor(self.slurm, self.store)
        self.sched = SweepScheduler(policy, TriagePolicy(), self.store, self.slurm, self.clock, self.executor)

    def run_until(self, pred, tick_s: float, timeout_s: float) -> tuple[bool, int, float]:
        """Tick until pred(); (reached, ticks, mean tick seconds)."""
        deadline = time.monotonic() + timeout_s
        ticks, spent = 0, 0.0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            res = self.sched.tick()
            spent += time.monotonic() - t0
            ticks += 1
            if res.errors:
                raise click.ClickException("; ".join(res.errors))
            if pred():
                return True, ticks, spent / ticks
            time.sleep(max(0.0, tick_s - (time.monotonic() - t0)))
        return False, ticks, spent / max(ticks, 1)

    def state(self, node: str) -> NodeState:
        record = self.store.get_node(node)
        if record is None:
            raise SlurmguardError(f"{node}: not in the store")
        return record.state


@dataclass
class ColdStart:
    node: str
    returned: bool
    return_s: float
    """Drain -> lifecycle healthy with an empty database, seconds."""
    peers: list[str]
    """Nodes the scheduler swept itself as same-window peers."""
    basis: str | None
    """Reference the returned node's 1-node verdict used (peers, class, floor)."""
    sweeps: int


def cold_start_case(rig: _Rig, node: str, *, tick_s: float, timeout_s: float) -> ColdStart:
    """Drain one node on an empty database and tick until it is back (no seeding step).

    A site's bootstrap_min_nodes (3) here, so the class baseline cannot form from the one
    peer and the verdict shows the same-window peer path; the measured runs after it use
    the bench policy's 1."""
    reason = "slurmguard: bench drain (cold start)"
    policy = rig.sched.policy
    rig.sched.policy = policy.model_copy(update={"bootstrap_min_nodes": 3})
    t0 = time.monotonic()
    t_drain = rig.clock.now()
    rig.sched.tick()  # the first cycle registers the nodes
    rig.executor.drain(node, reason)
    rig.store.transition(node, NodeState.DRAINING, f"drained: {reason}")
    returned, _, _ = rig.run_until(lambda: rig.state(node) is NodeState.HEALTHY, tick_s, timeout_s)
    wall = time.monotonic() - t0
    peers = sorted(
        {
            t.node
            for t in rig.store.transitions(since=t_drain - 1, to_state=NodeState.QUARANTINED)
            if isinstance(t.evidence, dict) and t.evidence.get("peer")
        }
    )
    mine = [s for s in rig.store.sweeps(node=node) if rec.passed(s) and s.kind is SweepKind.ONE_NODE]
    basis = mine[-1].metrics.get("basis") if mine else None
    # wait for the peers' own episodes, so the next runs start from idle healthy nodes
    rig.run_until(lambda: all(rig.state(p) is NodeState.HEALTHY for p in peers), tick_s, timeout_s)
    rig.sched.policy = policy
    return ColdStart(node, returned, wall, peers, basis, len(rig.store.sweeps(node=node)))


@dataclass
class FalseFails:
    sweeps: int
    fails: int
    outcomes: dict[str, int]
    reasons: list[str]
    worst_deviation: float | None
    """The largest shortfall of a healthy sweep's metric against its reference (fraction)."""


def false_fail_rate(
    rig: _Rig, cluster, nodes: list[str], count: int, policy: SweepPolicy, workdir: Path, echo=print
) -> FalseFails:
    """`count` 1-node sweeps of idle healthy nodes, round robin, one job per node at a time,
    each judged as a suspected node's sweep against the class baseline in the database."""
    from slurmguard.sweeps.baseline import baseline_for, peers_for
    from slurmguard.sweeps.reference import hw_class
    from slurmguard.sweeps.result import ResultError, load_result
    from slurmguard.sweeps.scheduler import workload_args
    from slurmguard.sweeps.templates import SweepJobSpec, render_sweep_script
    from slurmguard.sweeps.verdict import judge_result

    outcomes: dict[str, int] = {}
    reasons: list[str] = []
    worst: float | None = None
    done = 0
    out_dir = workdir / "healthy"
    out_dir.mkdir(exist_ok=True)
    pending: dict[int, tuple[str, Path]] = {}
    queue = [nodes[i % len(nodes)] for i in range(count)]
    healthy_nodes = {r.name for r in rig.store.list_nodes(NodeState.HEALTHY)}
    history = rec.healthy_results(
        [s for s in rig.store.sweeps(kind=SweepKind.ONE_NODE) if s.node in healthy_nodes]
    )
    while queue or pending:
        busy = {n for n, _ in pending.values()}
        for node in list(queue):
            if node in busy:
                continue
            queue.remove(node)
            busy.add(node)
            out = out_dir / f"{done + len(pending)}-{node}.json"
            # the class the scheduler gives this node: results are compared within it
            klass = hw_class(rig.slurm.node(node), rig.store.get_node(node), policy)
            spec = SweepJobSpec(
                kind="node",
                nodes=(node,),
                out_path=str(out),
                log_path=str(out) + ".log",
                time_limit_min=policy.time_limit_min,
                job_name=f"sg_bench_healthy_{node}",
                hw_class=klass,
                extra_args=workload_args(policy),
            )
            jid = cluster.sbatch(render_sweep_script(spec, policy), "--nodelist", node)
            pending[jid] = (node, out)
        for jid in list(pending):
            state = cluster.job_state(jid)
            if state in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                continue
            node, out = pending.pop(jid)
            done += 1
            try:
                res = load_result(str(out))
            except ResultError as exc:
                outcomes["no result"] = outcomes.get("no result", 0) + 1
                reasons.append(f"{node}: {exc}")
                continue
            v = judge_result(
                res,
                baseline_for(res, history, max_age_s=policy.baseline_max_age_h * 3600.0, now=rig.clock.now()),
                policy,
                suspected=True,
                peers=peers_for(res, history, policy.peer_window_min * 60.0),
            )
            outcomes[v.outcome.value] = outcomes.get(v.outcome.value, 0) + 1
            devs = [c.deviation for c in v.checks if c.deviation is not None]
            if devs:
                worst = min(devs) if worst is None else min(worst, min(devs))
            if not v.outcome.returns_node:
                reasons.append(f"{node}: {v.reason}")
            echo(
                f"healthy sweep {done}/{count} of {node}: {v.outcome.value} ({v.basis_text};"
                f" worst metric {min(devs):+.0%})"
                if devs
                else f"healthy sweep {done}/{count} of {node}: {v.outcome.value}"
            )
        time.sleep(1.0)
    fails = sum(v for k, v in outcomes.items() if k not in ("pass", "bootstrap"))
    return FalseFails(done, fails, outcomes, reasons, worst)


def run_bench(
    cluster,
    workdir: Path,
    *,
    nodes: list[str],
    tick_s: float,
    duration: float,
    timeout_s: float,
    echo=print,
    cold_start: bool = True,
    healthy_sweeps: int = 0,
) -> tuple[dict, list[NodeRun]]:
    policy = devcluster_sweep_policy(workdir, duration=duration)
    rig = _Rig(cluster, workdir, policy)
    seed = cluster.node_names[0]
    extra: dict = {}
    if cold_start:
        cs = cold_start_case(rig, nodes[0], tick_s=tick_s, timeout_s=timeout_s)
        extra["cold_start"] = asdict(cs)
        echo(
            f"cold start (empty database): {cs.node} {'returned' if cs.returned else 'NOT returned'}"
            f" in {cs.return_s:.1f}s; peers swept: {', '.join(cs.peers) or '-'}; its 1-node verdict"
            f" used: {cs.basis}"
        )
    else:
        # the bootstrap: one rolling sweep of an unsuspected node
        rig.sched.policy = policy.model_copy(
            update={"rolling_enabled": True, "rolling_nodes_per_hour": 3600.0}
        )
        t0 = time.monotonic()
        ok, _, _ = rig.run_until(lambda: rig.state(seed) is not NodeState.HEALTHY, tick_s, 30)
        ok = ok and rig.run_until(lambda: rig.state(seed) is NodeState.HEALTHY, tick_s, timeout_s)[0]
        if not ok:
            raise click.ClickException(f"bootstrap sweep of {seed} did not finish in {timeout_s:g}s")
        echo(
            f"bootstrap: rolling sweep of {seed} (class baseline + trusted reference) in"
            f" {time.monotonic() - t0:.1f}s"
        )
    rig.sched.policy = policy
    runs = []
    for node in nodes:
        reason = "slurmguard: bench drain (step time +15% vs peers)"
        t_drain = rig.clock.now()
        t0 = time.monotonic()
        rig.executor.drain(node, reason)
        rig.store.transition(node, NodeState.DRAINING, f"drained: {reason}")
        returned, ticks, tick_mean = rig.run_until(
            lambda n=node: rig.state(n) is NodeState.HEALTHY, tick_s, timeout_s
        )
        wall = time.monotonic() - t0
        jobs_s, node_s, held, pair_job, nsweeps, queue_s = _episode_figures(rig.store, node, t_drain)
        run = NodeRun(
            node, returned, wall, jobs_s, node_s, held, pair_job, nsweeps, queue_s, ticks, tick_mean
        )
        runs.append(run)
        mine = [x for x in rig.store.sweeps(node=node) if x.created_at.timestamp() >= t_drain - 1]
        outcomes = ", ".join(
            f"{'sweep1' if x.kind is SweepKind.ONE_NODE else 'sweep2'} {rec.outcome_of(x)}"
            + ("" if rec.passed(x) else f" ({x.failure_reason})")
            for x in mine
        )
        echo(
            f"{node}: {'returned' if returned else 'NOT returned'} in {wall:.1f}s"
            f" ({nsweeps} sweeps, jobs {jobs_s:.1f}s): {outcomes}"
        )
    summary = summarise(runs)
    if healthy_sweeps > 0:
        cluster.wait_nodes_idle(timeout=120)
        ff = false_fail_rate(rig, cluster, cluster.node_names, healthy_sweeps, policy, workdir, echo=echo)
        extra["false_fail"] = asdict(ff)
    rig.store.close()
    summary.update(extra)
    return summary, runs


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if isinstance(v, float) and v < 1 else (f"{v:.1f}" if isinstance(v, float) else str(v))


@click.command("sweeps")
@click.option(
    "--nodes",
    "count",
    type=click.IntRange(1, 3),
    default=3,
    show_default=True,
    help="drained nodes to verify and return, one after another (node2..)",
)
@click.option(
    "--tick",
    "tick_s",
    type=click.FloatRange(0.1, 30),
    default=1.0,
    show_default=True,
    help="scheduler cycle, seconds (the controller's cycle_interval_s)",
)
@click.option(
    "--duration",
    type=click.FloatRange(0.1, 60),
    default=0.5,
    show_default=True,
    help="GEMM seconds per dtype inside the sweeps",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=300.0,
    show_default=True,
    help="give up on a node after this many seconds",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="use the running development cluster there (default: start a temporary one)",
)
@click.option(
    "--cold-start/--no-cold-start",
    default=True,
    show_default=True,
    help="first drain and return a node on an empty database (no seeding step)",
)
@click.option(
    "--healthy-sweeps",
    type=click.IntRange(0, 500),
    default=20,
    show_default=True,
    help="1-node sweeps of healthy nodes judged for the false-fail rate (0: skip)",
)
@click.option("--json", "as_json", is_flag=True)
def bench_sweeps(
    count: int,
    tick_s: float,
    duration: float,
    timeout_s: float,
    state_dir: str | None,
    cold_start: bool,
    healthy_sweeps: int,
    as_json: bool,
) -> None:
    """Time and sweep node-hours to verify and return a drained node (dev cluster)."""
    from slurmguard_dev.devcluster import ClusterSpec, DevCluster
    from slurmguard_dev.devcluster.devreboot import adopt_restarted
    from slurmguard_dev.devcluster.devreboot import install as install_devreboot

    workdir = Path(tempfile.mkdtemp(prefix="sg-bench-sweeps-"))
    started = False
    if state_dir:
        cluster = DevCluster.attach(state_dir)
        if not cluster.is_running():
            raise click.ClickException(f"no running development cluster in {state_dir}")
    else:
        cluster = DevCluster(ClusterSpec(state_dir=workdir / "cluster", nodes=4))
        cluster.up()
        started = True
        # a node that fails a noisy sweep twice climbs to the reboot rung: make it real
        install_devreboot(cluster)
    echo = (lambda *_: None) if as_json else click.echo
    try:
        cluster.wait_nodes_idle(timeout=60)
        summary, runs = run_bench(
            cluster,
            workdir,
            nodes=cluster.node_names[1 : 1 + count],
            tick_s=tick_s,
            duration=duration,
            timeout_s=timeout_s,
            echo=echo,
            cold_start=cold_start,
            healthy_sweeps=healthy_sweeps,
        )
    finally:
        if started:
            adopt_restarted(cluster)
            cluster.down()
        else:
            res = cluster.run(["scontrol", "show", "reservation", "-o"])
            for tok in res.stdout.split():
                if tok.startswith("ReservationName=slurmguard_"):
                    cluster.run(["scontrol", "delete", tok])
        shutil.rmtree(workdir, ignore_errors=True)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "summary": summary,
                    "runs": [asdict(r) | {"overhead_s": r.overhead_s} for r in runs],
                    "tick_s": tick_s,
                }
            )
        )
        return
    click.echo("")
    click.echo(
        f"{'node':<8}{'return_s':>10}{'jobs_s':>9}{'overhead_s':>12}{'queue_s':>9}{'pair_job_s':>12}"
        f"{'ref_held_s':>12}{'node_s':>9}{'ticks':>7}"
    )
    for r in runs:
        click.echo(
            f"{r.node:<8}{_fmt(r.return_s):>10}{_fmt(r.jobs_s):>9}{_fmt(r.overhead_s):>12}"
            f"{_fmt(r.queue_s):>9}{_fmt(r.pair_job_s):>12}{_fmt(r.ref_held_s):>12}{_fmt(r.node_s):>9}"
            f"{r.ticks:>7}"
        )
    s = summary
    click.echo("")
    click.echo(
        f"returned {s['returned']}/{s['measured']} drained nodes; tick {tick_s:g}s"
        f" (mean tick cost {_fmt(s['mean_tick_s'])}s)"
    )
    if s["returned"]:
        share = 100.0 * s["median_jobs_s"] / s["median_return_s"]
        click.echo(
            f"time to return (median): {s['median_return_s']:.1f}s;"
            f" baseline, the sweep jobs alone: {s['median_jobs_s']:.1f}s ({share:.0f}%);"
            f" scheduling overhead {s['median_overhead_s']:.1f}s (of which Slurm queue"
            f" wait {s['median_queue_s']:.1f}s, the rest one tick per step)"
        )
        click.echo(
            f"sweep node-hours per returned node: {s['node_hours_per_returned']:.4f}"
            f" ({s['node_hours_per_returned'] * 3600:.1f} node-s)"
        )
        if s["median_ref_held_s"] is not None:
            click.echo(
                f"reference held {s['median_ref_held_s']:.1f}s per 2-node sweep"
                f" (its job ran {s['median_pair_job_s']:.1f}s)"
            )
    cs = s.get("cold_start")
    if cs:
        click.echo(
            f"cold start, empty database: {cs['node']} {'returned' if cs['returned'] else 'NOT returned'}"
            f" {cs['return_s']:.1f}s after its drain (baseline: the seeded runs above,"
            f" {s['median_return_s'] or 0:.1f}s median); peers swept {', '.join(cs['peers']) or '-'};"
            f" verdict vs {cs['basis']}"
        )
    ff = s.get("false_fail")
    if ff:
        worst = "-" if ff["worst_deviation"] is None else f"{ff['worst_deviation']:+.0%}"
        click.echo(
            f"false fails over healthy 1-node sweeps: {ff['fails']} in {ff['sweeps']} (target 0 in 20;"
            f" tolerance {devcluster_sweep_policy(Path('.')).pass_tolerance:.0%}, worst metric {worst});"
            f" outcomes {ff['outcomes']}"
        )
        for r in ff["reasons"][:5]:
            click.echo(f"  {r}")
