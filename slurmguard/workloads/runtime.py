"""What every workload shares: the process group from Slurm's environment, the
model and data, checkpoint/resume, the per-rank step log, and the stop rule.

Rank and world come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (torchrun's
RANK / WORLD_SIZE / LOCAL_RANK are honoured when Slurm's are absent), the
rendezvous through slurmguard.rendezvous at MASTER_ADDR (default: the first
node of the job; rank 0 binds its store port when it starts). Everything
runs on CPU with gloo, one intra-op thread per rank, like one GPU per rank on
a real node.

Per-rank step log (JSON lines, appended across restarts), one line per
optimizer step, measured by the job itself:

    {"rank": 0, "node": "node1", "iter": 41, "restart": 0, "t": 1764000000.12,
     "step_s": 0.083, "loss": 1.93, "ckpt_s": 0.0}

iter: the global iteration index (continues after a resume); restart:
SLURM_RESTART_COUNT; t: wall-clock end of the step (s, epoch); step_s: wall
time of the optimizer step (forward, backward, gradient communication,
optimizer, the per-step loss/flag all-reduce), without the checkpoint;
ckpt_s: the checkpoint written after this step (0 when none). A ddp job with
--accum adds "microbatches" (this rank's count in the step) and "plan" (the
version of the controller's rebalance plan in force, null for the uniform split).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from slurmguard.workloads.rebalance import Shares


# ------------------------------------------------------------------ environment
@dataclass(frozen=True)
class Env:
    """Where this rank sits in the job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: str
    job_id: int
    restart: int


def _first_node_addr() -> str:
    """NodeAddr of the job's first node (what its peers can reach), via scontrol."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"
    try:
        first = subprocess.run(
            ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=10, check=True
        ).stdout.split()[0]
        info = subprocess.run(
            ["scontrol", "show", "node", "-o", first], capture_output=True, text=True, timeout=10, check=True
        ).stdout.split()
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodes.split(",")[0].split("[")[0]
    for tok in info:
        if tok.startswith("NodeAddr="):
            return tok.split("=", 1)[1]
    return first


def slurm_env() -> Env:
    """Read the rank layout from Slurm (or torchrun) and set the rendezvous variables."""
    e = os.environ

    def pick(*names: str, default: str) -> int:
        for n in names:
            if e.get(n, "").strip():
                return int(e[n].split("(")[0])
        return int(default)

    job = pick("SLURM_JOB_ID", default="0")
    env = Env(
        rank=pick("SLURM_PROCID", "RANK", default="0"),
        world=pick("SLURM_NTASKS", "WORLD_SIZE", default="1"),
        local_rank=pick("SLURM_LOCALID", "LOCAL_RANK", default="0"),
        local_world=pick("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOCAL_WORLD_SIZE", default="1"),
        node=e.get("SLURMD_NODENAME") or socket.gethostname(),
        job_id=job,
        restart=pick("SLURM_RESTART_COUNT", default="0"),
    )
    if "MASTER_ADDR" not in e:
        e["MASTER_ADDR"] = _first_node_addr()
    return env


def init(env: Env, timeout_s: float = 120.0) -> None:
    from slurmguard.rendezvous import init_process_group

    torch.set_num_threads(1)
    # the rendezvous id includes SLURM_RESTART_COUNT: a requeued job never
    # joins its previous run's store
    init_process_group("gloo", env.rank, env.world, timeout_s=timeout_s)


# ------------------------------------------------------------------ model and data
class Block(nn.Module):
    """A pre-norm transformer MLP block: x + W2 gelu(W1 LN(x))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


@dataclass(frozen=True)
class ModelSpec:
    """Model and batch sizes. width/hidden: features; depth: blocks; batch: samples
    per rank per step (per pipeline micro-batch: batch / microbatches)."""

    width: int = 256
    hidden: int = 1024
    depth: int = 4
    classes: int = 16
    batch: int = 64


