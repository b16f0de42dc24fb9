"""The sleep-modelled DDP job of `slurmguard bench hook`'s step-time part: one
gradient bucket and the accelerator's compute modelled as a sleep, so a guarded
and an unguarded run differ only by the hook on a busy development machine.
Everything else (the demo, the online tests, `bench loop`) runs the real
workloads of slurmguard.workloads.

Run under Slurm (`srun python -m slurmguard_dev.devcluster.train ...`): rank,
world size and local rank come from SLURM_PROCID / SLURM_NTASKS /
SLURM_LOCALID, gloo over 127.0.0.1 (every dev-cluster node is this host).
It checkpoints every --ckpt-every iterations and on SIGUSR1, and resumes from
the checkpoint after a requeue.
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
    print(f"rank {rank}/{world} on {node}: starting at iteration {start}", flush=True)
    for it in range(start, args.iters):
        t0 = time.perf_counter()
        a = x
        for _ in range(args.work):
            a = torch.tanh(a @ w)
        # forward/backward "on the accelerator": modelled time, then the real
        # (small) model, whose backward() runs DDP's gradient all-reduce
        time.sleep(args.compute_ms / 1000.0)
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
