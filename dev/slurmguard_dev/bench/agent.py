"""`slurmguard bench agent`: CPU and memory of one node agent watching a busy node.

Two real agent processes (the daemon's own loop, slurmguard.agent.daemon.run)
run side by side for `--duration` s with the same policy, sim telemetry and a
local report sink standing in for the controller (it answers 200 and counts
what it gets):

- loaded: its ring root holds the rings of one job with `--ranks` ranks on
  this node, written by the real ring writer (hook/ring.RingWriter) in a
  separate writer process at a realistic rate: every `--step-s` seconds each
  rank records `--collectives` collectives (reduce-scatter / all-gather /
  all-reduce on a few communicators, sizes and durations of a data-parallel
  step), the compute between them left as gaps;
- baseline: an idle agent whose ring root is empty;
- with --baseline-src: a third agent, on the same rings as the loaded one,
  running another source tree's slurmguard (the release before a change).

The agent reads a ring only for a job Slurm says runs on its node, in a
directory owned by that job's user: each agent gets the project's FakeSlurm
(slurmguard.slurm.fake) as its Slurm view, in which the bench job runs on
the loaded agent's node as the bench's own user, so the loaded agent really
reads and analyses the rings. Each agent counts the ranks its reports carried
(taken from the reports it built, not from the wire format) and prints them
when it stops; a loaded agent that reported no ranks fails the bench.

After `--warmup` s (start-up, first discovery) the CPU time (utime + stime
from /proc/PID/stat) and the RSS (VmRSS, sampled every second; the peak is
printed) of each are measured; %-of-one-core = CPU s / wall s. Targets
(issue 17): <= 1% of one core, <= 100 MB.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click

TARGET_CPU_PCT = 1.0
TARGET_RSS_MB = 100.0


def _writers(job_dir: Path, job_id: int, ranks: int, node: str) -> list:
    """One NCCL-hook ring per rank of job_id in job_dir, as the hook names them."""
    from slurmguard.hook.ring import SOURCE_NCCL, RingWriter, ring_file_name

    return [
        RingWriter(
            str(job_dir / ring_file_name(r, 0, "nccl")),
            job_id=job_id,
            step_id=0,
            global_rank=r,
            local_rank=r,
            world_size=ranks,
            source=SOURCE_NCCL,
            node_name=node,
        )
        for r in range(ranks)
    ]


def write_rings(
    root: str, node: str, job_id: int, ranks: int, collectives: int, step_s: float, stop_after_s: float
) -> None:
    """The writer process: `ranks` rings of one job, `collectives` records per rank per step.

    Each step: a forward pass without collectives, then the ranks'
    collectives spread over the rest of the step with compute gaps between
    them; durations vary by a few percent between ranks.
    """
    import random

    job_dir = Path(root) / str(job_id)
    job_dir.mkdir(parents=True, exist_ok=True)
    writers = _writers(job_dir, job_id, ranks, node)
    kinds, comms = _step_ops(collectives)
    rng = random.Random(0)
    deadline = time.monotonic() + stop_after_s
    step = 0
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        # the forward pass (first 30% of the step) issues no collective: the
        # long gap at each iteration boundary that the period detection keys on
        slot = 0.7 * step_s / collectives
        for i, op in enumerate(kinds):
            target = t0 + 0.3 * step_s + (i + 1) * slot
            now = time.monotonic()
            if target > now:
                time.sleep(target - now)
            end = time.monotonic_ns()
            for r, w in enumerate(writers):
                _append(w, op, comms[i % len(comms)], end, _duration_ns(slot, r, ranks, rng))
        step += 1
    for w in writers:
        w.close()


def _step_ops(collectives: int) -> tuple[list[int], list[int]]:
    """One step's op sequence (reduce-scatter/all-gather of gradient buckets,
    a few all-reduces) and the communicators the ops take in turn."""
    from slurmguard.hook.ring import OP, comm_id_of

    kinds = [OP["reducescatter"], OP["allgather"]] * (collectives // 2 - 2) + [OP["allreduce"]] * 4
    return (kinds + [OP["allreduce"]] * collectives)[:collectives], [comm_id_of(f"dp-{i}") for i in range(4)]


def _duration_ns(slot_s: float, rank: int, ranks: int, rng) -> int:
    """A collective's duration: 30% of its slot, a few percent apart between ranks."""
    return int(slot_s * 0.3e9 * (1 + 0.02 * rng.random() + 0.01 * rank / ranks))