def build_model(spec: ModelSpec) -> nn.Sequential:
    """blocks.0..N-1, then the head; same initial weights on every rank (seed 0)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [Block(spec.width, spec.hidden) for _ in range(spec.depth)]
    layers.append(Head(spec.width, spec.classes))
    return nn.Sequential(*layers)


class Teacher:
    """Synthetic classification data from a fixed random linear teacher: the
    model has something real to learn, and the batch of step i on data shard s
    is the same after a resume."""

    def __init__(self, spec: ModelSpec) -> None:
        g = torch.Generator().manual_seed(1234)
        self.spec = spec
        self.w = torch.randn(spec.width, spec.classes, generator=g)

    def batch(self, step: int, shard: int, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step * 1009 + shard)
        x = torch.randn(size or self.spec.batch, self.spec.width, generator=g)
        return x, (x @ self.w).argmax(dim=1)


# ------------------------------------------------------------------ checkpoints
class Checkpointer:
    """Sharded checkpoints with torch.distributed.checkpoint (DCP) in a directory
    every node sees. Each save goes to step-<N>/ and then `latest` is switched
    by rank 0 after every rank has written, so a job killed mid-save resumes
    from the previous one."""

    def __init__(self, root: Path, every: int) -> None:
        self.root = root
        self.every = every
        self.root.mkdir(parents=True, exist_ok=True)

    def _state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optim, options=_SD_OPTIONS())
        return {"model": msd, "optim": osd}

    def latest(self) -> int | None:
        try:
            return int((self.root / "latest").read_text().strip())
        except (OSError, ValueError):
            return None

    def save(
        self,
        step: int,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        extra_state: Callable[[], dict] | None = None,
    ) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._state(model, optim)
        dcp.save(state, checkpoint_id=str(self.root / f"step-{step}"))
        dist.barrier()
        if dist.get_rank() == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(f"{step}\n")
            tmp.replace(self.root / "latest")
            old = self.latest_before(step)
            for s in old:
                _rmtree(self.root / f"step-{s}")

    def latest_before(self, step: int) -> list[int]:
        out = []
        for p in self.root.glob("step-*"):
            try:
                n = int(p.name.split("-", 1)[1])
            except ValueError:
                continue
            if n < step:
                out.append(n)
        return out

    def load(self, model: nn.Module, optim: torch.optim.Optimizer) -> int:
        """Restore the latest checkpoint (if any); return the step to continue from."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        step = self.latest()
        if step is None:
            return 0
        state = self._state(model, optim)
        dcp.load(state, checkpoint_id=str(self.root / f"step-{step}"))
        set_state_dict(
            model,
            optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_SD_OPTIONS(),
        )
        return step


