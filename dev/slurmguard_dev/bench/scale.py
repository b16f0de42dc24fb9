"""`slurmguard bench scale`: the real controller (store, cycle, HTTP server) with a
synthetic fleet of N nodes x 8 GPUs, per N and database, against the previous
release's code in the same run (--baseline-src: a source tree of it).

Each measurement runs in a process of its own (bench/scale_harness.py), so
its RSS is its own and the baseline runs the same harness on its own code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

HARNESS = Path(__file__).with_name("scale_harness.py")
RUN_TIMEOUT_S = 3600


def _run(src: Path | None, nodes: int, db: str | None, args: list[str]) -> dict:
    """One harness run; src: the source tree to import slurmguard from (None: this one)."""
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-scale-"))
    try:
        # copied out of the package: run as a script from its own directory, it
        # imports slurmguard from src (PYTHONPATH) and nothing next to it
        script = tmp / "scale_harness.py"
        shutil.copy(HARNESS, script)
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = str(src)
            env["SLURMGUARD_MIGRATIONS"] = str(src / "sql" / "migrations")
        argv = [sys.executable, str(script), "--nodes", str(nodes), *args]
        if db is not None:
            argv += ["--db", db]
        try:
            p = subprocess.run(
                argv, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S, shell=False, check=False
            )
        except subprocess.TimeoutExpired:
            return {"nodes": nodes, "error": f"timed out after {RUN_TIMEOUT_S}s"}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            return {"nodes": nodes, "error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(lines[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fresh_db(url: str | None, tag: str) -> str | None:
    """A new, empty database per run: a PostgreSQL URL gets a database of its own."""
    if url is None or not url.startswith("postgresql"):
        return None
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    name = f"sg_scale_{tag}_{os.getpid()}"
    with psycopg.connect(
        host=u.host,
        port=u.port,
        user=u.username,
        password=u.password,
        dbname=u.database or "postgres",
        autocommit=True,
        connect_timeout=10,
    ) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    return u.set(database=name).render_as_string(hide_password=False)


@click.command("scale")
@click.option(
    "--nodes",
    "sizes",
    default="100,1000,10000",
    show_default=True,
    help="Comma-separated fleet sizes (nodes of 8 GPUs).",
)
@click.option(
    "--db",
    "dbs",
    multiple=True,
    help="Database URL to run on, repeatable (a PostgreSQL URL: a database is created "
    "per run on that server). Default: a temporary SQLite file.",
)
@click.option(
    "--baseline-src",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Source tree of the previous release (its slurmguard/ and sql/): "
    "run the same measurement on it as the baseline.",
)
@click.option(
    "--baseline-max-nodes",
    type=int,
    default=10000,
    show_default=True,
    help="Largest N the baseline runs at (it is slow at scale).",
)
@click.option("--steps", type=int, default=32, show_default=True, help="Iterations per rank per report.")
@click.option("--cycles", type=int, default=5, show_default=True)
@click.option(
    "--http/--no-http", default=True, show_default=True, help="Also measure ingestion over HTTP on loopback."
)
@click.option(
    "--http-reports",
    type=int,
    default=5000,
    show_default=True,
    help="Reports posted over HTTP (the fleet's nodes in turn, several rounds where it is smaller).",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="controller.workers of the HTTP server (connections its event loop reads at once).",
)
def bench_scale(
    sizes: str,
    dbs: tuple[str, ...],
    baseline_src: Path | None,
    baseline_max_nodes: int,
    steps: int,
    cycles: int,
    http: bool,
    http_reports: int,
    workers: int,
) -> None:
    """Control cycle p50/p99 (wall and CPU), ingestion, RSS and database size per N."""
    try:
        ns = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {sizes!r}", param_hint="--nodes"
        ) from None
    args = [
        "--steps",
        str(steps),
        "--cycles",
        str(cycles),
        "--http-reports",
        str(http_reports),
        "--workers",
        str(workers),
    ]
    if http:
        args.append("--http")
    head = (
        f"{'code':9} {'db':7} {'nodes':>6} {'ranks':>6} {'cycle p50':>9} {'p99':>7} "
        f"{'cpu p50':>7} {'cpu max':>7} {'in-proc/s':>9} {'http/s':>7} {'ms cpu':>6} {'gc ms':>5} "
        f"{'fleet MB':>8} {'RSS MB':>7} {'DB MB':>6} {'DB MB/h':>7} {'rows/h':>7}"
    )
    click.echo(
        f"slurmguard bench scale: {steps} steps/rank/report, {cycles} cycles, 8 GPUs/node, "
        f"{workers} HTTP workers"
    )
    click.echo(head)
    for db in dbs or (None,):
        for n in ns:
            runs: list[tuple[str, Path | None]] = [("current", None)]
            if baseline_src is not None and n <= baseline_max_nodes:
                runs.append(("baseline", baseline_src))
            for label, src in runs:
                url = _fresh_db(db, label) if db else None
                r = _run(src, n, url or db, args)
                if "error" in r:
                    click.echo(f"{label:9} {('pg' if db else 'sqlite'):7} {n:>6} error: {r['error']}")
                    continue
                click.echo(
                    f"{label:9} {r['db'][:7]:7} {n:>6} {r['ranks']:>6} {r['cycle_p50_s']:>8.3f}s "
                    f"{r['cycle_p99_s']:>6.3f}s {r['cycle_cpu_p50_s']:>6.3f}s "
                    f"{r.get('cycle_cpu_max_s', 0):>6.3f}s "
                    f"{r.get('ingest_inproc_per_s', 0):>9.0f} {r.get('http_reports_per_s', 0):>7.0f} "
                    f"{r.get('http_cpu_ms_per_report', 0):>6.2f} {r.get('http_gc_ms_per_report', 0):>5.2f} "
                    f"{r['rss_fleet_mb']:>8.0f} {r['rss_mb']:>7.0f} {r.get('db_mb', 0):>6.1f} "
                    f"{r.get('db_growth_mb_per_h', 0):>7.2f} {sum(r.get('db_rows_per_h', {}).values()):>7}"
                )
                if r.get("db_rows_per_h"):
                    rows = ", ".join(f"{t} {n}" for t, n in sorted(r["db_rows_per_h"].items()))
                    click.echo(f"{'':9} rows per hour by table: {rows}")
    click.echo(
        "cycle: wall time of Controller.cycle (p50 without the first); cpu: its CPU time "
        "(one core; max: the slowest cycle after the first, which registers the fleet); "
        "in-proc/s: reports ingested by FleetView per second; http/s: signed reports "
        "accepted per second through the HTTP server, posted from a second process (8 "
        "threads, bodies signed in advance, each thread's connection kept alive as long as "
        "the code under test keeps it) in the code's own wire format; ms cpu: the "
        "controller's CPU per report over HTTP (what a loaded machine changes least); gc ms: of which in "
        "Python's cyclic garbage collector; fleet MB: RSS growth from holding one report of "
        "every node; DB MB: the database's size after the run (SQLite: its pages in use, "
        "write-ahead log included); DB MB/h, rows/h: its growth per hour of the fleet "
        "reporting every 10 s (from the end of the first cycle, which registers the fleet, "
        "to the end of the last; it grows by whole pages, so MB/h is coarse over few cycles, "
        "rows are exact)."
    )
