"""`slurmguard bench loop`: detection delay of the online loop on the local cluster.

Runs real training jobs (slurmguard.workloads: ddp, fsdp, pp, tp, 2d) on one
guarded development cluster, slows one node of each from outside the job (a
cgroup CPU cap, slurmguard_dev.devcluster.fault) and measures, from the job's own
per-rank step log, the time and the iterations from the injection to the
drain. Per workload it also runs one healthy job and counts the actions
slurmguard took on it (false actions). The baseline, measured on the same
step-time series in the same run, is the delay of the detectors alone
(offline BOCD+verification and the sliding-window baseline): the difference is
what reporting, the control cycle and the ski-rental price add.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

#: iterations skipped at the start of a series before the offline detectors
#: see it (the job's warm-up; the agents skip their own warm-up the same way)
WARMUP_STEPS = 5
#: issue 12's targets: a severe fault (its steps at least SEVERE_FAULT times slower,
#: the issue's severe level, not the policy's tier) drained within
#: TARGET_ITERATIONS of its slowed steps + 2 report intervals + the time its
#: slowdown takes to pay the drain price; a moderate one within MODERATE_TARGET_S
SEVERE_FAULT = 2.0
TARGET_ITERATIONS = 3
MODERATE_TARGET_S = 60.0


def _dev_policy() -> tuple[float, float, float]:
    """(agent report interval s, control cycle s, drain price GPU-s) of the dev
    cluster's policy (slurmguard_dev.devcluster.guard.GUARD_DEFAULTS), which the
    benchmark's guard runs with."""
    from slurmguard_dev.devcluster.guard import GUARD_DEFAULTS

    return (
        GUARD_DEFAULTS["agent"]["report_interval_s"],
        GUARD_DEFAULTS["controller"]["cycle_interval_s"],
        GUARD_DEFAULTS["response"]["escalation"]["drain_checkpoint_gpu_s"],
    )


def target_s(healthy_s: float, slow_s: float, ranks: int) -> float:
    """The drain target of one run (s) at the dev cluster's policy
    (slurmguard_dev.devcluster.guard.GUARD_DEFAULTS): for a severe fault
    TARGET_ITERATIONS slowed steps + 2 agent report intervals + the drain price
    (response.escalation.drain_checkpoint_gpu_s) over the rent the slowdown pays
    a second (slurmguard.respond.escalation.rent_gpu_s per slowed step, one GPU
    a rank); MODERATE_TARGET_S below SEVERE_FAULT x; NaN without steps."""
    from slurmguard.respond.escalation import rent_gpu_s

    if not (slow_s > 0 and healthy_s > 0):
        return float("nan")  # no step measured under the fault
    if slow_s < SEVERE_FAULT * healthy_s:
        return MODERATE_TARGET_S
    report_s, _, price = _dev_policy()
    rent_per_s = rent_gpu_s(slow_s, healthy_s, ranks) / slow_s
    return TARGET_ITERATIONS * slow_s + 2 * report_s + price / rent_per_s


def _offline_delays(series: list[float], onset: int) -> tuple[int | None, int | None]:
    from slurmguard.config import Policy
    from slurmguard.detect.bocd import detect_changepoints
    from slurmguard_dev.bench.detect_baselines import sliding_window_alarms

    x = np.asarray(series[WARMUP_STEPS:], dtype=np.float64)
    k = onset - WARMUP_STEPS
    bocd = [
        c
        for c in detect_changepoints(x, Policy().detection.bocd)
        if c.direction == "slower" and c.detected_at >= k
    ]
    sw = [a for a in sliding_window_alarms(x) if a.detected_at >= k]
    return (bocd[0].detected_at - k if bocd else None), (sw[0].detected_at - k if sw else None)


def parse_fault(text: str) -> tuple[str, float]:
    """`cpu:PERCENT` (a fixed cap, % of one CPU) or `cpu:xFACTOR` (the cap that
    slows the job's steps about FACTOR times, calibrated per run)."""
    kind, _, val = text.partition(":")
    try:
        if kind == "cpu" and val.startswith("x"):
            f = float(val[1:])
            if f > 1:
                return "factor", f
        elif kind == "cpu":
            p = float(val)
            if p >= 1:
                return "percent", p
    except ValueError:
        pass
    raise click.BadParameter(
        f"{text!r}: use cpu:PERCENT (e.g. cpu:20, at least 1) or cpu:xFACTOR (e.g. cpu:x2.5, above 1)",
        param_hint="--fault",
    )