def _SD_OPTIONS() -> StateDictOptions:
    """Flattened optimizer state: param-group settings keyed per parameter. A
    pipeline stage's optimizer holds other parameters than its peers'; nested,
    every rank's `param_groups` entry had the same key and DCP kept only one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


# ------------------------------------------------------------------ the loop
@dataclass
class RunOptions:
    """steps: total optimizer steps of the training (across restarts); seconds:
    stop this run after that much wall time (0: no bound); ckpt_every: steps
    between periodic checkpoints (0: only on SIGUSR1 and at the end);
    eval_every: steps between evaluations (0: none), each eval_s seconds of
    forward passes on held-out batches with no collective (train's evaluate);
    rank0_save_every: steps between saves of the model by rank 0 alone while
    the others wait in a barrier (0: none), each rank0_save_s seconds of
    writing at rank0_save_mb_s MB/s (save_model_for)."""

    shape: str
    steps: int
    seconds: float
    ckpt_dir: Path
    log_dir: Path
    ckpt_every: int
    spec: ModelSpec = field(default_factory=ModelSpec)
    eval_every: int = 0
    eval_s: float = 5.0
    rank0_save_every: int = 0
    rank0_save_s: float = 5.0
    rank0_save_mb_s: float = 100.0


def save_model_for(model: nn.Module, path: Path, seconds: float, mb_per_s: float = 100.0) -> float:
    """Save the model's state to `path` (torch.save, fsync, then renamed into
    place) again and again until `seconds` have passed, at least once, at most
    `mb_per_s` MB a second (a client's share of shared storage), as a large
    model's save takes that long; returns MB written. Plain DDP jobs
    checkpoint this way: rank 0 saves while the others wait in a barrier."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    start = time.monotonic()
    written = 0
    while True:
        with open(tmp, "wb") as fh:
            torch.save(model.state_dict(), fh)
            fh.flush()
            os.fsync(fh.fileno())
            written += fh.tell()
        # the storage's pace: the next write starts when this one would have ended
        time.sleep(max(0.0, min(written / 1e6 / mb_per_s, seconds) - (time.monotonic() - start)))
        if time.monotonic() - start >= seconds:
            break
    tmp.replace(path)
    return round(written / 1e6, 1)


class StepLog:
    def __init__(self, path: Path, env: Env) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # held for the whole run (one line per step); closed when the process ends
        self.f = open(path, "a")  # noqa: SIM115
        self.env = env

    def write(self, it: int, step_s: float, loss: float, ckpt_s: float, **extra: Any) -> None:
        self.f.write(
            json.dumps(
                {
                    "rank": self.env.rank,
                    "node": self.env.node,
                    "iter": it,
                    "restart": self.env.restart,
                    "t": round(time.time(), 4),
                    "step_s": round(step_s, 6),
                    "loss": round(loss, 5),
                    "ckpt_s": round(ckpt_s, 4),
                    **extra,
                }
            )
            + "\n"
        )
        self.f.flush()


def train(
    env: Env,
    opts: RunOptions,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step_fn: Callable[[int], torch.Tensor | None],
    request: dict | None = None,
    shares: Shares | None = None,
    evaluate: Callable[[float], int] | None = None,
) -> int:
    """Run optimizer steps until opts.steps or opts.seconds; return the next step.

    step_fn(i) does forward, backward and optimizer step i and returns the loss
    this rank saw (None on ranks that do not compute it, e.g. early pipeline
    stages). request: {"ckpt": bool}, set by a SIGUSR1 handler installed
    before torch was imported (cli.main), so a signal during start-up is kept,
    not fatal; without one, train installs its own. After each step one small all-reduce carries the loss (for the
    log), the checkpoint request (SIGUSR1 may reach ranks at different steps)
    and the time bound, so every rank takes the same decision at the same step;
    with shares (ddp --accum), also rank 0's rebalance plan, which every rank
    then applies from the next step on. evaluate(seconds) -> batches: this
    rank's evaluation, run every opts.eval_every steps (after the step's
    all-reduce, so every rank evaluates at the same step) for opts.eval_s s;
    it issues no collective, as a validation pass over a local model replica
    does not, and its time shows in no step (the log's eval_s).
    """
    ck = Checkpointer(opts.ckpt_dir, opts.ckpt_every)
    start = ck.load(model, optim)
    want = request if request is not None else {"ckpt": False}
    if request is None:
        signal.signal(signal.SIGUSR1, lambda *_: want.__setitem__("ckpt", True))
    log = StepLog(opts.log_dir / f"rank{env.rank}.jsonl", env)
    if env.rank == 0:
        print(
            f"{opts.shape}: {env.world} ranks, resuming at step {start}, restart "
            f"{env.restart}, checkpoints in {opts.ckpt_dir}",
            flush=True,
        )
    t_begin = time.monotonic()
    it = start
    while it < opts.steps:
        t0 = time.perf_counter()
        loss = step_fn(it)
        over = opts.seconds > 0 and time.monotonic() - t_begin >= opts.seconds
        flags = torch.tensor(
            [
                0.0 if loss is None else float(loss),
                1.0 if loss is not None else 0.0,
                float(want["ckpt"]),
                float(over),
                *(shares.proposal(it) if shares is not None else ()),
            ]
        )
        dist.all_reduce(flags)
        step_s = time.perf_counter() - t0
        it += 1
        ckpt_s = 0.0
        stop = flags[3] > 0
        if flags[2] > 0 or stop or it == opts.steps or (ck.every and it % ck.every == 0):
            t1 = time.perf_counter()
            ck.save(it, model, optim)
            ckpt_s = time.perf_counter() - t1
            want["ckpt"] = False
        extra: dict[str, Any] = {}
        if shares is not None:
            extra = {"microbatches": shares.share.count, "plan": shares.version}
            shares.adopt(flags[4:].tolist())
        if evaluate is not None and opts.eval_every and it % opts.eval_every == 0 and not stop:
            t1 = time.perf_counter()
            extra["eval_batches"] = evaluate(opts.eval_s)
            extra["eval_s"] = round(time.perf_counter() - t1, 4)
        if opts.rank0_save_every and it % opts.rank0_save_every == 0 and not stop:
            t1 = time.perf_counter()
            if env.rank == 0:
                extra["rank0_save_mb"] = save_model_for(
                    model, opts.ckpt_dir / "model.pt", opts.rank0_save_s, opts.rank0_save_mb_s
                )
            dist.barrier()
            extra["rank0_save_s"] = round(time.perf_counter() - t1, 4)
        log.write(it - 1, step_s, float(flags[0] / flags[1].clamp(min=1.0)), ckpt_s, **extra)
        if stop:
            break
    if it >= opts.steps and env.rank == 0:
        (opts.ckpt_dir / "done").write_text(
            json.dumps({"steps": it, "job": env.job_id, "restart": env.restart}) + "\n"
        )
    return it
