"""`slurmguard bench detect`: detector accuracy, delay and throughput, with baselines.

One run prints:
1. on a labelled suite of step series with the texture of real jobs (step
   patterns, checkpoints, outliers, heavy tails, warm-up, hiccups; see
   slurmguard_dev.bench.detect_scenarios), for the step detector (slurmguard.detect.steps,
   what the agent and the controller run) and, from the same run, the
   sliding-window and plain-BOCD baselines and the previous BOCD + 10%-check:
   FPR, FNR (slowdowns >= 10% lasting >= 30 steps), detection delay
   (detected_at - onset: median, p90), location error, hiccups closed,
   recoveries found, false recoveries; then the detector per texture, and the
   same figures on a second seed family (robustness, not tuning);
2. recorded series (`--recorded DIR`, files labelled with the injection step),
   scored the same way;
3. ACF iteration-time error on synthetic hybrid-parallel jobs (Greyhound Fig. 13);
4. throughput in samples/s of the step detector on the suite, of the batched
   BOCD kernel on 10,000 series, and of a straightforward float64 numpy BOCD
   with 500 run lengths measured in the same run.
"""

from __future__ import annotations

import os
import time

import click
import numpy as np
from scipy.special import gammaln

from slurmguard.config import BocdPolicy, load_policy
from slurmguard.datafiles import checkout_root
from slurmguard.detect.bocd import ALPHA0, KAPPA0, BatchBocd
from slurmguard.detect.period import step_times
from slurmguard.detect.steps import DetectorConfig, StepDetector
from slurmguard_dev.bench.detect_baselines import Alarm, Report, Score, score, sliding_window
from slurmguard_dev.bench.detect_scenarios import (
    TEXTURES,
    LabelledSeries,
    load_recorded_dir,
    make_intermittent_suite,
    make_suite,
)
from slurmguard_dev.bench.detect_synth import JobSpec, make_job


def _matrix(suite: list[LabelledSeries]) -> np.ndarray:
    """Series as rows, NaN-padded to the longest (a NaN is "no sample")."""
    T = max(s.x.size for s in suite)
    x = np.full((len(suite), T), np.nan)
    for i, s in enumerate(suite):
        x[i, : s.x.size] = s.x
    return x


def run_detector(suite: list[LabelledSeries], cfg: DetectorConfig) -> tuple[list[Report], float]:
    """The step detector on every series; its reports and samples/s (CPU)."""
    x = _matrix(suite)
    det = StepDetector(len(suite), cfg)
    t0 = time.process_time()
    cps = det.run(x)
    dt = time.process_time() - t0
    reps = [Report() for _ in suite]
    for c in cps:
        if c.direction == "slower":
            reps[c.series].slower.append(Alarm(c.index, c.detected_at))
    for i, r in enumerate(reps):
        eps = det.episodes(i)
        r.faster = [
            Alarm(e.recovery, e.recovered_at)
            for e in eps
            if e.recovery is not None and e.recovered_at is not None
        ]
        r.open_at_end = any(e.open for e in eps)
    return reps, int(np.isfinite(x).sum()) / max(dt, 1e-9)


def run_bocd(suite: list[LabelledSeries], policy: BocdPolicy, **kw) -> list[Report]:
    """BatchBocd on every series: verify=False is plain BOCD (every MAP drop)."""
    x = _matrix(suite)
    det = BatchBocd(len(suite), policy, **kw)
    reps = [Report() for _ in suite]
    for c in det.run(x):
        (reps[c.series].slower if c.direction == "slower" else reps[c.series].faster).append(
            Alarm(c.index, c.detected_at)
        )
    return reps


def naive_bocd_throughput(n_series: int, steps: int, R: int = 500, seed: int = 0) -> float:
    """Samples/s of a textbook numpy BOCD: float64, R run lengths, Student-t
    predictive recomputed with gammaln, fresh arrays every step."""
    rng = np.random.default_rng(seed)
    x = np.log(rng.normal(1.0, 0.02, (n_series, steps)))
    H = 0.004
    beta0 = ALPHA0 * 0.03**2
    P = np.zeros((n_series, R))
    P[:, 0] = 1.0
    mu = np.zeros((n_series, R))
    mu[:] = x[:, :1]
    kappa = np.full((n_series, R), KAPPA0)
    alpha = np.full((n_series, R), ALPHA0)
    beta = np.full((n_series, R), beta0)
    t0 = time.process_time()
    for t in range(steps):
        xt = x[:, t : t + 1]
        nu = 2 * alpha
        scale2 = beta * (kappa + 1) / (alpha * kappa)
        logpred = (
            gammaln((nu + 1) / 2)
            - gammaln(nu / 2)
            - 0.5 * np.log(nu * np.pi * scale2)
            - (nu + 1) / 2 * np.log1p((xt - mu) ** 2 / (nu * scale2))
        )
        pred = np.exp(logpred)
        growth = P * pred * (1 - H)
        cp = (P * pred * H).sum(axis=1, keepdims=True)
        newP = np.concatenate([cp, growth[:, :-1]], axis=1)
        newP /= newP.sum(axis=1, keepdims=True)
        mu_new = (kappa * mu + xt) / (kappa + 1)
        beta_new = beta + kappa * (xt - mu) ** 2 / (2 * (kappa + 1))
        mu = np.concatenate([xt, mu_new[:, :-1]], axis=1)
        kappa = np.concatenate([np.full((n_series, 1), KAPPA0), kappa[:, :-1] + 1], axis=1)
        alpha = np.concatenate([np.full((n_series, 1), ALPHA0), alpha[:, :-1] + 0.5], axis=1)
        beta = np.concatenate([np.full((n_series, 1), beta0), beta_new[:, :-1]], axis=1)
        P = newP
    return n_series * steps / (time.process_time() - t0)


