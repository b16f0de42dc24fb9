"""census.py RING_DIR...: per ring, its GPU timing state and how many records
of each op (with their GPU flags) it holds; run_real.sh's summary."""

import os
import sys
from collections import Counter

from slurmguard.hook.ring import F_CAPTURED, F_GPU_TIME, F_NO_EVENT, RingReader

FLAGS = (("gpu", F_GPU_TIME), ("captured", F_CAPTURED), ("no_event", F_NO_EVENT))


def label(rec) -> str:
    flags = "+".join(name for name, bit in FLAGS if rec.flags & bit)
    return f"{rec.op_name}/{flags}" if flags else rec.op_name


for d in sys.argv[1:]:
    for n in sorted(os.listdir(d)):
        if n.endswith(".ring"):
            with RingReader(os.path.join(d, n)) as r:
                c = Counter(label(x) for x in r.records())
                print(
                    f"{os.path.basename(d)}/{n}: gpu_state {r.header.gpu_state_name} "
                    f"gpu_lost {r.header.gpu_lost}: {dict(sorted(c.items()))}"
                )