def _append(w, op: int, comm: int, end_ns: int, dur_ns: int) -> None:
    w.append(
        op,
        comm_id=comm,
        count=1 << 22,
        nbytes=1 << 23,
        start_ns=end_ns - dur_ns,
        end_ns=end_ns,
        datatype=10,
        redop=1,
    )


def replay(ranks: int, collectives: int, step_s: float, polls: int, poll_steps: int) -> None:
    """The agent's reading and analysis on the same rings every run: the
    writer's pattern on a virtual clock (steps of step_s ending before now),
    `poll_steps` steps written between polls; prints one JSON line, CPU ms
    per poll of the tracker's poll (reading), the analysis before the step
    detector (period finding, step samples) and the step detector, and the
    ops per iteration found at each poll. The same bytes and poll points for
    any source tree: the A/B that live agents, whose detection depends on when
    they poll, cannot give."""
    import random

    from slurmguard.agent.analysis import RankAnalyzer
    from slurmguard.agent.rings import RingTracker
    from slurmguard.config import Policy

    pol = Policy()
    with tempfile.TemporaryDirectory(prefix="sg-bench-replay-") as tmp:
        job_dir = Path(tmp) / str(JOB_ID)
        job_dir.mkdir()
        writers = _writers(job_dir, JOB_ID, ranks, "replaynode")
        kinds, comms = _step_ops(collectives)
        rng = random.Random(0)
        step_ns = int(step_s * 1e9)
        t0 = time.monotonic_ns() - (polls * poll_steps + 5) * step_ns
        tracker = RingTracker(tmp, "replaynode", lambda: {JOB_ID: os.getuid()}, pol.agent.max_ops_per_rank)
        analyzers: dict = {}
        cpu = {"read": 0.0, "analysis": 0.0, "detector": 0.0}
        periods = []
        slot = 0.7 * step_s / collectives
        for p in range(polls):
            for k in range(poll_steps):
                base = t0 + (p * poll_steps + k) * step_ns + int(0.3 * step_ns)
                for i, op in enumerate(kinds):
                    end = base + int((i + 1) * slot * 1e9) + rng.randrange(int(slot * 1e8))
                    for r, w in enumerate(writers):
                        _append(w, op, comms[i % len(comms)], end, _duration_ns(slot, r, ranks, rng))
            c = time.process_time()
            rings = tracker.poll()
            cpu["read"] += time.process_time() - c
            found = set()
            for tr in rings:
                an = analyzers.setdefault(tr.key, RankAnalyzer(pol.agent, pol.detection))
                c0 = time.process_time()
                steps = an._steps(tr)
                c1 = time.process_time()
                an._feed_bocd(tr, steps)
                cpu["analysis"] += c1 - c0
                cpu["detector"] += time.process_time() - c1
                found.add(an.structure[0] if an.structure else 0)
            periods.append(sorted(found))
        tracker.close()
        for w in writers:
            w.close()
    print(json.dumps({"ms_per_poll": {k: 1000 * v / polls for k, v in cpu.items()}, "periods": periods}))


JOB_ID = 4242
#: longest wait for both agents' first reports (s; start-up on a loaded machine)
READY_S = 180.0


def make_agent(node: str, url: str, policy_path: str, ring_root: str, job_id: int | None):
    """An agent as `slurmguard agent` builds it (policy, sender, sim telemetry),
    with a FakeSlurm view in which job `job_id` (None: no job) runs on `node`
    as this process's user, so the agent trusts that job's ring directory."""
    from slurmguard.agent.daemon import Agent
    from slurmguard.agent.sender import ReportSender
    from slurmguard.config import load_policy
    from slurmguard.slurm.fake import FakeSlurm
    from slurmguard.telemetry import open_source
    from slurmguard.wire import read_secret

    pol = load_policy(policy_path)
    slurm = FakeSlurm([node])
    if job_id is not None:
        slurm.start_job([node], user=str(os.getuid()), job_id=job_id)
    p = pol.agent
    sender = ReportSender(
        url,
        read_secret(p.secret_file, "node key"),
        timeout_s=p.request_timeout_s,
        max_reports=p.buffer_max_reports,
        now=time.time,
    )
    return Agent(
        node=node,
        policy=pol,
        sender=sender,
        source=open_source("sim", node),
        ring_root=ring_root,
        slurm=slurm,
    )