def batch_throughput(n_series: int, steps: int, policy: BocdPolicy, seed: int = 0) -> tuple[float, int]:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.2, 8.0, (n_series, 1))
    x = base * (1.0 + rng.normal(0.0, 0.02, (n_series, steps)))
    # a tenth of the series slow down by 30% halfway, so verification and
    # resets are part of the measured cost
    x[: n_series // 10, steps // 2 :] *= 1.3
    det = BatchBocd(n_series, policy)
    det.update(x[:, 0])  # allocate / warm caches outside the timing
    t0 = time.process_time()
    found = 0
    for t in range(1, steps):
        found += len(det.update(x[:, t]))
    return n_series * (steps - 1) / (time.process_time() - t0), found


def _f(v: float, pct: bool = False) -> str:
    if v != v:  # NaN
        return "-"
    return f"{v * 100:.1f}" if pct else f"{v:.0f}"


HEADER = (
    f"{'':<38} {'FPR %':>14} {'FNR %':>14} {'delay med/p90':>13} {'loc med/p90':>11} "
    f"{'hiccups closed':>14} {'recoveries':>10} {'false rec.':>10}"
)


def _row(name: str, s: Score) -> str:
    rec = f"{s.recoveries_found}/{s.recoveries}" if s.recoveries else "-"
    hic = f"{s.hiccups_closed}/{s.hiccups}" if s.hiccups else "-"
    return (
        f"{name:<38} {_f(s.fpr, True):>5} ({s.false_pos:>3}/{s.negatives:<4}) "
        f"{_f(s.fnr, True):>5} ({s.false_neg:>3}/{s.positives:<4}) "
        f"{_f(s.median_delay):>6}/{_f(s.p90_delay):<6} {_f(s.median_loc):>5}/{_f(s.p90_loc):<5} "
        f"{hic:>14} {rec:>10} {s.false_recoveries:>10}"
    )


def _table(
    suite: list[LabelledSeries], cfg: DetectorConfig, bp: BocdPolicy, title: str
) -> tuple[Score, list[Report], float]:
    click.echo(title)
    click.echo(HEADER)
    click.echo("-" * len(HEADER))
    sw = [sliding_window(s.x, bp.verify_window, bp.verify_min_change) for s in suite]
    click.echo(_row("SlidingWindow (median, 10%)", score("sw", suite, sw)))
    click.echo(
        _row(
            "plain BOCD (MAP drop, no verification)", score("plain", suite, run_bocd(suite, bp, verify=False))
        )
    )
    click.echo(_row("BOCD + fixed 10% median check", score("old", suite, run_bocd(suite, bp))))
    reps, sps = run_detector(suite, cfg)
    s = score("det", suite, reps)
    click.echo(_row("step detector (profile+BOCD+verif.)", s) + "   <- agent/controller/CLI")
    return s, reps, sps


#: iterations an intermittent slowdown may take to be reported: it is judged over
#: 4 verify windows (slurmguard.detect.steps.TEXTURE_PARTS), and its slowed
#: iterations are a share of them
INTERMITTENT_DELAY = 60


def _intermittent(suite: list[LabelledSeries], cfg: DetectorConfig, bp: BocdPolicy, seed: int) -> None:
    """The intermittent suite: the table (FNR within INTERMITTENT_DELAY), then
    what the loop needs of it: the lasting ones still open at the end, and the
    slowdowns reported per slowed series (1: one episode; more: it flapped)."""
    faulty = [s for s in suite if s.onsets]
    click.echo(
        f"intermittent slowdowns (seed {seed}, {len(faulty)} slowed of {len(suite)}): from the onset "
        f"15-70% of the iterations 1.3-5x (under half: the median unmoved); positives: mean cost >= 10%, "
        f"found within {INTERMITTENT_DELAY} iterations"
    )
    click.echo(HEADER)
    click.echo("-" * len(HEADER))
    sw = [sliding_window(s.x, bp.verify_window, bp.verify_min_change) for s in suite]
    click.echo(_row("SlidingWindow (median, 10%)", score("sw", suite, sw, INTERMITTENT_DELAY)))
    click.echo(
        _row("BOCD + fixed 10% median check", score("old", suite, run_bocd(suite, bp), INTERMITTENT_DELAY))
    )
    reps, _ = run_detector(suite, cfg)
    s = score("det", suite, reps, INTERMITTENT_DELAY)
    click.echo(_row("step detector (profile+BOCD+verif.)", s) + "   <- agent/controller/CLI")
    lasting = [i for i, sc in enumerate(suite) if sc.positives and not sc.recoveries]
    alarms = [len(reps[i].slower) for i, sc in enumerate(suite) if sc.positives]
    click.echo(
        f"  lasting ones open at the end: {sum(reps[i].is_open() for i in lasting)}/{len(lasting)}; "
        f"slowdowns reported per slowed series: median {np.median(alarms) if alarms else float('nan'):.0f}, "
        f"max {max(alarms, default=0)}"
    )


#: real step series of the workloads on the dev cluster (scripts/record_steptimes.py)
RECORDED = checkout_root() / "tests" / "data" / "steptimes"


def _recorded(rec: list[LabelledSeries], cfg: DetectorConfig, bp: BocdPolicy, where: str) -> None:
    """The recorded series: the table with its baselines, then the detector per
    class (what the labels say was done: healthy, shift, transient) and per series."""
    _, reps, _ = _table(rec, cfg, bp, f"recorded series ({len(rec)} files in {where})")
    click.echo("step detector per class of recorded series:")
    for kind in dict.fromkeys(sc.kind for sc in rec):
        idx = [i for i, sc in enumerate(rec) if sc.kind == kind]
        click.echo(_row(f"  {kind} ({len(idx)})", score(kind, [rec[i] for i in idx], [reps[i] for i in idx])))
    for sc, r in zip(rec, reps):
        name = os.path.basename(sc.notes.get("file", "?"))
        click.echo(
            f"  {name:<22} {sc.kind:<9} onset {','.join(map(str, sc.onsets)) or '-':>4} "
            f"recovery {','.join(map(str, sc.recoveries)) or '-':>4} "
            f"severity {sc.severity:+.0%}: slower at "
            + (", ".join(f"{a.index} (known at {a.detected_at})" for a in r.slower) or "-")
            + "; recovered at "
            + (", ".join(str(a.index) for a in r.faster) or "-")
        )


@click.command("detect")
@click.option("--scenarios", default=1000, show_default=True, help="Labelled scenarios per suite.")
@click.option("--length", default=400, show_default=True, help="Iterations per scenario.")
@click.option("--series", default=10000, show_default=True, help="Series in the throughput batch.")
@click.option("--steps", default=100, show_default=True, help="Samples per series in the throughput run.")
@click.option(
    "--seed", default=0, show_default=True, help="Seed of the main suite; the second family uses seed + 1000."
)
@click.option(
    "--recorded",
    "recorded",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Directory of recorded step series labelled with the injection step (see "
    "scenarios.load_recorded); default: the checkout's tests/data/steptimes.",
)
@click.pass_context
def bench_detect(
    ctx: click.Context, scenarios: int, length: int, series: int, steps: int, seed: int, recorded: str | None
) -> None:
    """Detector FPR/FNR/delay/location on textured step series vs. baselines, samples/s."""
    obj = ctx.find_root().obj or {}
    pol = load_policy(obj.get("policy_path"))
    policy = pol.detection
    bp = policy.bocd
    cfg = DetectorConfig.from_policy(pol)
    suite = make_suite(scenarios, length, seed)
    kinds = {k: sum(s.kind == k for s in suite) for k in dict.fromkeys(s.kind for s in suite)}
    click.echo(
        f"scenario suite: {len(suite)} series x {length} iterations, seed {seed}: "
        + ", ".join(f"{k} {v}" for k, v in kinds.items())
    )
    click.echo(
        "base step 0.05-5 s, noise 0.5-4% (30% heavy-tailed), periods 2-8, checkpoints 2.5-4x every "
        "20-200, outliers 0-5%, warm-up, shifts 5-100%, hiccups 1-8 steps"
    )
    click.echo(
        "FPR: healthy/speed-up/hiccup series with a slowdown reported (hiccups: outside the excursion "
        "or left open); FNR: onsets of slowdowns >= 10% lasting >= 30 steps not reported within 20; "
        "delay = detected_at - onset; loc = |located onset - onset|"
    )
    click.echo("")
    s, reps, sps = _table(suite, cfg, bp, f"all textures (seed {seed})")
    click.echo(
        f"  small shifts (5-9%, below the bar) reported: {s.small_found}/{s.small}; "
        f"slowdown alarms before the onset in faulty series: {s.spurious}"
    )
    r0 = BatchBocd(len(suite), bp, verify=False, rule="r0")
    r0.run(_matrix(suite))
    click.echo(
        f"  the papers' literal rule P(r_t = 0 | x) > {bp.change_probability}: largest value over the "
        f"suite {r0.max_r0:.6f} = hazard H ({bp.hazard}), so it never fires; the detector uses the "
        f"MAP run-length drop (detection.bocd.rule)"
    )
    click.echo("")
    click.echo("step detector per texture (a series counts under every texture it carries):")
    click.echo(HEADER)
    click.echo("-" * len(HEADER))
    for tex in ("plain",) + TEXTURES:
        idx = [i for i, sc in enumerate(suite) if (tex in sc.textures if tex != "plain" else not sc.textures)]
        if idx:
            click.echo(
                _row(f"  {tex} ({len(idx)})", score(tex, [suite[i] for i in idx], [reps[i] for i in idx]))
            )
    for kind in ("shift", "transient", "compound"):
        idx = [i for i, sc in enumerate(suite) if sc.kind == kind]
        if idx:
            click.echo(
                _row(
                    f"  kind {kind} ({len(idx)})",
                    score(kind, [suite[i] for i in idx], [reps[i] for i in idx]),
                )
            )
    idx = [
        i
        for i, sc in enumerate(suite)
        if sc.kind in ("shift", "transient", "compound") and 0.10 <= sc.severity < 0.15
    ]
    if idx:
        click.echo(
            _row(
                f"  moderate shifts 10-15% ({len(idx)})",
                score("mod", [suite[i] for i in idx], [reps[i] for i in idx]),
            )
        )
    click.echo("")
    seed2 = seed + 1000
    _table(make_suite(scenarios, length, seed2), cfg, bp, f"second seed family (seed {seed2})")
    click.echo("")
    _intermittent(make_intermittent_suite(scenarios, length, seed + 2000), cfg, bp, seed + 2000)
    if recorded is None and RECORDED.is_dir():
        recorded = str(RECORDED)
    if recorded:
        rec = load_recorded_dir(recorded)
        click.echo("")
        if rec:
            _recorded(rec, cfg, bp, recorded)
        else:
            click.echo(f"recorded series: no *.csv files in {recorded}")
    click.echo("")
    # iteration time from the ACF period (Greyhound Fig. 13)
    errs, per_it = [], []
    for i, (nodes, gpn, tp) in enumerate([(1, 4, 2), (1, 4, 4), (2, 4, 2), (4, 2, 2), (2, 8, 4)]):
        tr = make_job(
            JobSpec(
                nodes=nodes,
                gpus_per_node=gpn,
                tp=tp,
                iterations=80,
                seed=seed + i,
                step_s=0.3 + 0.4 * i,
                jitter=0.03,
            )
        )
        st = step_times(tr.ops[-1], policy.period)
        truth = tr.iteration_s[-st.seconds.size :] if st is not None else np.empty(0)
        if st is None or truth.size != st.seconds.size:
            errs.append(float("inf"))
            per_it.append(float("inf"))
            continue
        errs.append(abs(st.mean - truth.mean()) / truth.mean())
        per_it.append(float(np.median(np.abs(st.seconds - truth) / truth)))
    click.echo(
        "iteration time from the ACF period on 5 job layouts (nodes x GPUs x TP), 3% jitter: "
        "error of the mean "
        + ", ".join(f"{e:.2%}" for e in errs)
        + "; median per-iteration error "
        + ", ".join(f"{e:.2%}" for e in per_it)
        + "  (target ~1%, Greyhound Fig. 13)"
    )
    click.echo("")
    # throughput
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    thr, found = batch_throughput(series, steps, bp, seed)
    base_n = 1000
    base_steps = 20
    thr_naive = naive_bocd_throughput(base_n, base_steps)
    click.echo("throughput (CPU seconds of this process, one thread):")
    click.echo(f"step detector (all of it, {len(suite):,} series of the suite at once): {sps:,.0f} samples/s")
    click.echo(
        f"batched BOCD kernel (float32, R={bp.max_run_length}, in place): {thr:,.0f} samples/s on "
        f"{series:,} series x {steps} samples ({found} changes)"
    )
    click.echo(
        f"baseline, straightforward numpy BOCD (float64, R=500): {thr_naive:,.0f} samples/s on "
        f"{base_n:,} series x {base_steps} samples   speed-up x{thr / thr_naive:.0f}"
    )
