"""`slurmguard bench loop`: detection delay of the online loop on the local cluster.

Runs the fail-slow scenario (slurmguard.devcluster.scenario) on a guarded
development cluster and measures, from the job's own iteration log, the time
and the iterations from the injection to the drain. The baseline, measured on
the same step-time series in the same run, is the delay of the detectors
alone (offline BOCD+verification and the sliding-window baseline): the
difference is what reporting, the control cycle and the ski-rental price add.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import click
import numpy as np


def _offline_delays(series: list[float], onset: int) -> tuple[int | None, int | None]:
    from slurmguard.config import Policy
    from slurmguard.detect.baselines import sliding_window_alarms
    from slurmguard.detect.bocd import detect_changepoints

    x = np.asarray(series[5:], dtype=np.float64)  # skip the first iterations (warm-up)
    k = onset - 5
    bocd = [c for c in detect_changepoints(x, Policy().detection.bocd)
            if c.direction == "slower" and c.detected_at >= k]
    sw = [a for a in sliding_window_alarms(x) if a.detected_at >= k]
    return (bocd[0].detected_at - k if bocd else None), (sw[0].detected_at - k if sw else None)


@click.command("loop")
@click.option("--runs", default=2, show_default=True, type=click.IntRange(1, 20))
@click.option("--factor", default=1.3, show_default=True, type=float)
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def bench_loop(runs: int, factor: float, state_dir: Path | None) -> None:
    """Injection-to-drain delay (seconds, iterations) vs. the detectors' own delay."""
    from slurmguard.devcluster import ClusterSpec, DevCluster
    from slurmguard.devcluster.guard import Guard
    from slurmguard.devcluster.scenario import Scenario

    base = state_dir or Path(tempfile.mkdtemp(prefix="sg-bench-loop-"))
    rows = []
    for i in range(runs):
        cluster = DevCluster(ClusterSpec(state_dir=base / f"run{i}", nodes=4))
        cluster.up()
        try:
            guard = Guard(cluster).start()
            res = Scenario(guard, say=lambda s: None).run(factor=factor, wait_completion=False)
            # the step series up to the drain, from the job's log
            bocd_d, sw_d = _offline_delays(res.step_series, res.inject_index)
            rows.append((res.detection_delay_s, res.iterations_to_drain, bocd_d, sw_d,
                         res.healthy_step_s, res.slow_step_s))
            click.echo(f"run {i + 1}: drained {res.slow_node} {res.detection_delay_s:.1f}s / "
                       f"{res.iterations_to_drain} iterations after injection "
                       f"(step {res.healthy_step_s * 1000:.0f} -> {res.slow_step_s * 1000:.0f} ms); "
                       f"offline BOCD+V {bocd_d} it, sliding window {sw_d} it")
        finally:
            cluster.down()
    secs = [r[0] for r in rows]
    its = [r[1] for r in rows]
    click.echo(f"\nonline loop, injection -> drain: median {statistics.median(secs):.1f}s, "
               f"{statistics.median(its):.0f} iterations ({runs} runs, slowdown x{factor:g}, "
               f"report/cycle interval 1s, drain price 0.3 GPU-s)")
    b = [r[2] for r in rows if r[2] is not None]
    s = [r[3] for r in rows if r[3] is not None]
    if b:
        click.echo(f"baseline, same series offline: BOCD+verification {statistics.median(b):.0f} iterations, "
                   f"sliding window {statistics.median(s) if s else float('nan'):.0f} iterations")
