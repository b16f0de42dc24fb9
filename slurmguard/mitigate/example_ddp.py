"""Worked example: weighted micro-batch redistribution in a torch DDP job.

One run, three regimes, same model and data stream:

- healthy: every rank runs M / W micro-batches per step;
- slowed: one rank is made ``slow_factor`` times slower (it sleeps
  ``(slow_factor - 1) x`` its own measured compute time before each
  micro-batch, like a throttled GPU), still the uniform split;
- mitigated: the same slowdown, but each rank runs the count planned by the
  exact planner from the seconds per micro-batch profiled on the slowed job
  (or a plan fetched from a controller with ``--controller-url``). Every
  micro-batch's loss carries ``dp_size / M`` (weighted aggregation), so DDP's
  gradient average equals the uniform split's; the example checks this on one
  global batch and reports the largest gradient difference.

After warm-up and profiling, the three regimes are measured interleaved (one
step of each per round, rotating order) so that background load on a shared
machine does not favour one of them.

The step time of a step is the slowest rank's (all ranks meet in the gradient
all-reduce). Run locally with gloo on 127.0.0.1::

    python -m slurmguard.mitigate.example_ddp --world-size 2
    torchrun --nproc-per-node 2 -m slurmguard.mitigate.example_ddp
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurmguard.errors import InputError
from slurmguard.mitigate.microbatch import plan_microbatches
from slurmguard.mitigate.plan import JobPlan, rank_share

if TYPE_CHECKING:
    import torch  # imported by the worker only: the CLI stays light


@dataclass(frozen=True)
class ExampleConfig:
    """Sizes: ``microbatches`` per global batch (M), ``batch`` samples per
    micro-batch; ``steps`` measured steps per regime, after ``warmup`` steps;
    ``profile_steps`` slowed steps whose per-micro-batch times feed the
    planner. ``slow_factor``: how many times slower the slowed rank is."""

    world_size: int = 2
    slow_rank: int = 1
    slow_factor: float = 3.0
    microbatches: int = 16
    batch: int = 64
    width: int = 512
    steps: int = 10
    warmup: int = 3
    profile_steps: int = 5
    seed: int = 0
    controller_url: str | None = None
    job_id: str | None = None
    timeout_s: float = 120.0

    def check(self) -> None:
        if self.world_size < 2:
            raise InputError("example: --world-size must be >= 2 (one rank is slowed, one is not)")
        if not 0 <= self.slow_rank < self.world_size:
            raise InputError(f"example: --slow-rank {self.slow_rank} outside 0..{self.world_size - 1}")
        if self.slow_factor < 1:
            raise InputError("example: --slow-factor must be >= 1")
        if self.microbatches < 2 * self.world_size:
            raise InputError("example: --microbatches must give every rank at least two micro-batches")
        if self.steps < 1 or self.warmup < 0 or self.profile_steps < 1 or self.batch < 1 or self.width < 8:
            raise InputError(
                "example: needs --steps >= 1, --warmup >= 0, --profile-steps >= 1, --batch >= 1, --width >= 8"
            )


@dataclass
class ExampleResult:
    """Median step times (s) per phase and what the planner was given/returned."""

    healthy_step_s: float
    slowed_step_s: float
    mitigated_step_s: float
    per_microbatch_s: list[float]
    plan: list[int]
    planned_makespan_s: float
    plan_source: str
    grad_max_abs_diff: float
    grad_max_abs: float
    config: dict[str, object] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"healthy {self.healthy_step_s * 1e3:.1f} ms, slowed {self.slowed_step_s * 1e3:.1f} ms, "
            f"mitigated {self.mitigated_step_s * 1e3:.1f} ms per step; plan {self.plan} "
            f"({self.plan_source}); max |grad diff| {self.grad_max_abs_diff:.2e}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, which backward has just filled in."""
    if p.grad is None:
        raise RuntimeError("a DDP parameter has no gradient after backward")
    return p.grad