def run_agent(node: str, url: str, policy_path: str, ring_root: str, job_id: int | None, status: str) -> None:
    """The agent process: the daemon's loop until SIGTERM. After every report
    it builds, `status` holds JSON: reports built so far and the ranks the
    last one carried with iterations found (the bench starts measuring once the agent reports)."""
    from slurmguard.agent.daemon import run

    agent = make_agent(node, url, policy_path, ring_root, job_id)
    seen: dict = {"reports": 0, "ranks": 0}
    build = agent.build_report

    def counted():
        rep = build()
        seen["reports"] += 1
        # ranks whose iterations the agent found: it did the whole analysis for them
        seen["ranks"] = sum(1 for j in rep.jobs for r in j.ranks if r.steps)
        seen["periods"] = sorted({r.period_ops for j in rep.jobs for r in j.ranks if r.period_ops})
        tmp = status + ".tmp"
        with open(tmp, "w") as f:
            json.dump(seen, f)
        os.replace(tmp, status)
        return rep

    agent.build_report = counted
    run(agent)


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"reports": 0, "ranks": 0}


class _Sink(BaseHTTPRequestHandler):
    """Stands in for the controller: answers 200 to every report, whatever its format."""

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"accepted": true}'  # what the controller answers a report it took
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _writer(
    root: Path, node: str, job_id: int, ranks: int, collectives: int, step_s: float, seconds: float
) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from slurmguard_dev.bench.agent import write_rings; "
            "write_rings(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "
            "int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7]))",
            str(root),
            node,
            str(job_id),
            str(ranks),
            str(collectives),
            str(step_s),
            str(seconds),
        ]
    )


