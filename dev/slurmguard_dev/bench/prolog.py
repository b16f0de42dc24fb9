"""`slurmguard bench prolog`: prolog wall time, the hung-NVML bound, epilog archive time.

Figures, each with a baseline measured in the same run:
  * the prolog as slurmd starts it (the sh wrapper, no PATH, every check
    enabled, this machine's NVML and /sys/class/infiniband), median and max
    over --runs; baseline: the same interpreter doing nothing (`python -c pass`);
  * the prolog with NVML hung in nvmlInit: time until it answers, against
    the configured budget (the bound that keeps a broken GPU node from
    stalling job starts);
  * the epilog archiving --rings default-size rings (4 MiB each); baseline:
    shutil.copyfile of the same files.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from slurmguard import datafiles
from slurmguard.config import parse_policy

WRAPPER = datafiles.prolog_epilog_dir() / "slurmguard-prolog"
DEFAULT_CAPACITY = 65536  # SG_RING_DEFAULT_CAPACITY


def _time(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, check=False, capture_output=True, text=True, timeout=120, cwd="/")
    return time.perf_counter() - t0, res.returncode, res.stderr


def _ring(node: str, job: int, rank: int, capacity: int) -> bytes:
    import struct

    h = bytearray(4096)
    h[0:8] = b"SGRING01"
    struct.pack_into("<IIIIIIiii", h, 8, 1, 4096, 64, capacity, job, 0, rank, rank, 8)
    h[72 : 72 + len(node)] = node.encode()
    return bytes(h) + bytes(capacity * 64)


@click.command("prolog")
@click.option("--runs", default=5, show_default=True, help="Prolog runs to time.")
@click.option("--rings", default=8, show_default=True, help="Rings archived by the epilog figure.")
@click.option(
    "--hang-budget", default=2.0, show_default=True, help="prolog.timeout_s for the hung-NVML figure (s)."
)
@click.option(
    "--flood",
    default=100000,
    show_default=True,
    help="Empty files a job leaves in its ring dir for the flooded-epilog figure (0: skip).",
)
def bench_prolog(runs: int, rings: int, hang_budget: float, flood: int) -> None:
    """Prolog wall time and bounds, epilog archive time."""
    with tempfile.TemporaryDirectory(prefix="sg-bench-prolog-") as tmp:
        tmpd = Path(tmp)
        policy = tmpd / "policy.yaml"
        policy.write_text("prolog:\n  expected_gpus: 0\n")
        env = {
            "SLURMD_NODENAME": "bench",
            "SLURMGUARD_POLICY": str(policy),
            "SLURMGUARD_PYTHON": sys.executable,
            "SLURMGUARD_ENV_FILE": "/nonexistent",
        }
        argv = [str(WRAPPER)] if WRAPPER.is_file() else [sys.executable, "-m", "slurmguard.nodecheck.prolog"]
        walls, base = [], []
        code, err = 0, ""
        for _ in range(runs):
            w, code, err = _time(argv, env)
            walls.append(w)
            base.append(_time([sys.executable, "-c", "pass"], env)[0])
        click.echo(
            f"prolog (wrapper, all checks, exit {code}): median {statistics.median(walls):.3f} s, "
            f"max {max(walls):.3f} s over {runs} runs (limit: well under 10 s)"
        )
        click.echo(f"  baseline: interpreter start `python -c pass`: median {statistics.median(base):.3f} s")
        if err:
            click.echo("  stderr: " + err.strip().replace("\n", " | "))

        from slurmguard.nodecheck.prolog import run_prolog
        from slurmguard.telemetry.fake_nvml import FakeNvml

        fixture = datafiles.checkout_root() / "tests" / "fixtures" / "telemetry" / "nvml_h100x8.json"
        if fixture.is_file():
            nv = FakeNvml.from_fixture(fixture, hang={"nvmlInit"})
            pol = parse_policy(
                f"prolog:\n  expected_gpus: 8\n  timeout_s: {hang_budget}\n"
                f"  check_timeout_s: {hang_budget}\n  ib_sysfs_root: {tmpd / 'no-ib'}\n"
            )
            out = io.StringIO()
            t0 = time.perf_counter()
            code = run_prolog(pol, "bench", {}, err=out, loader=lambda: nv)
            took = time.perf_counter() - t0
            nv.release()
            click.echo(
                f"prolog with NVML hung in nvmlInit: exit {code} after {took:.3f} s "
                f"(baseline: budget prolog.timeout_s = {hang_budget:g} s)"
            )

        from slurmguard.config import PrologPolicy
        from slurmguard.nodecheck.archive import archive_job

        root = tmpd / "shm"
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
        src = tmpd / "src"
        src.mkdir()
        for r in range(rings):
            (src / f"rank-{r}.ring").write_bytes(_ring("bench", 1, r, DEFAULT_CAPACITY))
        total = sum(p.stat().st_size for p in src.iterdir())
        t0 = time.perf_counter()
        for p in src.iterdir():
            shutil.copyfile(p, tmpd / f"copy-{p.name}")
        copy_s = time.perf_counter() - t0
        shutil.copytree(src, root / "1")
        t0 = time.perf_counter()
        res = archive_job(
            1, "bench", ring_root=root, policy=PrologPolicy(trace_store=str(tmpd / "traces"), min_free_mb=0)
        )
        arch_s = time.perf_counter() - t0
        click.echo(
            f"epilog archive: {len(res.files)} rings, {total / 2**20:.1f} MiB in {arch_s * 1000:.1f} ms "
            f"(dir removed: {res.ring_dir_removed}); baseline shutil.copyfile: {copy_s * 1000:.1f} ms"
        )
        if flood:

            def fill(d: Path) -> None:
                d.mkdir()
                for i in range(flood):
                    os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600))

            fill(root / "2")
            t0 = time.perf_counter()
            res = archive_job(
                2,
                "bench",
                ring_root=root,
                policy=PrologPolicy(trace_store=str(tmpd / "traces"), min_free_mb=0),
            )
            flood_s = time.perf_counter() - t0
            fill(tmpd / "rm")
            t0 = time.perf_counter()
            shutil.rmtree(tmpd / "rm")
            rm_s = time.perf_counter() - t0
            click.echo(
                f"epilog on a ring dir of {flood} empty files: {flood_s:.2f} s ({res.unread} removed "
                f"unread, in the background); baseline shutil.rmtree of the same: {rm_s:.2f} s"
            )
