"""How a training process ends once its work is done and recorded.

gloo's worker threads can race the interpreter's finalisation: a process that
has printed its results and called ``destroy_process_group`` may still abort
with ``terminate called without an active exception`` while Python tears
down (pytorch/pytorch issue 190489; the atexit fix proposed upstream was
abandoned). A job that has nothing left to do avoids the race by leaving
without finalisation: synchronise, destroy the process group (the
slurmguard torch hook writes its last records there), flush stdio, then
``os._exit``. Training scripts can apply the same three lines themselves.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def finish(code: int = 0, *, barrier: bool = True) -> NoReturn:
    """End this rank with exit status ``code`` and no interpreter finalisation.

    barrier: wait for every rank first (default True), so no rank tears its
    process group down while a peer still talks to it.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
    except Exception as exc:  # the job's results are already out: report, keep its status
        print(f"teardown: {exc!r}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