@click.command("agent")
@click.option(
    "--duration", default=60.0, show_default=True, type=click.FloatRange(5), help="Measured seconds."
)
@click.option(
    "--warmup",
    default=20.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds before measuring (start-up, ring discovery).",
)
@click.option("--ranks", default=8, show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--collectives",
    default=200,
    show_default=True,
    type=click.IntRange(8),
    help="Collectives per rank per step.",
)
@click.option(
    "--step-s",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.05),
    help="Step time, seconds (1 s: 200 collectives/s per rank).",
)
@click.option(
    "--report-interval",
    default=None,
    type=float,
    help="agent.report_interval_s for both agents [default: the policy's].",
)
@click.option(
    "--baseline-src",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Source tree of another release (its slurmguard/): a third agent runs its code"
    " on the same rings, in the same run, as the loaded agent's baseline.",
)
@click.option(
    "--replay",
    "replay_polls",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Afterwards replay this many polls (10 steps each) of the same rings on a virtual"
    " clock, in this tree and --baseline-src's, and print CPU ms per poll of reading,"
    " analysis and step detector (deterministic: the same detection in both; 0: no replay).",
)
@click.option(
    "--profile",
    "profile_top",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Afterwards run the loaded agent in-process under cProfile (after the same warm-up)"
    " for --duration s and print this many functions by own time (0: no profile).",
)
def bench_agent(
    duration: float,
    warmup: float,
    ranks: int,
    collectives: int,
    step_s: float,
    report_interval: float | None,
    baseline_src: Path | None,
    replay_polls: int,
    profile_top: int,
) -> None:
    """CPU and RSS of an agent watching RANKS busy rings vs an idle agent, same run."""
    with tempfile.TemporaryDirectory(prefix="sg-bench-agent-") as tmp:
        t = Path(tmp)
        secret = t / "secret"
        secret.write_text(secrets.token_hex(32))
        os.chmod(secret, 0o600)
        policy = t / "policies.yaml"
        lines = ["agent:", f"  secret_file: {secret}"]
        if report_interval is not None:
            lines.append(f"  report_interval_s: {report_interval}")
        policy.write_text("\n".join(lines) + "\n")
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        total = warmup + duration + 5
        roots = {"loaded": t / "rings-loaded", "baseline": t / "rings-empty"}
        for r in roots.values():
            r.mkdir()
        if baseline_src is not None:
            roots["loaded-src"] = roots["loaded"]  # the same rings, read by the other code
        writer = _writer(roots["loaded"], "benchnode", JOB_ID, ranks, collectives, step_s, total)
        status = {n: t / f"{n}.status" for n in roots}
        env = dict(os.environ)
        src_env = {**env, "PYTHONPATH": str(baseline_src)} if baseline_src is not None else env
        agents = {
            name: subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from slurmguard_dev.bench.agent import run_agent; "
                    "run_agent(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], "
                    "int(sys.argv[5]) if sys.argv[5] else None, sys.argv[6])",
                    "idlenode" if name == "baseline" else "benchnode",
                    url,
                    str(policy),
                    str(root),
                    "" if name == "baseline" else str(JOB_ID),
                    str(status[name]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                # the slurmguard imported: PYTHONPATH's for --baseline-src, never the
                # current directory's (python -c puts it first on sys.path)
                cwd=tmp,
                env=src_env if name == "loaded-src" else env,
            )
            for name, root in roots.items()
        }
        try:
            click.echo(
                f"agents started; once both report (the loaded one all {ranks} ranks), "
                f"warming up {warmup:g} s, then measuring {duration:g} s ({ranks} ranks x "
                f"{collectives} collectives per {step_s:g} s step = "
                f"{ranks * collectives / step_s:.0f} records/s)"
            )
            ready_by = time.monotonic() + READY_S
            while True:
                for name, p in agents.items():
                    if p.poll() is not None:
                        raw = p.stderr.read() if p.stderr is not None else b""
                        err = raw.decode(errors="replace").strip().splitlines()[-3:]
                        raise click.ClickException(f"{name} agent exited: {' | '.join(err)}")
                st = {n: _status(f) for n, f in status.items()}
                if st["baseline"]["reports"] and all(st[n]["ranks"] >= ranks for n in st if n != "baseline"):
                    break
                if time.monotonic() > ready_by:
                    raise click.ClickException(
                        f"after {READY_S:g} s the loaded agent reports {st['loaded']['ranks']} of "
                        f"{ranks} ranks (idle agent: {st['baseline']['reports']} reports); "
                        "nothing measured"
                    )
                time.sleep(0.5)
            time.sleep(warmup)
            c0 = {n: _cpu_s(p.pid) for n, p in agents.items()}
            r0 = {n: _status(f)["reports"] for n, f in status.items()}
            w0 = time.monotonic()
            rss = {n: _rss_mb(p.pid) for n, p in agents.items()}
            while time.monotonic() - w0 < duration:
                time.sleep(1.0)
                for n, p in agents.items():
                    rss[n] = max(rss[n], _rss_mb(p.pid))
            wall = time.monotonic() - w0
            cpu = {n: _cpu_s(p.pid) - c0[n] for n, p in agents.items()}
            seen = {n: _status(f) for n, f in status.items()}
        finally:
            for p in [*agents.values(), writer]:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in [*agents.values(), writer]:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
            server.shutdown()
        click.echo(
            f"{'agent':<34}{'CPU % of one core':>19}{'peak RSS MB':>13}{'reports':>9}"
            f"{'ranks analysed':>16}  ops per iteration found"
        )
        rows = [("loaded", f"{ranks} ranks, {collectives} coll/step")]
        if baseline_src is not None:
            rows.append(("loaded-src", f"same rings, {baseline_src.name} code"))
        rows.append(("baseline", "idle (no rings), baseline"))
        for n, label in rows:
            # a period far below COLLECTIVES: the agent took a fraction of an
            # iteration for one, and feeds its step detector that many times more
            click.echo(
                f"{label:<34}{100 * cpu[n] / wall:>19.2f}{rss[n]:>13.1f}"
                f"{seen[n]['reports'] - r0[n]:>9}{seen[n]['ranks']:>16}  "
                f"{','.join(map(str, seen[n].get('periods', []))) or '-'}"
            )
        if seen["loaded"]["ranks"] < ranks:
            raise click.ClickException(
                f"the loaded agent's last report carried {seen['loaded']['ranks']} of {ranks} "
                "ranks: its figures are not those of an agent watching them"
            )
        pct, mb = 100 * cpu["loaded"] / wall, rss["loaded"]
        ok = pct <= TARGET_CPU_PCT and mb <= TARGET_RSS_MB
        click.echo(
            f"target: <= {TARGET_CPU_PCT:g}% of one core, <= {TARGET_RSS_MB:g} MB: "
            f"{'met' if ok else 'MISSED'} ({pct:.2f}%, {mb:.0f} MB; over the idle agent "
            f"+{pct - 100 * cpu['baseline'] / wall:.2f}%, +{mb - rss['baseline']:.0f} MB)"
        )
        if replay_polls:
            _replays(ranks, collectives, step_s, replay_polls, baseline_src)
        if profile_top:
            _profile(t, policy, ranks, collectives, step_s, warmup, duration, profile_top)


