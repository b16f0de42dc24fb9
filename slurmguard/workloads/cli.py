"""Command line of the training workloads (`python -m slurmguard.workloads`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from slurmguard.workloads import SHAPES

EPILOG = """\
examples (a 2-node job, one task per node; 2d wants 2 tasks per node):

  sbatch -N2 --ntasks-per-node=1 --straggler-guard \\
      --wrap "srun python -m slurmguard.workloads ddp --steps 2000 --ckpt-dir $PWD/ckpt-ddp"
  sbatch -N2 --ntasks-per-node=2 --straggler-guard --signal=USR1@60 \\
      --wrap "srun python -m slurmguard.workloads 2d --seconds 600 --ckpt-dir $PWD/ckpt-2d"

Rank, world size and local rank come from Slurm (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID; torchrun's RANK/WORLD_SIZE/LOCAL_RANK otherwise), the rendezvous
through slurmguard.rendezvous at MASTER_ADDR (default: the first node's address;
rank 0 binds its port as it starts). Everything runs on CPU with gloo, one thread
per rank.

Checkpoints (torch.distributed.checkpoint) go to --ckpt-dir, which every node
must see: every --ckpt-every steps, on SIGUSR1 (slurmguard's or Slurm's
--signal=USR1 checkpoint request) and at the end; a requeued job resumes from
the latest one. Each rank appends its own measured step times to
<log-dir>/rank<N>.jsonl (iter, step_s, restart, t, loss, ckpt_s).

Rebalancing (slurmguard's S2 tier): a ddp job with --accum M, submitted with
--comment=slurmguard:mitigate,microbatches=M and SLURMGUARD_CONTROLLER_URL in
its environment, runs M micro-batches per step split between the ranks; rank 0
asks the controller for the job's plan every --plan-every steps and all ranks
switch to it at the same step (the log's "microbatches" and "plan").
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m slurmguard.workloads",
        description="Real torch training on CPU/gloo in five parallel shapes, to try slurmguard "
        "on a cluster: ddp (DistributedDataParallel, bucketed all-reduce overlapping "
        "backward), fsdp (FSDP2 fully_shard), pp (pipelining, 1F1B), tp (DTensor "
        "tensor parallel), 2d (FSDP2 across nodes x TP inside a node).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("shape", choices=SHAPES)
    stop = ap.add_argument_group("how long (the first bound reached ends the run)")
    stop.add_argument(
        "--steps",
        type=int,
        default=1000,
        help="total optimizer steps of the training, across restarts (default 1000)",
    )
    stop.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="end this run after this much wall time, with a checkpoint (0: no bound)",
    )
    io = ap.add_argument_group("checkpoints and logs")
    io.add_argument(
        "--ckpt-dir",
        type=Path,
        default=None,
        help="shared checkpoint directory (default ./ckpt-<shape>-<job id>)",
    )
    io.add_argument(
        "--ckpt-every",
        type=int,
        default=100,
        help="steps between periodic checkpoints (0: only on SIGUSR1 and at the end)",
    )
    io.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where rank<N>.jsonl step logs go (default: the checkpoint directory)",
    )
    ev = ap.add_argument_group("evaluation (ddp)")
    ev.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="steps between evaluations: every rank runs forward passes of its model replica on "
        "held-out batches, with no collective (default 0: none)",
    )
    ev.add_argument("--eval-s", type=float, default=5.0, help="seconds each evaluation lasts (default 5)")
    sv = ap.add_argument_group("rank-0 save (ddp)")
    sv.add_argument(
        "--rank0-save-every",
        type=int,
        default=0,
        help="steps between saves of the whole model by rank 0 alone (torch.save, fsync) while the "
        "other ranks wait in a barrier, as plain DDP jobs checkpoint (default 0: none)",
    )
    sv.add_argument(
        "--rank0-save-s",
        type=float,
        default=5.0,
        help="seconds each rank-0 save lasts: the model is written again until then, as a large "
        "model's save to shared storage takes (default 5)",
    )
    sv.add_argument(
        "--rank0-save-mbps",
        type=float,
        default=100.0,
        help="MB a second rank 0 writes while it saves, the storage's pace (default 100)",
    )
    m = ap.add_argument_group("model (a stack of transformer MLP blocks and a classifier head)")
    m.add_argument("--width", type=int, default=256, help="model width (default 256)")
    m.add_argument("--hidden", type=int, default=1024, help="MLP hidden size (default 1024)")
    m.add_argument("--depth", type=int, default=4, help="blocks (default 4)")
    m.add_argument(
        "--batch", type=int, default=64, help="samples per step per data-parallel rank (default 64)"
    )
    p = ap.add_argument_group("parallelism")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=1.0,
        help="ddp: gradient bucket size in MB (default 1: several buckets per step)",
    )
    p.add_argument("--microbatches", type=int, default=4, help="pp: micro-batches per step (default 4)")
    p.add_argument(
        "--accum",
        type=int,
        default=0,
        help="ddp: gradient accumulation over this many micro-batches per step, split between "
        "the ranks by slurmguard's rebalance plan (default 0: off)",
    )
    p.add_argument(
        "--plan-every",
        type=int,
        default=5,
        help="ddp --accum: steps between rank 0's requests for the plan (default 5)",
    )
    p.add_argument(
        "--tp", type=int, default=0, help="2d: tensor-parallel size (default: the tasks on one node)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    # first thing: SIGUSR1's default action kills, and a checkpoint request can
    # come while torch is still being imported
    request = {"ckpt": False}
    signal.signal(signal.SIGUSR1, lambda *_: request.__setitem__("ckpt", True))
    args = parser().parse_args(argv)
    for name in ("steps", "depth", "width", "hidden", "batch", "microbatches"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be at least 1", file=sys.stderr)
            return 2
    if args.ckpt_every < 0 or args.seconds < 0 or args.bucket_mb <= 0:
        print("error: --ckpt-every and --seconds must be >= 0, --bucket-mb > 0", file=sys.stderr)
        return 2
    if args.eval_every < 0 or not 0 < args.eval_s <= 86400:
        print("error: --eval-every must be >= 0 and --eval-s in (0, 86400]", file=sys.stderr)
        return 2
    if args.rank0_save_every < 0 or not 0 < args.rank0_save_s <= 86400 or args.rank0_save_mbps <= 0:
        print(
            "error: --rank0-save-every must be >= 0, --rank0-save-s in (0, 86400] and --rank0-save-mbps > 0",
            file=sys.stderr,
        )
        return 2
    if args.rank0_save_every and args.shape != "ddp":
        print(
            f"error: --rank0-save-every: rank 0's replica is the whole model only in the ddp shape "
            f"(not {args.shape})",
            file=sys.stderr,
        )
        return 2
    if args.eval_every and args.shape != "ddp":
        print(
            f"error: --eval-every: {args.shape}'s forward pass communicates; a validation pass "
            "without collectives is the ddp shape's",
            file=sys.stderr,
        )
        return 2

    from slurmguard.teardown import finish
    from slurmguard.workloads import runtime, shapes

    env = runtime.slurm_env()
    ckpt = args.ckpt_dir or Path.cwd() / f"ckpt-{args.shape}-{env.job_id}"
    spec = runtime.ModelSpec(width=args.width, hidden=args.hidden, depth=args.depth, batch=args.batch)
    opts = runtime.RunOptions(
        shape=args.shape,
        steps=args.steps,
        seconds=args.seconds,
        ckpt_dir=ckpt,
        log_dir=args.log_dir or ckpt,
        ckpt_every=args.ckpt_every,
        spec=spec,
        eval_every=args.eval_every,
        eval_s=args.eval_s,
        rank0_save_every=args.rank0_save_every,
        rank0_save_s=args.rank0_save_s,
        rank0_save_mb_s=args.rank0_save_mbps,
    )
    runtime.init(env)
    try:
        built = shapes.build(
            args.shape,
            env,
            spec,
            shapes.ShapeOptions(
                bucket_mb=args.bucket_mb,
                microbatches=args.microbatches,
                tp=args.tp,
                accum=args.accum,
                plan_every=args.plan_every,
            ),
        )
    except ValueError as exc:
        if env.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        finish(2, barrier=False)
    if env.rank == 0:
        print(f"{args.shape}: {built.about}; rank 0 on {env.node}, pid {os.getpid()}", flush=True)
    end = runtime.train(
        env, opts, built.model, built.optim, built.step, request, built.shares, built.evaluate
    )
    if env.rank == 0:
        print(f"{args.shape}: stopped at step {end} of {args.steps}", flush=True)
    finish(0)


if __name__ == "__main__":
    sys.exit(main())