@dataclass
class Run:
    workload: str
    healthy_ms: float
    slow_ms: float
    cap: float
    delay_s: float | None
    delay_it: int | None
    bocd_it: int | None
    sw_it: int | None
    false_actions: int = 0  # slurmguard actions on the job before the fault
    target_s: float = float("nan")  # target_s() for this run's steps


def _one_fault_run(
    sc, mode: str, value: float, steps: int, baseline: int, timeout_s: float, save: Path | None, tag: str
) -> Run:
    from slurmguard_dev.devcluster import fault
    from slurmguard_dev.devcluster.scenario import LAYOUTS, ScenarioError

    job = sc.submit(steps, ckpt_every=0)
    try:
        warm = sc.wait_steps(job, baseline, timeout=240)
    except ScenarioError:
        warm = []
    before = _actions(sc)
    if len(warm) < baseline or before:
        # requeued (or worse) while still healthy: a false action, no fault run
        sc.cluster.run(["scancel", str(job)])
        return Run(sc.workload, 0.0, 0.0, 0.0, None, None, None, None, false_actions=max(1, before))
    node = sc.job_nodes(job)[-1]
    healthy = statistics.median(e["step_s"] for e in warm[10:])
    if mode == "factor":
        _, cap = sc.inject(node, value, job=job)
        t_inject = sc.capped_at[node]
    else:
        cap = value
        fault.apply_cpu_cap(sc.cluster, node, cap)
        t_inject = time.time()
    onset = sum(1 for e in sc.log(job) if e["t"] < t_inject)  # the steps before the (first) cap
    t_drain = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = sc.drain(node)
        if rec is not None:
            t_drain = sc.epoch(rec.at)
            break
        time.sleep(0.5)
    early = 0
    if t_drain is not None and t_drain < t_inject:
        # drained while the cap was being calibrated (sc.inject measures the
        # job's CPU use for seconds first): the job was still healthy, a false action
        early, t_drain = 1, None
    log = sc.log(job)
    end = t_drain if t_drain is not None else time.time()
    after = [e for e in log[onset:] if e["t"] <= end]
    series = [e["step_s"] for e in log[:onset]] + [e["step_s"] for e in after]
    slow = statistics.median(e["step_s"] for e in after[2:]) if len(after) > 2 else float("nan")
    bocd_it, sw_it = _offline_delays(series, onset)
    if save is not None:
        _save_series(
            save / f"{tag}.csv", sc.workload, series, onset, t_inject, cap, node, log[:onset] + after, t_drain
        )
    lay = LAYOUTS[sc.workload]
    sc.cluster.run(["scancel", str(job)])
    return Run(
        sc.workload,
        healthy * 1e3,
        slow * 1e3,
        cap,
        None if t_drain is None else t_drain - t_inject,
        None if t_drain is None else len(after),
        bocd_it,
        sw_it,
        false_actions=early,
        target_s=target_s(healthy, slow, lay.nodes * lay.tasks_per_node),
    )


def _actions(sc) -> int:
    from slurmguard.store import Store

    with Store.open(sc.guard.db_url) as store:
        return len(store.audit_entries())


