"""One `slurmguard bench scale` measurement, in a process of its own.

Builds a synthetic fleet of N nodes x 8 GPUs with guarded jobs of 1 to 2,048
nodes, feeds every node's report into the real controller (FleetView ingest,
Controller.cycle on FakeSlurm and a real database) and, with --http, posts
signed reports to the real HTTP server on loopback. Prints one JSON line.

It uses only interfaces that the previous release has too (Controller,
FleetView.ingest, ControllerHTTP, AgentReport, FakeSlurm, Store), so the bench
runs the same file against an older source tree (PYTHONPATH=that tree) for its
baseline. Runnable as a script: `python scale_harness.py --nodes 1000 --db URL`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time

GPUS = 8
#: job sizes (nodes) of the synthetic fleet at 10,000 nodes: a few very large
#: jobs, a tail of small ones, 1,000 jobs in all (scaled down for smaller fleets)
_SIZES_10K = (
    [2048, 1024, 512, 512]
    + [256] * 4
    + [128] * 8
    + [64] * 10
    + [32] * 20
    + [16] * 40
    + [8] * 80
    + [4] * 100
    + [2] * 100
)


def job_sizes(nodes: int, jobs: int = 1000) -> list[int]:
    """Job sizes summing to at most `nodes`, the largest min(2048, nodes)."""
    scale = nodes / 10000
    sizes = [max(1, int(s * scale)) if s * scale >= 1 else 0 for s in _SIZES_10K]
    sizes = [s for s in sizes if s]
    want = max(1, int(jobs * min(1.0, scale)))
    sizes += [1] * max(0, want - len(sizes))
    out, used = [], 0
    for s in sizes[:want]:
        if used + s > nodes:
            break
        out.append(s)
        used += s
    return out


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Fleet:
    """The synthetic cluster: node names, jobs (id -> nodes), slow ranks."""

    def __init__(self, n: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.nodes = [f"sn{i:05d}" for i in range(n)]
        self.jobs: dict[int, list[str]] = {}
        at = 0
        for k, size in enumerate(job_sizes(n)):
            self.jobs[100000 + k] = self.nodes[at : at + size]
            at += size
        self.job_of = {node: j for j, ns in self.jobs.items() for node in ns}
        self.index = {node: i for ns in self.jobs.values() for i, node in enumerate(ns)}
        # one job in fifty has one node whose GPU 0 computes 30% slower
        self.slow = {ns[len(ns) // 2] for j, ns in self.jobs.items() if j % 50 == 7 and len(ns) > 1}
        self.slow_jobs = {self.job_of[n] for n in self.slow}


def report_dict(
    fleet: Fleet, node: str, seq: int, now: float, steps: int, epoch: int, period_s: float, tel_every_s: float
) -> dict:
    """What the node's agent would send at `now`: a window of `steps` iterations of
    each of its 8 ranks, and the telemetry samples of the last `period_s`."""
    rng = fleet.rng
    jobs = []
    job = fleet.job_of.get(node)
    if job is not None:
        idx = fleet.index[node]
        job_slow = job in fleet.slow_jobs
        ranks = []
        for g in range(GPUS):
            slow = node in fleet.slow and g == 0
            base, comm = 1.0, 0.3
            t = now - steps * base
            ss = []
            for i in range(steps):
                noise = rng.uniform(-0.005, 0.005)
                late = i >= steps - 20
                step = base * (1.3 if late and job_slow else 1.0) + noise
                compute = (base - comm) + (step - base if (late and slow) else 0.0)
                t += step
                ss.append({"end": t, "step_s": step, "comm_s": max(0.0, step - compute)})
            ranks.append(
                {
                    "rank": idx * GPUS + g,
                    "gpu": g,
                    "baseline_step_s": base,
                    "baseline_compute_s": base - comm,
                    "steps": ss,
                    "total_steps": 10 * steps,
                    "last_progress": t,
                    "role": None,
                }
            )
        jobs.append({"job_id": job, "ranks": ranks})
    tel = telemetry_dicts(fleet, now, period_s, tel_every_s)
    return {"node": node, "seq": seq, "epoch": epoch, "sent_at": now, "jobs": jobs, "telemetry": tel}


def telemetry_dicts(fleet: Fleet, now: float, period_s: float, tel_every_s: float) -> list[dict]:
    """A node's telemetry samples of the last `period_s`: SM clock and power of each GPU."""
    rng = fleet.rng
    tel = []
    k = max(1, int(period_s / tel_every_s))
    for i in range(k):
        ts = now - period_s + (i + 1) * tel_every_s
        for g in range(GPUS):
            tel.append(
                {
                    "signal": "sm_clock",
                    "value": 1980.0 + rng.uniform(-5, 5),
                    "unit": "MHz",
                    "timestamp": ts,
                    "gpu": g,
                }
            )
            tel.append(
                {
                    "signal": "power",
                    "value": 650.0 + rng.uniform(-10, 10),
                    "unit": "W",
                    "timestamp": ts,
                    "gpu": g,
                }
            )
    return tel


