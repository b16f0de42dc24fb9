"""`slurmguard bench agent`: CPU and memory of one node agent watching a busy node.

Two real `slurmguard agent` processes run side by side for `--duration` s
with the same policy, sim telemetry and a local report sink standing in for
the controller (it answers 200 and counts what it gets):

- loaded: its ring root holds the rings of one job with `--ranks` ranks on
  this node, written by the real ring writer (hook/ring.RingWriter) in a
  separate writer process at a realistic rate: every `--step-s` seconds each
  rank records `--collectives` collectives (reduce-scatter / all-gather /
  all-reduce on a few communicators, sizes and durations of a data-parallel
  step), the compute between them left as gaps;
- baseline: an idle agent whose ring root is empty.

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


def write_rings(root: str, node: str, job_id: int, ranks: int, collectives: int, step_s: float,
                stop_after_s: float) -> None:
    """The writer process: `ranks` rings of one job, `collectives` records per rank per step.

    Each step: the ranks' collectives are spread over the step with compute
    gaps between them; durations vary by a few percent between ranks.
    """
    import random

    from slurmguard.hook.ring import OP, SOURCE_NCCL, RingWriter, comm_id_of, ring_file_name

    job_dir = Path(root) / str(job_id)
    job_dir.mkdir(parents=True, exist_ok=True)
    writers = [RingWriter(str(job_dir / ring_file_name(r, 0, "nccl")), job_id=job_id, step_id=0,
                          global_rank=r, local_rank=r, world_size=ranks, source=SOURCE_NCCL,
                          node_name=node) for r in range(ranks)]
    comms = [comm_id_of(f"dp-{i}") for i in range(4)]
    # one step's op sequence: reduce-scatter/all-gather of gradient buckets, a few all-reduces
    kinds = [OP["reducescatter"], OP["allgather"]] * (collectives // 2 - 2) + [OP["allreduce"]] * 4
    kinds = (kinds + [OP["allreduce"]] * collectives)[:collectives]
    rng = random.Random(0)
    deadline = time.monotonic() + stop_after_s
    step = 0
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        slot = step_s / collectives
        for i, op in enumerate(kinds):
            target = t0 + (i + 1) * slot
            now = time.monotonic()
            if target > now:
                time.sleep(target - now)
            end = time.monotonic_ns()
            for r, w in enumerate(writers):
                dur = int(slot * 0.3e9 * (1 + 0.02 * rng.random() + 0.01 * r / ranks))
                w.append(op, comm_id=comms[i % len(comms)], count=1 << 22, nbytes=1 << 23,
                         start_ns=end - dur, end_ns=end, datatype=10, redop=1)
        step += 1
    for w in writers:
        w.close()


class _Sink(BaseHTTPRequestHandler):
    stats: dict = {}

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        node = "?"
        ranks = 0
        try:
            doc = json.loads(body)
            node = doc.get("node", "?")
            ranks = sum(len(j.get("ranks", [])) for j in doc.get("jobs", []))
        except (ValueError, AttributeError):
            pass
        s = self.stats.setdefault(node, {"reports": 0, "bytes": 0, "ranks": 0})
        s["reports"] += 1
        s["bytes"] += len(body)
        s["ranks"] = max(s["ranks"], ranks)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

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


@click.command("agent")
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(5),
              help="Measured seconds.")
@click.option("--warmup", default=20.0, show_default=True, type=click.FloatRange(0),
              help="Seconds before measuring (start-up, ring discovery).")
@click.option("--ranks", default=8, show_default=True, type=click.IntRange(1, 256))
@click.option("--collectives", default=200, show_default=True, type=click.IntRange(8),
              help="Collectives per rank per step.")
@click.option("--step-s", default=1.0, show_default=True, type=click.FloatRange(0.05),
              help="Step time, seconds (1 s: 200 collectives/s per rank).")
@click.option("--report-interval", default=None, type=float,
              help="agent.report_interval_s for both agents [default: the policy's].")
@click.option("--profile", "profile_top", default=0, show_default=True, type=click.IntRange(0),
              help="Afterwards run the loaded agent in-process under cProfile for --duration s"
                   " and print this many functions by own time (0: no profile).")
def bench_agent(duration: float, warmup: float, ranks: int, collectives: int, step_s: float,
                report_interval: float | None, profile_top: int) -> None:
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
        writer = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from slurmguard.agent_bench import write_rings; "
             "write_rings(sys.argv[1], 'benchnode', 4242, int(sys.argv[2]), int(sys.argv[3]), "
             "float(sys.argv[4]), float(sys.argv[5]))",
             str(roots["loaded"]), str(ranks), str(collectives), str(step_s), str(total)])
        env = {**os.environ, "SLURMGUARD_POLICY": str(policy)}
        slurmguard = Path(sys.executable).with_name("slurmguard")
        base = [str(slurmguard)] if slurmguard.is_file() else [sys.executable, "-m", "slurmguard.cli"]
        agents = {
            name: subprocess.Popen(
                [*base, "agent", "--node", "benchnode" if name == "loaded" else "idlenode",
                 "--controller", url, "--ring-root", str(root), "--telemetry", "sim"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for name, root in roots.items()}
        try:
            click.echo(f"agents started; warming up {warmup:g} s, then measuring {duration:g} s "
                       f"({ranks} ranks x {collectives} collectives per {step_s:g} s step = "
                       f"{ranks * collectives / step_s:.0f} records/s)")
            time.sleep(warmup)
            for name, p in agents.items():
                if p.poll() is not None:
                    err = p.stderr.read().decode(errors="replace").strip().splitlines()[-3:]
                    raise click.ClickException(f"{name} agent exited: {' | '.join(err)}")
            c0 = {n: _cpu_s(p.pid) for n, p in agents.items()}
            w0 = time.monotonic()
            rss = {n: _rss_mb(p.pid) for n, p in agents.items()}
            while time.monotonic() - w0 < duration:
                time.sleep(1.0)
                for n, p in agents.items():
                    rss[n] = max(rss[n], _rss_mb(p.pid))
            wall = time.monotonic() - w0
            cpu = {n: _cpu_s(p.pid) - c0[n] for n, p in agents.items()}
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
        stats = _Sink.stats
        click.echo(f"{'agent':<34}{'CPU % of one core':>19}{'peak RSS MB':>13}{'reports':>9}"
                   f"{'ranks seen':>12}")
        for n, label in (("loaded", f"{ranks} ranks, {collectives} coll/step"),
                         ("baseline", "idle (no rings), baseline")):
            node = "benchnode" if n == "loaded" else "idlenode"
            s = stats.get(node, {"reports": 0, "ranks": 0})
            click.echo(f"{label:<34}{100 * cpu[n] / wall:>19.2f}{rss[n]:>13.1f}{s['reports']:>9}"
                       f"{s['ranks']:>12}")
        if not stats.get("benchnode", {}).get("ranks"):
            # the agent reads a ring only for a job Slurm runs on its node, owned by
            # that job's user: without that view it reads nothing, and its figures
            # would be an idle agent's
            raise click.ClickException(
                "the loaded agent reported no ranks: it trusts rings only of jobs Slurm runs on "
                "its node (no Slurm view here), so its CPU figure would be an idle agent's; "
                "nothing measured")
        pct, mb = 100 * cpu["loaded"] / wall, rss["loaded"]
        ok = pct <= TARGET_CPU_PCT and mb <= TARGET_RSS_MB
        click.echo(f"target: <= {TARGET_CPU_PCT:g}% of one core, <= {TARGET_RSS_MB:g} MB: "
                   f"{'met' if ok else 'MISSED'} ({pct:.2f}%, {mb:.0f} MB; over the idle agent "
                   f"+{pct - 100 * cpu['baseline'] / wall:.2f}%, +{mb - rss['baseline']:.0f} MB)")
        if profile_top:
            _profile(t, policy, ranks, collectives, step_s, duration, profile_top)


def _profile(t: Path, policy: Path, ranks: int, collectives: int, step_s: float,
             duration: float, top: int) -> None:
    """The loaded agent's loop in this process under cProfile, on fresh rings."""
    import cProfile
    import pstats

    from slurmguard.agent.daemon import Agent, run
    from slurmguard.agent.sender import ReportSender
    from slurmguard.config import load_policy
    from slurmguard.reports import read_secret
    from slurmguard.telemetry import open_source

    root = t / "rings-profile"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    writer = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from slurmguard.agent_bench import write_rings; "
         "write_rings(sys.argv[1], 'profnode', 4343, int(sys.argv[2]), int(sys.argv[3]), "
         "float(sys.argv[4]), float(sys.argv[5]))",
         str(root), str(ranks), str(collectives), str(step_s), str(duration + 10)])
    pol = load_policy(policy)
    agent = Agent(node="profnode", policy=pol,
                  sender=ReportSender(url, read_secret(pol.agent.secret_file), now=time.time),
                  source=open_source("sim", "profnode"), ring_root=str(root))
    stop = threading.Event()
    threading.Timer(duration, stop.set).start()
    prof = cProfile.Profile()
    try:
        time.sleep(3)  # the writer has created its rings
        prof.runcall(run, agent, stop)
    finally:
        writer.terminate()
        writer.wait(timeout=15)
        server.shutdown()
    stats = pstats.Stats(prof)
    click.echo(f"\nprofile of the loaded agent, {duration:g} s in-process "
               f"(total {stats.total_tt:.2f} s CPU under the profiler), top {top} by own time:")
    stats.sort_stats("tottime").print_stats(top)
    click.echo(f"top {top} by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)
