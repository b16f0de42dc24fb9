"""The five parallel shapes. Each builds its model, optimizer and one training
step on the process group that runtime.init made; runtime.train runs them.

ddp   DistributedDataParallel, gradients all-reduced in buckets of --bucket-mb
      (several per step) while the backward pass still runs; with --accum M,
      gradient accumulation over M micro-batches per step split between the
      ranks (no_sync on all but each rank's last), the split following
      slurmguard's rebalance plan (rebalance.py).
fsdp  FSDP2 (torch.distributed.fsdp.fully_shard) per block and at the root:
      parameters all-gathered before each block's forward/backward, gradients
      reduce-scattered after it.
pp    torch.distributed.pipelining: one stage per rank (blocks split evenly,
      the head on the last stage), 1F1B over --microbatches micro-batches.
tp    DTensor tensor parallel (parallelize_module): each block's up projection
      ColwiseParallel, its down projection RowwiseParallel (one all-reduce in
      forward and one in backward per block); every rank sees the same batch.
2d    DP x TP on a 2-D DeviceMesh: TP inside a node (over its tasks), FSDP2
      data parallel across nodes, the usual way to combine the two.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurmguard.workloads.rebalance import Shares
from slurmguard.workloads.runtime import Env, ModelSpec, Teacher, build_model


@dataclass
class Built:
    """model: what the checkpoint saves; step(i) -> loss (None where this rank
    has none); shares: the micro-batch split that train() keeps in step across
    ranks (ddp --accum), else None; evaluate(seconds) -> batches: a validation
    pass with no collective (ddp: its local replica), None where the shape's
    forward pass communicates."""

    model: nn.Module
    optim: torch.optim.Optimizer
    step: Callable[[int], torch.Tensor | None]
    about: str
    shares: Shares | None = None
    evaluate: Callable[[float], int] | None = None


@dataclass(frozen=True)
class ShapeOptions:
    """bucket_mb: DDP bucket cap (MB); microbatches: pipeline micro-batches per
    step; tp: tensor-parallel size of the 2d shape (0: the tasks of one node);
    accum: ddp micro-batches per step across all ranks (0: one batch per rank,
    no accumulation); plan_every: steps between rank 0's requests for the
    controller's rebalance plan (with accum)."""

    bucket_mb: float = 1.0
    microbatches: int = 4
    tp: int = 0
    accum: int = 0
    plan_every: int = 5


def _optim(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y)