def _healthy_run(sc, steps: int, save: Path | None, tag: str) -> tuple[int, float]:
    """A healthy job to completion, with one restart after a requeue that is not
    slurmguard's (skipped if the job has already been restarted); return
    (actions slurmguard took, median step ms)."""
    job = sc.submit(steps, ckpt_every=25)
    try:
        sc.wait(lambda: len(sc.log(job)) >= min(40, steps // 3), 300, f"job {job} to log 40 steps")
        if not sc.job_field(job, "Restarts") or int(sc.job_field(job, "Restarts")) == 0:
            sc.requeue(job)
        sc.cluster.wait_job(job, timeout=600)
    except Exception as exc:  # noqa: BLE001 - a stuck run is reported, the bench goes on
        click.echo(f"{sc.workload} healthy run: {exc}")
        sc.cluster.run(["scancel", str(job)])
    time.sleep(3)
    actions = _actions(sc)
    log = sc.log(job)
    if save is not None and log:
        _save_series(
            save / f"{tag}.csv", sc.workload, [e["step_s"] for e in log], None, None, None, None, log, None
        )
    return actions, (statistics.median(e["step_s"] for e in log) * 1e3 if log else float("nan"))


def _save_series(
    path: Path,
    workload: str,
    series: list[float],
    onset: int | None,
    t_inject: float | None,
    cap: float | None,
    node: str | None,
    entries: list[dict],
    t_drain: float | None,
) -> None:
    """One rank-0 step series in the step-file format (slurmguard.detect.stepfile),
    labelled with the injection: `# onset:` is the first step that ended after the
    cap went on (the rule scripts/record_steptimes.py labels with), so `bench detect
    --recorded DIR` and `detect steptimes` read it as it is."""
    from slurmguard.detect.stepfile import first_step_after, write_step_file

    restarts = [i for i in range(1, len(entries)) if entries[i]["restart"] != entries[i - 1]["restart"]]
    src = f"slurmguard bench loop, workloads {workload}, rank 0, guarded"
    if restarts:
        src += f"; restarted (requeue) before steps {', '.join(map(str, restarts))}"
    labels: dict[str, object] = {"kind": "healthy"}
    if onset is not None and t_inject is not None:
        at = first_step_after([e["t"] for e in entries], t_inject)
        if at < len(series):  # else cut before any step ended under the cap: nothing slow in it
            labels = {"kind": "shift", "onset": at}
        src += (
            f"; {node} CPU cap {cap or 0:.1f}% at t={t_inject:.2f}, "
            + (f"drained at t={t_drain:.2f}" if t_drain is not None else "not drained")
            + " (series cut there)"
        )
    labels["source"] = src
    write_step_file(path, series, labels)


def _fmt(xs: list[float | int | None], unit: str = "") -> str:
    got = [x for x in xs if x is not None]
    if not got:
        return "none"
    miss = len(xs) - len(got)
    med, worst = statistics.median(got), max(got)
    s = f"{med:.1f}/{worst:.1f}{unit}" if unit else f"{med:.0f}/{worst:.0f}"
    return s + (f" ({miss} missed)" if miss else "")


@click.command("loop")
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(["ddp", "fsdp", "pp", "tp", "2d", "all"]),
    default=("ddp",),
    show_default=True,
    help="Training job shape(s); repeat or say all.",
)
@click.option(
    "--fault",
    "fault_spec",
    default="cpu:x2.5",
    show_default=True,
    help="cpu:PERCENT caps the node at PERCENT of one CPU; cpu:xFACTOR calibrates the "
    "cap to slow the steps about FACTOR times.",
)
@click.option(
    "--runs", default=3, show_default=True, type=click.IntRange(1, 20), help="Faulted runs per workload."
)
@click.option(
    "--healthy/--no-healthy",
    default=True,
    show_default=True,
    help="Also one healthy run per workload (false actions).",
)
@click.option(
    "--timeout",
    "timeout_s",
    default=180.0,
    show_default=True,
    help="Seconds to wait for a drain before counting a run as missed.",
)
@click.option(
    "--save-series",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write each run's rank-0 step series here (step-file CSV, injection labelled; "
    "`bench detect --recorded DIR` scores them).",
)
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def bench_loop(
    workloads: tuple[str, ...],
    fault_spec: str,
    runs: int,
    healthy: bool,
    timeout_s: float,
    save_series: Path | None,
    state_dir: Path | None,
) -> None:
    """Injection-to-drain delay (seconds, iterations) vs. the detectors' own delay."""
    from slurmguard_dev.devcluster import ClusterSpec, DevCluster
    from slurmguard_dev.devcluster.guard import Guard
    from slurmguard_dev.devcluster.scenario import Scenario

    mode, value = parse_fault(fault_spec)
    shapes = ["ddp", "fsdp", "pp", "tp", "2d"] if "all" in workloads else list(dict.fromkeys(workloads))
    base = state_dir or Path(tempfile.mkdtemp(prefix="sg-bench-loop-"))
    cluster = DevCluster(ClusterSpec(state_dir=base, nodes=4))
    cluster.up()
    table = []
    try:
        guard = Guard(cluster).start()
        for wl in shapes:
            sc = Scenario(guard, say=lambda s: None, workload=wl)
            rows: list[Run] = []
            for i in range(runs):
                guard.reset()
                guard.configure()
                r = _one_fault_run(
                    sc,
                    mode,
                    value,
                    100000,
                    60,
                    timeout_s,
                    save_series,
                    f"{wl}-{fault_spec.replace(':', '')}-{i + 1}",
                )
                rows.append(r)
                if r.false_actions:
                    click.echo(
                        f"{wl} run {i + 1}: {r.false_actions} slurmguard action(s) on the job "
                        "while it was still healthy; no fault injected"
                    )
                    continue
                click.echo(
                    f"{wl} run {i + 1}: cap {r.cap:.0f}% step {r.healthy_ms:.0f} -> "
                    f"{r.slow_ms:.0f} ms; drain "
                    + (
                        f"{r.delay_s:.1f}s / {r.delay_it} iterations"
                        if r.delay_s is not None
                        else f"none within {timeout_s:g}s"
                    )
                    + f" (target {r.target_s:.1f}s)"
                    + f"; offline BOCD+V {r.bocd_it} it, sliding window {r.sw_it} it"
                )
            false = None
            if healthy:
                guard.reset()
                guard.configure()
                false, ms = _healthy_run(sc, 300, save_series, f"{wl}-healthy")
                click.echo(
                    f"{wl} healthy run (with a restart after requeue): {false} actions, step {ms:.0f} ms"
                )
            table.append((wl, rows, false))
    finally:
        cluster.down()
    report_s, cycle_s, price = _dev_policy()
    click.echo(
        f"\nonline loop, fault {fault_spec} on one node, {runs} runs per workload "
        f"(median/worst); report interval {report_s:g}s, control cycle {cycle_s:g}s, "
        f"drain price {price:g} GPU-s"
    )
    click.echo(
        f"{'workload':<9}  {'step ms':>7}  {'slowed':>8}  {'drain s':>12}  {'target s':>8}  {'met':>5}  "
        f"{'iterations':>12}  {'BOCD+V it':>16}  {'window it':>16}  {'false actions':>13}"
    )
    for wl, rows, false in table:
        faulted = [r for r in rows if not r.false_actions]
        pre = sum(r.false_actions for r in rows)
        step = statistics.median(r.healthy_ms for r in faulted) if faulted else float("nan")
        slowed = statistics.median(r.slow_ms / r.healthy_ms for r in faulted) if faulted else float("nan")
        false_cell = f"{(false or 0) + pre}" + ("" if false is not None else " (no healthy run)")
        # cells joined by two spaces: a "(1 missed)" note must not run into the next column
        cells = [
            f"{wl:<9}",
            f"{step:>7.0f}",
            f"{slowed:>7.2f}x",
            f"{_fmt([r.delay_s for r in faulted], 's'):>12}",
            f"{statistics.median(r.target_s for r in faulted) if faulted else float('nan'):>8.1f}",
            f"{f'{sum(r.delay_s is not None and r.delay_s <= r.target_s for r in faulted)}/{len(faulted)}':>5}",
            f"{_fmt([r.delay_it for r in faulted]):>12}",
            f"{_fmt([r.bocd_it for r in faulted]):>16}",
            f"{_fmt([r.sw_it for r in faulted]):>16}",
            f"{false_cell:>13}",
        ]
        click.echo("  ".join(cells))
    click.echo(
        "false actions: slurmguard actions on healthy jobs (the healthy run, and faulted "
        "runs before their fault)"
    )
    click.echo(
        f"target: a severe fault (steps >= {SEVERE_FAULT:g}x) drained within {TARGET_ITERATIONS} slowed "
        f"steps + 2 report intervals + the time its slowdown takes to pay the drain price; "
        f"a moderate one within {MODERATE_TARGET_S:g}s (met: runs drained within their target)"
    )