def _worker(rank: int, cfg: ExampleConfig, init_method: str, out_path: str | None) -> ExampleResult | None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # one core per rank; the ranks share the machine
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=cfg.world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        torch.manual_seed(cfg.seed)
        w = cfg.width
        model = torch.nn.Sequential(
            torch.nn.Linear(w, 2 * w),
            torch.nn.ReLU(),
            torch.nn.Linear(2 * w, 2 * w),
            torch.nn.ReLU(),
            torch.nn.Linear(2 * w, 10),
        )
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()
        world, total, b = cfg.world_size, cfg.microbatches, cfg.batch
        compute_est = [0.0]  # this rank's seconds of real compute per micro-batch (EMA)

        def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            x = torch.randn(total * b, w, generator=g)
            y = torch.randint(0, 10, (total * b,), generator=g)
            return x, y

        def run_step(
            step: int, plan: JobPlan | None, slowed: bool, optimize: bool = True
        ) -> tuple[float, float]:
            """One training step; returns (step seconds, slowest rank; this rank's s per micro-batch)."""
            share = rank_share(plan, rank, world, total)
            x, y = global_batch(step)
            dist.barrier()
            t0 = time.perf_counter()
            mb_times = []
            for j in range(share.count):
                t_mb = time.perf_counter()
                if slowed and rank == cfg.slow_rank and compute_est[0] > 0:
                    time.sleep((cfg.slow_factor - 1.0) * compute_est[0])
                lo = (share.offset + j) * b
                last = j == share.count - 1
                ctx = contextlib.nullcontext() if last else ddp.no_sync()
                with ctx:
                    t_c = time.perf_counter()
                    loss = loss_fn(ddp(x[lo : lo + b]), y[lo : lo + b]) * share.loss_scale
                    loss.backward()
                    done = time.perf_counter()
                if not last:  # the last backward also waits for the all-reduce
                    c = done - t_c
                    compute_est[0] = c if compute_est[0] == 0 else 0.8 * compute_est[0] + 0.2 * c
                    mb_times.append(done - t_mb)
            if optimize:
                opt.step()
                opt.zero_grad(set_to_none=True)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            return float(elapsed.item()), (statistics.fmean(mb_times) if mb_times else float("nan"))

        step = 0
        for _ in range(cfg.warmup):
            run_step(step, None, slowed=False)
            step += 1
        # Profile: the slowed job under the uniform split, as the detector sees it.
        per_mb = []
        for i in range(cfg.warmup + cfg.profile_steps):
            _, m = run_step(step, None, slowed=True)
            if i >= cfg.warmup:  # let the slowed rank's behaviour settle first
                per_mb.append(m)
            step += 1

        # Per-rank seconds per micro-batch, as the detector would profile them.
        mine = torch.tensor([statistics.median(per_mb)], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, mine)
        times = [float(t.item()) for t in gathered]

        # Rank 0 gets the plan (controller or local planner) and broadcasts it
        # so that every rank switches at the same step.
        box: list[object] = [None, None]
        if rank == 0:
            plan, source = None, "planner"
            if cfg.controller_url and cfg.job_id:
                from slurmguard.mitigate.client import PlanClient

                plan = PlanClient(cfg.controller_url, cfg.job_id).fetch()
                source = "controller"
            if plan is None:
                p = plan_microbatches(times, total)
                plan = JobPlan(
                    job_id=cfg.job_id or "local", version=1, microbatches=p.m, makespan_s=p.makespan
                )
                source = "planner"
            box = [plan.model_dump_json(), source]
        dist.broadcast_object_list(box, src=0)
        plan = JobPlan.model_validate_json(str(box[0]))
        source = str(box[1])

        # Same parameters, same global batch: the planned split must give the
        # gradient of the uniform split (weighted aggregation).
        grads = []
        for p_ in (None, plan):
            run_step(step, p_, slowed=False, optimize=False)
            grads.append(torch.cat([_grad(q).reshape(-1) for q in ddp.parameters()]).clone())
            opt.zero_grad(set_to_none=True)
        diff = float((grads[0] - grads[1]).abs().max().item())
        gmax = float(grads[0].abs().max().item())

        # Measure the three regimes interleaved, one step each per round, in a
        # rotating order: background load on a shared machine then weighs on
        # all three alike instead of on whichever phase ran while it lasted.
        series: dict[str, list[float]] = {"healthy": [], "slowed": [], "mitigated": []}
        regimes = [("healthy", None, False), ("slowed", None, True), ("mitigated", plan, True)]
        for r in range(cfg.steps):
            for k in range(3):
                name, p_, slow = regimes[(r + k) % 3]
                series[name].append(run_step(step, p_, slowed=slow)[0])
                step += 1
        healthy, slowed, mitigated = series["healthy"], series["slowed"], series["mitigated"]

        result = ExampleResult(
            healthy_step_s=statistics.median(healthy),
            slowed_step_s=statistics.median(slowed),
            mitigated_step_s=statistics.median(mitigated),
            per_microbatch_s=times,
            plan=list(plan.microbatches or ()),
            planned_makespan_s=float(plan.makespan_s or 0.0),
            plan_source=source,
            grad_max_abs_diff=diff,
            grad_max_abs=gmax,
            config=asdict(cfg),
        )
        if rank == 0 and out_path:
            Path(out_path).write_text(json.dumps(asdict(result)))
        # both ranks finish their collectives before either tears gloo down: a rank
        # that destroys the group while its peer is mid-call can abort the process
        dist.barrier()
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, cfg: ExampleConfig, init_method: str, out_path: str) -> None:
    _worker(rank, cfg, init_method, out_path)
    _leave()


