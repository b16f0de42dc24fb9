"""A small torch DDP training job for the demo, the tests and the benchmarks.

Run under Slurm (`srun python -m slurmguard_dev.devcluster.train ...`): rank,
world size and local rank come from SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID, gloo over 127.0.0.1 (every dev-cluster node is this host).

Fail-slow injection for demos and tests: while the file
<inject_dir>/<node name> exists, the rank on that node computes slower by the
factor written in it (e.g. "1.3"), by sleeping (factor - 1) x its measured
compute time; sleeping keeps the injected slowdown independent of how busy
the machine's cores are. It checkpoints every --ckpt-every iterations and on
SIGUSR1 (slurmguard's checkpoint request), and resumes from the checkpoint
after a requeue.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(prog="slurmguard_dev.devcluster.train")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--work", type=int, default=2, help="real matmuls (64x256 @ 256x256) per iteration")
    ap.add_argument(
        "--compute-ms",
        type=float,
        default=80.0,
        help="modelled accelerator time per iteration (ms), spent asleep: a GPU's "
        "kernels do not use the host CPU either, and sleeping keeps step times "
        "steady on a busy development machine",
    )
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory (shared)")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--inject-dir", type=Path, default=None)
    ap.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="global batch in micro-batches (M); >0 splits --compute-ms over them and "
        "follows the controller's plan (opt in with --comment=slurmguard:mitigate,"
        "microbatches=M and SLURMGUARD_CONTROLLER_URL)",
    )
    ap.add_argument("--plan-every", type=int, default=10, help="steps between plan polls")
    ap.add_argument("--log", type=Path, default=None, help="JSON lines of per-iteration times (rank 0)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("SLURM_PROCID", "0"))
    world = int(os.environ.get("SLURM_NTASKS", "1"))
    job = int(os.environ.get("SLURM_JOB_ID", "0"))
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    from slurmguard.rendezvous import init_process_group

    init_process_group("gloo", rank, world, timeout_s=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    args.ckpt.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt / "state.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        start = state["iter"]
    want_ckpt = {"now": False}
    signal.signal(signal.SIGUSR1, lambda *_: want_ckpt.__setitem__("now", True))
    x = torch.randn(64, 256)
    y = torch.randint(0, 8, (64,))
    w = torch.randn(256, 256)
    # open for the whole loop, closed after it
    log = open(args.log, "a") if (args.log and rank == 0) else None  # noqa: SIM115
    poller = None
    if args.microbatches:
        from slurmguard.mitigate.client import PlanClient
        from slurmguard.mitigate.plan import rank_share

        client = PlanClient.from_env()
        plan = None
        per_mb_ms = args.compute_ms * world / args.microbatches
        poller = client
    print(f"rank {rank}/{world} on {node}: starting at iteration {start}", flush=True)
    for it in range(start, args.iters):
        t0 = time.perf_counter()
        a = x
        for _ in range(args.work):
            a = torch.tanh(a @ w)
        factor = 1.0
        if args.inject_dir is not None:
            try:
                factor = max(1.0, float((args.inject_dir / node).read_text().strip() or "1"))
            except (OSError, ValueError):
                factor = 1.0
        # forward/backward "on the accelerator": modelled time, then the real
        # (small) model, whose backward() runs DDP's gradient all-reduce
        compute_ms, count = args.compute_ms, None
        if args.microbatches:
            if poller is not None and it % args.plan_every == 0:
                plan = poller.fetch() or plan
            try:
                count = rank_share(plan, rank, world, args.microbatches).count
            except Exception:  # a plan that does not fit: keep the uniform split
                count = rank_share(None, rank, world, args.microbatches).count
            compute_ms = per_mb_ms * count
        time.sleep(compute_ms / 1000.0 * factor)
        loss = torch.nn.functional.cross_entropy(ddp(a), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None:
            log.write(
                json.dumps(
                    {
                        "iter": it,
                        "t": time.time(),
                        "step_s": time.perf_counter() - t0,
                        "node": node,
                        "microbatches": count,
                        "plan": plan.version if args.microbatches and plan else None,
                    }
                )
                + "\n"
            )
            log.flush()
        if (it + 1) % args.ckpt_every == 0 or want_ckpt["now"]:
            if rank == 0:
                torch.save({"model": model.state_dict(), "iter": it + 1}, ckpt)
            want_ckpt["now"] = False
    dist.barrier()
    if rank == 0:
        (args.ckpt / "done").write_text(json.dumps({"iters": args.iters, "node": node, "job": job}))
    print(f"rank {rank} on {node}: finished {args.iters} iterations", flush=True)
    if log is not None:
        log.close()
    # the work is done and recorded: leave without interpreter finalisation,
    # where gloo's threads can abort the process (pytorch issue 190489)
    from slurmguard.teardown import finish

    finish(0)


if __name__ == "__main__":
    sys.exit(main())