def run(args) -> dict:
    from slurmguard.clock import FakeClock
    from slurmguard.config import parse_policy
    from slurmguard.controller.loop import Controller
    from slurmguard.slurm.fake import FakeSlurm
    from slurmguard.store import Store
    from slurmguard.store import db as sgdb
    from slurmguard.wire import AgentReport, TelemetryRecord

    try:  # wire format 3 and later
        from slurmguard.wire import TelemetryColumns

        columns = TelemetryColumns.of
    except ImportError:
        columns = None

    out: dict = {"nodes": args.nodes, "steps": args.steps, "db": args.db.split(":", 1)[0]}
    fleet = Fleet(args.nodes)
    out["jobs"] = len(fleet.jobs)
    out["ranks"] = sum(len(ns) for ns in fleet.jobs.values()) * GPUS
    clock = FakeClock(start=1_700_000_000.0)
    policy = parse_policy(args.policy) if args.policy else parse_policy("{}")
    url = args.db
    sgdb.upgrade(url)
    store = Store.open(url, clock)
    slurm = FakeSlurm(fleet.nodes, clock=clock)
    refresh = slurm._refresh_alloc  # noqa: SLF001 - O(fleet) per job: once after placing all
    slurm._refresh_alloc = lambda: None  # type: ignore[method-assign]  # placement only, restored below
    for job, ns in fleet.jobs.items():
        slurm.start_job(ns, job_id=job)
    slurm._refresh_alloc = refresh  # type: ignore[method-assign]
    refresh()
    ctl = Controller(policy, store, slurm, clock)
    try:  # the controller command's collector settings, where the code has them
        from slurmguard.controller.daemon import tune_gc
    except ImportError:
        out["gc"] = "default"
    else:
        tune_gc()
        out["gc"] = "tuned"
    rss0 = _rss_mb()
    period = args.period
    epoch = 1

    def feed(seq: int) -> float:
        """Every node reports once. The first round is parsed from each node's own
        report (what the controller keeps is then its own, and the harness keeps
        nothing); later rounds re-send the kept report with the next seq and fresh
        telemetry (building 10,000 reports is the harness's cost, not the
        controller's, and so are objects it would hold for them between rounds)."""
        now = clock.now()
        t_in = 0.0
        for node in fleet.nodes:
            kept = ctl.fleet._latest.get(node)  # noqa: SLF001 - the same field in every release
            if kept is None:
                r = AgentReport.model_validate(
                    report_dict(fleet, node, seq, now, args.steps, epoch, period, args.tel_every)
                )
            else:
                tel = [
                    TelemetryRecord.model_construct(**t)
                    for t in telemetry_dicts(fleet, now, period, args.tel_every)
                ]
                # as the controller reads them off the wire: columns where the code has them
                r = kept.report.model_copy(
                    update={"seq": seq, "sent_at": now, "telemetry": columns(tel) if columns else tel}
                )
                del tel
            t0 = time.perf_counter()
            ctl.fleet.ingest(r, now)
            t_in += time.perf_counter() - t0
            del r
        return t_in

    times = []
    cpu = []
    for c in range(args.cycles):
        clock.advance(period)
        ingest_s = feed(c + 1)
        if c == 0:
            gc.collect()
            out["rss_fleet_mb"] = round(_rss_mb() - rss0, 1)
        else:
            out.setdefault("ingest_inproc_per_s", round(len(fleet.nodes) / ingest_s, 1))
        gc.collect()
        t0, p0 = time.perf_counter(), time.process_time()
        res = ctl.cycle()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - p0)
        if c == 0:
            out["first_cycle_actions"] = len(res.actions)
            out["first_cycle_errors"] = res.errors[:3]
            # the database after registering the fleet: what grows from here is per report round
            db0, rows0, t_db0 = _db_bytes(store, url), _db_rows(store), clock.now()
    times_sorted = sorted(times)
    out["cycle_s"] = [round(t, 3) for t in times]
    out["cycle_p50_s"] = round(statistics.median(times[1:] or times), 3)
    out["cycle_p99_s"] = round(times_sorted[min(len(times) - 1, int(0.99 * len(times)))], 3)
    out["cycle_cpu_p50_s"] = round(statistics.median(cpu[1:] or cpu), 3)
    # the first cycle registers the whole fleet in the database: once, at start
    out["cycle_cpu_max_s"] = round(max(cpu[1:] or cpu), 3)
    out["cycle_cpu_s"] = [round(t, 3) for t in cpu]
    out["assessed"] = len(res.assessments)
    hours = (clock.now() - t_db0) / 3600.0
    db1, rows1 = _db_bytes(store, url), _db_rows(store)
    if hours > 0 and db0 is not None and db1 is not None:
        # per hour of the fleet reporting every --period seconds (SQLite: file pages, so
        # coarse over a few cycles; the rows are exact)
        out["db_growth_mb_per_h"] = round((db1 - db0) / 1e6 / hours, 2)
        grown = {t: rows1.get(t, 0) - n0 for t, n0 in rows0.items()}
        out["db_rows_per_h"] = {t: round(n / hours) for t, n in grown.items() if n}
    out["rss_mb"] = round(_rss_mb(), 1)
    out["peak_rss_mb"] = round(_peak_mb(), 1)
    if args.http:
        out.update(http_ingest(args, fleet, ctl, clock))
    db_bytes = _db_bytes(store, url)
    if db_bytes is not None:
        out["db_mb"] = round(db_bytes / 1e6, 2)
    store.close()
    return out