def _replays(ranks: int, collectives: int, step_s: float, polls: int, baseline_src: Path | None) -> None:
    """replay() in a process per source tree (this one, then --baseline-src's)."""
    click.echo(
        f"\nreplay: {polls} polls of {ranks} rings x {10 * collectives} records, virtual clock;"
        " CPU ms per poll (report interval 10 s: 100 ms = 1% of one core)"
    )
    click.echo(
        f"{'code':<34}{'reading':>9}{'analysis':>10}{'detector':>10}{'total':>8}  ops per iteration by poll"
    )
    for label, src in (("this tree", None), (f"{baseline_src}", baseline_src)):
        if label != "this tree" and src is None:
            continue
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = str(src)
        with tempfile.TemporaryDirectory(prefix="sg-bench-replay-cwd-") as cwd:
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from slurmguard_dev.bench.agent import replay; "
                    "replay(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), 10)",
                    str(ranks),
                    str(collectives),
                    str(step_s),
                    str(polls),
                ],
                capture_output=True,
                text=True,
                cwd=cwd,
                env=env,
                timeout=1800,
                check=False,
            )
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            raise click.ClickException(
                f"replay on {label} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
            )
        got = json.loads(lines[-1])
        ms = got["ms_per_poll"]
        click.echo(
            f"{label[-34:]:<34}{ms['read']:>9.1f}{ms['analysis']:>10.1f}{ms['detector']:>10.1f}"
            f"{sum(ms.values()):>8.1f}  {' '.join('/'.join(map(str, p)) for p in got['periods'])}"
        )


def _profile(
    t: Path,
    policy: Path,
    ranks: int,
    collectives: int,
    step_s: float,
    warmup: float,
    duration: float,
    top: int,
) -> None:
    """The loaded agent's loop in this process under cProfile, on fresh rings,
    profiled as the agents are measured: only after it has reported all
    `ranks` ranks and `warmup` s more (a job's first seconds, while the
    agent learns the iterations, are a one-off cost, not the steady state)."""
    import cProfile
    import pstats

    from slurmguard.agent.daemon import run

    root = t / "rings-profile"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    writer = _writer(root, "profnode", JOB_ID + 1, ranks, collectives, step_s, READY_S + warmup + duration)
    agent = make_agent("profnode", url, str(policy), str(root), JOB_ID + 1)
    stop = threading.Event()
    # CPU time, not wall: on a shared machine waiting for a core is not the agent's cost
    prof = cProfile.Profile(time.process_time)
    state: dict[str, float | None] = {"from": None, "until": None}
    cycles = 0
    step, sample = agent.step, agent.sample_telemetry

    def profiled(fn):
        def call():
            nonlocal cycles
            now = time.monotonic()
            if state["from"] is None or now < state["from"]:
                rep = fn()
                if (
                    state["from"] is None
                    and fn is step
                    and sum(1 for j in rep.jobs for r in j.ranks if r.steps) >= ranks
                ):
                    state["from"] = now + warmup
                return rep
            if state["until"] is None:
                state["until"] = now + duration
            elif now >= state["until"]:
                stop.set()  # the run ends after this call, which is not profiled
                return fn()
            cycles += fn is step
            prof.enable()
            try:
                return fn()
            finally:
                prof.disable()

        return call

    agent.step, agent.sample_telemetry = profiled(step), profiled(sample)
    threading.Timer(READY_S + warmup + duration, stop.set).start()
    try:
        time.sleep(3)  # the writer has created its rings
        run(agent, stop)
    finally:
        stop.set()
        writer.terminate()
        writer.wait(timeout=15)
        server.shutdown()
    if state["until"] is None:
        raise click.ClickException("the profiled agent never reported all ranks: nothing profiled")
    stats = pstats.Stats(prof)
    total_s = stats.total_tt  # type: ignore[attr-defined]  # set by Stats; typeshed omits it
    click.echo(
        f"\nprofile of the loaded agent, {duration:g} s in-process after {warmup:g} s of warm-up, "
        f"{cycles} report cycles (total {total_s:.2f} s of process CPU under the profiler, "
        f"{100 * total_s / duration:.2f}% of one core with the profiler's overhead), top {top} by own time:"
    )
    stats.sort_stats("tottime").print_stats(top)
    click.echo(f"top {top} by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)