def _leave() -> None:
    """The rank's work is done and written: exit 0 without interpreter
    finalisation, where gloo's threads can abort the process (pytorch issue
    190489). An exception from _worker never gets here: it keeps torch's
    error reporting."""
    from slurmguard.teardown import finish

    finish(0, barrier=False)  # _worker destroyed the group after a barrier


def run_example(cfg: ExampleConfig) -> ExampleResult:
    """Spawn ``cfg.world_size`` gloo ranks on 127.0.0.1 and return rank 0's result."""
    cfg.check()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="slurmguard-ddp-") as tmp:
        out = os.path.join(tmp, "result.json")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_spawned, args=(cfg, init, out), nprocs=cfg.world_size, join=True)
        data = json.loads(Path(out).read_text())
    return ExampleResult(**data)


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@click.command("example-ddp")
@click.option(
    "--world-size", default=2, show_default=True, type=int, help="Ranks to spawn (ignored under torchrun)."
)
@click.option("--slow-rank", default=1, show_default=True, type=int)
@click.option("--slow-factor", default=3.0, show_default=True, type=float)
@click.option(
    "--microbatches", default=16, show_default=True, type=int, help="Micro-batches per global batch."
)
@click.option("--batch", default=64, show_default=True, type=int, help="Samples per micro-batch.")
@click.option("--width", default=512, show_default=True, type=int, help="Model width (MLP).")
@click.option("--steps", default=10, show_default=True, type=int, help="Measured steps per regime.")
@click.option("--warmup", default=3, show_default=True, type=int)
@click.option(
    "--profile-steps", default=5, show_default=True, type=int, help="Slowed steps profiled for the planner."
)
@click.option(
    "--controller-url", default=None, help="Fetch the plan from this controller instead of planning locally."
)
@click.option("--job-id", default=None, help="Job id for the controller (default $SLURM_JOB_ID).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def example_ddp(
    world_size: int,
    slow_rank: int,
    slow_factor: float,
    microbatches: int,
    batch: int,
    width: int,
    steps: int,
    warmup: int,
    profile_steps: int,
    controller_url: str | None,
    job_id: str | None,
    as_json: bool,
) -> None:
    """Healthy, slowed and mitigated step times of a small gloo DDP job."""
    if _under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    cfg = ExampleConfig(
        world_size=world_size,
        slow_rank=slow_rank,
        slow_factor=slow_factor,
        microbatches=microbatches,
        batch=batch,
        width=width,
        steps=steps,
        warmup=warmup,
        profile_steps=profile_steps,
        controller_url=controller_url,
        job_id=job_id or os.environ.get("SLURM_JOB_ID"),
    )
    cfg.check()
    if _under_torchrun():
        res = _worker(int(os.environ["RANK"]), cfg, "env://", None)
        if res is not None:
            click.echo(json.dumps(asdict(res)) if as_json else res.summary())
        _leave()
    res = run_example(cfg)
    click.echo(json.dumps(asdict(res)) if as_json else res.summary())


def main() -> None:  # pragma: no cover - module entry point
    from slurmguard.errors import SlurmguardError

    try:
        example_ddp.main(standalone_mode=True)
    except SlurmguardError as exc:
        click.echo(f"slurmguard: error: {exc}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