def _db_rows(store) -> dict[str, int]:
    """Rows per table of the store's database (every release's tables, whatever they are)."""
    from sqlalchemy import inspect, text

    with store.engine.connect() as c:
        names = inspect(c).get_table_names()
        return {t: int(c.execute(text(f'select count(*) from "{t}"')).scalar()) for t in names}


def _db_bytes(store, url: str) -> int | None:
    if url.startswith("sqlite"):
        # the database's pages as a reader sees them (write-ahead log included), not the
        # files: the log's size is where it was last checkpointed, not what it holds
        with store.engine.connect() as c:
            pages = int(c.exec_driver_sql("PRAGMA page_count").scalar() or 0)
            free = int(c.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
            size = int(c.exec_driver_sql("PRAGMA page_size").scalar() or 0)
        return (pages - free) * size
    from sqlalchemy import text

    with store.engine.connect() as c:
        return int(c.execute(text("select pg_database_size(current_database())")).scalar())


#: the loopback client, run in a process of its own so that the controller's
#: figure is its own: argv = requests file, port, threads; prints "ok seconds cpu
#: connections". Each thread sends its requests one after another on one connection
#: as long as the controller keeps it alive (an agent's sender does the same), and
#: opens a new one when the answer says Connection: close (an older controller's one
#: request per connection, or its keepalive_max_requests)
_CLIENT = r"""
import socket, sys, threading, time
path, port, nthreads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
reqs, at = [], 0
while at < len(data):
    n = int.from_bytes(data[at:at + 4], "big")
    reqs.append(data[at + 4:at + 4 + n])
    at += 4 + n
reqs.reverse()
ok, conns, lock = 0, 0, threading.Lock()
def answer(s, buf):
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return None, b"", True
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length, close = 0, False
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        k = k.strip().lower()
        if k == b"content-length":
            length = int(v)
        elif k == b"connection":
            close = v.strip().lower() == b"close"
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            return lines[0], b"", True
        rest += chunk
    return lines[0], rest[length:], close
def client():
    global ok, conns
    s, buf = None, b""
    while True:
        with lock:
            if not reqs:
                break
            r = reqs.pop()
        if s is None:
            s, buf = socket.create_connection(("127.0.0.1", port), timeout=60), b""
            with lock:
                conns += 1
        s.sendall(r)
        status, buf, close = answer(s, buf)
        if status is not None and b" 200 " in status + b" ":
            with lock:
                ok += 1
        if close:
            s.close()
            s = None
    if s is not None:
        s.close()
threads = [threading.Thread(target=client) for _ in range(nthreads)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
print(ok, time.perf_counter() - t0, time.process_time(), conns)
"""


def http_ingest(args, fleet: Fleet, ctl, clock) -> dict:
    """Reports/s through the real HTTP server on loopback: bodies are built and
    signed in advance (in the wire format the code under test sends: what its
    AgentReport serialises to) and posted from a second process, so the figure
    is the controller's own cost; cpu: the controller process's CPU seconds per
    accepted report (what a loaded machine changes least)."""
    import subprocess

    from slurmguard import wire
    from slurmguard.config import ControllerPolicy
    from slurmguard.controller.metrics import ControllerMetrics
    from slurmguard.controller.server import ControllerHTTP
    from slurmguard.wire import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, node_key, sign

    # what the code's agent sends: wire format 4 and later encode_report, before that the JSON
    encode = getattr(wire, "encode_report", lambda r: r.model_dump_json().encode())
    ctype = getattr(wire, "CONTENT_TYPE", "application/json")

    secret = b"scale-bench-master-secret-0123456789"
    pol = ControllerPolicy(
        ip_rate_per_s=1e9,
        ip_burst=1_000_000,
        node_rate_per_s=1e9,
        node_burst=1_000_000,
        max_body_bytes=64 << 20,
        workers=args.workers,
        max_pending=1024,
    )
    metrics = ControllerMetrics()
    http = ControllerHTTP(
        "127.0.0.1",
        0,
        secret=secret,
        ingest=lambda r: ctl.fleet.ingest(r, clock.now()),
        metrics=metrics,
        now=clock.now,
        health=lambda: (True, "ok"),
        policy=pol,
        known=ctl.fleet.known,
    )
    http.start()
    tmp = tempfile.mkdtemp(prefix="sg-scale-http-")
    try:
        clock.advance(args.period)
        now = clock.now()
        # --http-reports in all: the fleet's nodes in turn, round after round where the
        # fleet is smaller (each round's seq higher: a node's reports are a fleet apart,
        # so with more nodes than client threads never in flight at once)
        n = args.http_reports
        path = os.path.join(tmp, "requests")
        size = 0
        with open(path, "wb") as f:
            for i in range(n):
                node = fleet.nodes[i % len(fleet.nodes)]
                body = encode(
                    AgentReport.model_validate(
                        report_dict(fleet, node, 10_000 + i, now, args.steps, 2, args.period, args.tel_every)
                    )
                )
                ts = f"{now:.3f}"
                sig = sign(node_key(secret, node), ts, node, body)
                head = (
                    f"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\n{TIME_HEADER}: {ts}\r\n{NODE_HEADER}: {node}"
                    f"\r\n{SIG_HEADER}: {sig}\r\n\r\n"
                ).encode()
                f.write((len(head) + len(body)).to_bytes(4, "big") + head + body)
                size += len(head) + len(body)
        gc.collect()
        in_gc = [0.0, 0.0]  # CPU seconds in the cyclic collector, when the current one began

        def collecting(phase: str, info: dict) -> None:
            if phase == "start":
                in_gc[1] = time.process_time()
            else:
                in_gc[0] += time.process_time() - in_gc[1]

        gc.callbacks.append(collecting)
        cpu0 = time.process_time()
        try:
            p = subprocess.run(
                [sys.executable, "-c", _CLIENT, path, str(http.port), str(args.clients)],
                capture_output=True,
                text=True,
                timeout=600,
                shell=False,
                check=True,
            )
        finally:
            cpu = time.process_time() - cpu0
            gc.callbacks.remove(collecting)
        ok_s, dt_s, client_cpu, conns = p.stdout.split()
        ok, dt = int(ok_s), float(dt_s)
        return {
            "http_reports": n,
            "http_ok": ok,
            "http_connections": int(conns),
            "http_reports_per_s": round(ok / dt, 1),
            "http_cpu_ms_per_report": round(1e3 * cpu / max(1, ok), 3),
            # of which the cyclic garbage collector's (process time: the other threads' too)
            "http_gc_ms_per_report": round(1e3 * in_gc[0] / max(1, ok), 3),
            "http_client_cpu_s": round(float(client_cpu), 2),
            "http_s": round(dt, 2),
            "report_kb": round(size / n / 1024, 1),
        }
    finally:
        http.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--db", default=None, help="database URL (default: a temporary SQLite file)")
    ap.add_argument("--steps", type=int, default=32, help="iterations per rank in each report")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between reports of a node")
    ap.add_argument("--tel-every", type=float, default=5.0, help="seconds between telemetry samples")
    ap.add_argument("--policy", default=None, help="policy YAML text")
    ap.add_argument("--http", action="store_true", help="also measure ingestion over HTTP")
    ap.add_argument("--http-reports", type=int, default=5000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args(argv)
    tmp = None
    if args.db is None:
        tmp = tempfile.mkdtemp(prefix="sg-scale-")
        args.db = f"sqlite:///{tmp}/sg.db"
    import logging

    logging.basicConfig(level=logging.CRITICAL)
    try:
        out = run(args)
    except Exception as exc:  # noqa: BLE001 - the bench prints what failed, per run
        out = {"nodes": args.nodes, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if tmp is not None:  # the temporary SQLite database (tens of MB at 10,000 nodes)
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