def _data_parallel_step(
    model: nn.Module, optim: torch.optim.Optimizer, teacher: Teacher, shard: int
) -> Callable[[int], torch.Tensor]:
    def step(i: int) -> torch.Tensor:
        x, y = teacher.batch(i, shard)
        loss = _loss(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        return loss.detach()

    return step


def build_ddp(env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    model = DistributedDataParallel(build_model(spec), bucket_cap_mb=o.bucket_mb)
    optim = _optim(model.parameters())
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    shares = _shares(env, spec, o) if o.accum else None
    inner = (
        _accumulating_step(model, optim, Teacher(spec), shares, spec.batch * env.world // o.accum)
        if shares is not None
        else _data_parallel_step(model, optim, Teacher(spec), env.rank)
    )
    told = {"done": False}

    def step(i: int) -> torch.Tensor:
        loss = inner(i)
        if not told["done"] and env.rank == 0:
            # DDP puts every gradient in one bucket for the first step and rebuilds
            # the buckets in backward order during the second
            sizes = model._get_ddp_logging_data().get("rebuilt_bucket_sizes")
            if sizes:
                told["done"] = True
                print(f"ddp: {len(str(sizes).split(','))} gradient buckets per step", flush=True)
        return loss

    about = f"DDP, {mb:.1f} MB of gradients in buckets of {o.bucket_mb:g} MB"
    if shares is not None:
        about += f", {o.accum} micro-batches per step split between the ranks"
    return Built(model, optim, step, about, shares, _local_evaluation(model.module, Teacher(spec), env.rank))


#: the data shard of held-out batches (training uses shards 0..world-1)
HELD_OUT = 1 << 20


def _local_evaluation(replica: nn.Module, teacher: Teacher, rank: int) -> Callable[[float], int]:
    """Forward passes of this rank's model replica on held-out batches for a
    number of seconds (no gradient, no collective): a DDP job's validation."""

    def evaluate(seconds: float) -> int:
        n, end = 0, time.monotonic() + seconds
        with torch.no_grad():
            while time.monotonic() < end:
                x, y = teacher.batch(n, HELD_OUT + rank)
                _loss(replica(x), y)
                n += 1
        return n

    return evaluate


def _shares(env: Env, spec: ModelSpec, o: ShapeOptions) -> Shares:
    from slurmguard.errors import InputError
    from slurmguard.mitigate.client import PlanClient, PlanPoller

    if o.accum < env.world or (spec.batch * env.world) % o.accum:
        raise ValueError(
            f"--accum {o.accum}: needs at least one micro-batch per rank ({env.world} ranks) and to "
            f"divide the global batch ({spec.batch} x {env.world} samples)"
        )
    if o.plan_every < 1:
        raise ValueError("--plan-every must be at least 1")
    poller = None
    if env.rank == 0:
        try:
            client = PlanClient.from_env()
        except InputError as exc:
            raise ValueError(str(exc)) from None
        poller = PlanPoller(client, o.plan_every, env.world, o.accum)
    return Shares(env.rank, env.world, o.accum, poller)


def _accumulating_step(
    model: DistributedDataParallel, optim: torch.optim.Optimizer, teacher: Teacher, shares: Shares, size: int
) -> Callable[[int], torch.Tensor]:
    """This rank's micro-batches of the step (its share), gradients all-reduced
    once, with the last; micro-batch k of step i is the same data whichever
    rank runs it, and each loss carries dp_size / M, so the update is the
    uniform split's under any plan."""

    def step(i: int) -> torch.Tensor:
        share = shares.share
        optim.zero_grad(set_to_none=True)
        losses = []
        for k in range(share.count):
            x, y = teacher.batch(i, share.offset + k, size)
            with model.no_sync() if k < share.count - 1 else contextlib.nullcontext():
                loss = _loss(model(x), y)
                (loss * share.loss_scale).backward()
            losses.append(loss.detach())
        optim.step()
        return torch.stack(losses).mean()

    return step


def build_fsdp(env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (env.world,), mesh_dim_names=("dp",))
    model = build_model(spec)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = _optim(model.parameters())
    return Built(
        model,
        optim,
        _data_parallel_step(model, optim, Teacher(spec), env.rank),
        f"FSDP2 fully_shard over {env.world} ranks, {len(model)} units",
    )


def _tp_plan(spec: ModelSpec) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    for i in range(spec.depth):
        plan[f"{i}.up"] = ColwiseParallel()
        plan[f"{i}.down"] = RowwiseParallel()
    return plan


def build_tp(env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if spec.hidden % env.world:
        raise ValueError(f"--hidden {spec.hidden} must divide by the {env.world} TP ranks")
    mesh = init_device_mesh("cpu", (env.world,), mesh_dim_names=("tp",))
    model = parallelize_module(build_model(spec), mesh, _tp_plan(spec))
    optim = _optim(model.parameters())
    # tensor parallel ranks work on one batch together: the same data shard
    return Built(
        model,
        optim,
        _data_parallel_step(model, optim, Teacher(spec), 0),
        f"TP over {env.world} ranks (Colwise up, Rowwise down, {spec.depth} blocks)",
    )


def build_2d(env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp = o.tp or env.local_world
    if tp < 2 or env.world % tp or env.world // tp < 2:
        raise ValueError(
            f"2d needs DP >= 2 and TP >= 2: {env.world} ranks, TP {tp} "
            f"(run 2 or more nodes with 2 or more tasks each, or set --tp)"
        )
    dp = env.world // tp
    # ranks are numbered node by node: the tasks of one node form a TP group
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(build_model(spec), mesh["tp"], _tp_plan(spec))
    for layer in cast(nn.Sequential, model):  # build_model's stack of layers
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = _optim(model.parameters())
    dp_rank = mesh.get_local_rank("dp")
    return Built(
        model,
        optim,
        _data_parallel_step(model, optim, Teacher(spec), dp_rank),
        f"2-D: DP {dp} (FSDP2 across nodes) x TP {tp} (inside a node)",
    )


def build_pp(env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stages = env.world
    layers = spec.depth + 1  # blocks and the head
    if stages < 2 or layers < stages:
        raise ValueError(
            f"pp needs 2 or more ranks and at least one layer per stage ({layers} layers, {stages} ranks)"
        )
    if spec.batch % o.microbatches:
        raise ValueError(f"--batch {spec.batch} must divide into {o.microbatches} micro-batches")
    lo, hi = env.rank * layers // stages, (env.rank + 1) * layers // stages
    full = build_model(spec)
    # keep the full model's layer names (checkpoint keys stay unique across
    # stages); the layers of other stages are identities without parameters
    for j in range(layers):
        if not lo <= j < hi:
            full[j] = nn.Identity()
    stage = PipelineStage(full, env.rank, stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=o.microbatches, loss_fn=_loss)
    optim = _optim(full.parameters())
    teacher = Teacher(spec)
    first, last = env.rank == 0, env.rank == stages - 1

    def step(i: int) -> torch.Tensor | None:
        x, y = teacher.batch(i, 0)
        optim.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optim.step()
        return torch.stack(losses).mean().detach() if losses else None

    return Built(
        full,
        optim,
        step,
        f"pipeline, {stages} stages (layers {lo}..{hi - 1} here), 1F1B over {o.microbatches} micro-batches",
    )


BUILDERS = {"ddp": build_ddp, "fsdp": build_fsdp, "pp": build_pp, "tp": build_tp, "2d": build_2d}


def build(shape: str, env: Env, spec: ModelSpec, o: ShapeOptions) -> Built:
    if not dist.is_initialized():
        raise RuntimeError("init the process group first (runtime.init)")
    return BUILDERS[shape](env, spec, o)
