"""Record labelled step-time series of the real workloads (issue 13.4).

Starts a private 4-node development cluster, runs `python -m slurmguard.workloads
SHAPE` jobs on 2 nodes (unguarded: nothing may act on the job while it is
recorded, so the series is what the job did, not what a restart did to it) and
writes rank 0's step times in the step-file format (slurmguard.detect.stepfile)
to tests/data/steptimes/<shape>-<case>.csv:

  healthy     a job to completion, with its checkpoints (every --ckpt-every steps)
  shift       after --before steps the node of the last rank is capped in a
              cgroup (slurmguard_dev.devcluster.fault) at the CPU share that makes its
              steps about --factor times slower; --after more steps
  transient   a milder cap (--mild) for --hold steps, then lifted; --after more

`# onset:` is the first step that ended after the cap was applied,
`# recovery:` the first step that began after it was lifted (both from the
job's own step log, stepfile.first_step_after).

Clean recordings only: this 2-core machine is shared, and a burst of someone
else's work slows every step for tens of steps, which is a real slowdown of the
job that no label would explain. A recording is kept only when each stretch the
labels call steady (before the onset after the warm-up, the fault itself, after
the recovery) is steady: the median of every STEADY_WINDOW-step window within
STEADY_BAND of the stretch's median (a plain median check, not the detector);
otherwise it is recorded again (--tries). The host's load average during the
recording goes into `# source:`.

    .venv/bin/python scripts/record_steptimes.py --workload ddp --workload tp
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

from slurmguard.detect.stepfile import first_step_after, write_step_file
from slurmguard_dev.devcluster import ClusterSpec, DevCluster, fault
from slurmguard_dev.devcluster.guard import Guard
from slurmguard_dev.devcluster.scenario import Scenario

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "steptimes"
WARMUP = 5
STEADY_WINDOW = 30
STEADY_BAND = 0.20


def unsteady(x: list[float], lo: int, hi: int) -> str | None:
    """Why x[lo:hi] is not one steady level (None when it is)."""
    seg = x[lo:hi]
    if len(seg) < STEADY_WINDOW:
        return None
    m = statistics.median(seg)
    for a in range(0, len(seg) - STEADY_WINDOW + 1, 5):
        w = statistics.median(seg[a : a + STEADY_WINDOW])
        if abs(w / m - 1.0) > STEADY_BAND:
            return (
                f"steps {lo + a}-{lo + a + STEADY_WINDOW} median {w:.3f}s vs {m:.3f}s "
                f"over {lo}-{hi}: outside load"
            )
    return None


def check(path: Path) -> str | None:
    from slurmguard.detect.stepfile import read_step_file

    x, labels, _ = read_step_file(path)
    cuts = [WARMUP] + [int(v) for k in ("onset", "recovery") for v in labels.get(k, [])] + [len(x)]
    cuts.sort()
    for lo, hi in zip(cuts, cuts[1:]):
        why = unsteady(x, lo + (3 if lo > WARMUP else 0), hi)
        if why:
            return why
    if "recovery" in labels:  # the fault lifted: the job must be back at its level before
        on, rec = int(labels["onset"][0]), int(labels["recovery"][0])
        before, after = statistics.median(x[WARMUP:on]), statistics.median(x[rec + 3 :])
        if abs(after / before - 1.0) > STEADY_BAND:
            return f"median {after:.3f}s after the recovery vs {before:.3f}s before the onset: outside load"
    return None


def _cap(sc: Scenario, node: str, factor: float) -> tuple[float, float]:
    """Calibrate and apply; (cap %, epoch s just before the cap went on)."""
    use = fault.step_cpu_use(sc.cluster, node, 3.0)
    cap = fault.cap_for_slowdown(use, factor)
    t = time.time()
    fault.apply_cpu_cap(sc.cluster, node, cap)
    return cap, t


def _steps(sc: Scenario, job: int, n: int, timeout: float) -> list[dict]:
    return sc.wait(
        lambda: (log := sc.log(job)) and len(log) >= n and log, timeout, f"job {job} to log {n} steps"
    )


def record(
    sc: Scenario,
    case: str,
    *,
    steps: int,
    before: int,
    after: int,
    hold: int,
    factor: float,
    mild: float,
    ckpt_every: int,
    out: Path,
) -> Path:
    wl = sc.workload
    src = f"slurmguard workloads {wl}, 2 nodes, rank 0 step times"
    if case == "healthy":
        job = sc.submit(steps, guarded=False, signal=False, ckpt_every=ckpt_every)
        sc.cluster.wait_job(job, timeout=900)
        log = sc.log(job)
        return write_step_file(
            out / f"{wl}-healthy.csv",
            [e["step_s"] for e in log],
            {
                "kind": "healthy",
                "textures": "checkpoints",
                "source": f"{src}, healthy, checkpoint every {ckpt_every} steps",
            },
        )
    job = sc.submit(100000, guarded=False, signal=False, ckpt_every=ckpt_every)
    node = None
    try:
        _steps(sc, job, before, 600)
        node = sc.job_nodes(job)[-1]
        cap, t_on = _cap(sc, node, factor if case == "shift" else mild)
        n_on = len(sc.log(job))
        t_off, lift_s = None, 0.0
        if case == "transient":
            _steps(sc, job, n_on + hold, 900)
            t_off = time.time()
            sc.clear(node)
            lift_s = time.time() - t_off
        log = _steps(sc, job, len(sc.log(job)) + after, 900)
    finally:
        sc.cluster.run(["scancel", str(job)])
        if node is not None:
            fault.clear_fault(sc.cluster, node)
    ends = [e["t"] for e in log]
    labels: dict[str, object] = {
        "kind": case,
        "onset": first_step_after(ends, t_on),
        "textures": "checkpoints",
    }
    what = f"{node} CPU cap {cap:.1f}% (x{factor if case == 'shift' else mild:g} calibrated)"
    if t_off is not None:
        starts = [e["t"] - e["step_s"] for e in log]
        labels["recovery"] = first_step_after(starts, t_off)
        what += f", lifted after {hold} steps (moving the processes out took {lift_s:.1f}s)"
    labels["source"] = f"{src}, {what}"
    return write_step_file(out / f"{wl}-{case}.csv", [e["step_s"] for e in log], labels)


def _with_load(text: str, load: str) -> str:
    return "\n".join(
        line + f"; {load}" if line.startswith("# source:") else line for line in text.split("\n")
    )


@click.command()
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    default=("ddp", "fsdp", "pp", "tp"),
    type=click.Choice(["ddp", "fsdp", "pp", "tp"]),
)
@click.option(
    "--case",
    "cases",
    multiple=True,
    default=("healthy", "shift", "transient"),
    type=click.Choice(["healthy", "shift", "transient"]),
)
@click.option("--steps", default=160, show_default=True, help="Steps of the healthy job.")
@click.option("--before", default=80, show_default=True, help="Healthy steps before a cap.")
@click.option("--after", default=60, show_default=True, help="Steps recorded after the cap (or its lifting).")
@click.option("--hold", default=50, show_default=True, help="Steps the transient cap stays on.")
@click.option("--factor", default=2.5, show_default=True, help="Slowdown the shift cap aims at.")
@click.option("--mild", default=1.4, show_default=True, help="Slowdown the transient cap aims at.")
@click.option("--ckpt-every", default=40, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=OUT, show_default=True)
@click.option("--tries", default=3, show_default=True, help="Recordings per case until one is steady.")
def main(workloads, cases, steps, before, after, hold, factor, mild, ckpt_every, out, tries) -> None:
    cluster = DevCluster(ClusterSpec(state_dir=Path(tempfile.mkdtemp(prefix="sg-record-")), nodes=4))
    cluster.up()
    try:
        guard = Guard(cluster)
        for wl in workloads:
            sc = Scenario(guard, say=lambda s: None, workload=wl)
            for case in cases:
                for attempt in range(1, tries + 1):
                    t0 = time.monotonic()
                    load0 = os.getloadavg()[0]
                    try:
                        p = record(
                            sc,
                            case,
                            steps=steps,
                            before=before,
                            after=after,
                            hold=hold,
                            factor=factor,
                            mild=mild,
                            ckpt_every=ckpt_every,
                            out=out,
                        )
                    except Exception as exc:  # noqa: BLE001 - one failed recording, go on with the rest
                        click.echo(f"{wl} {case}: FAILED {exc}", err=True)
                        continue
                    load = f"host load average {load0:.1f} -> {os.getloadavg()[0]:.1f}"
                    p.write_text(_with_load(p.read_text(), load))
                    why = check(p)
                    click.echo(
                        f"{wl} {case} try {attempt}: {p} ({time.monotonic() - t0:.0f}s, {load})"
                        + (f" UNSTEADY: {why}" if why else "")
                    )
                    sys.stdout.flush()
                    if why is None:
                        break
                    p.rename(p.with_suffix(f".unsteady{attempt}"))
    finally:
        cluster.down()


if __name__ == "__main__":
    main()
