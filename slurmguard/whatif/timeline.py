"""Simulated timelines as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) opens.

Two process groups: the simulated original timeline (recorded durations) and
the simulated ideal one, one process per worker ("original dp0 pp1"), one
thread per stream (compute, dp-comm and the four PP streams). Steps are laid
end to end. Timestamps are microseconds, as the format requires. A path ending
in .gz is written gzip-compressed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from slurmguard.errors import InputError
from slurmguard.whatif import optypes as ot
from slurmguard.whatif.analysis import idealised_durations, simulation_durations
from slurmguard.whatif.model import build_model
from slurmguard.whatif.simulate import simulate
from slurmguard.whatif.tensor import OpTensor

_STREAMS = ("compute", "dp-comm") + ot.P2P


def _stream(optype: str) -> str:
    if optype in ot.P2P:
        return optype
    if optype in ot.DP_COMM:
        return "dp-comm"
    return "compute"


def timeline_events(t: OpTensor, steps: int = 2) -> list[dict[str, Any]]:
    """Trace events of the first `steps` steps, original and ideal."""
    model = build_model(t)
    original = simulation_durations(t, model)
    ideal = idealised_durations(t, original)
    k = max(1, min(steps, len(t.steps)))
    dur = np.stack(
        [original[:, :k], np.broadcast_to(ideal[:, None, None], original[:, :k].shape)],
        axis=1,
    )
    res = simulate(model, dur, keep_timeline=True)
    assert res.start is not None and res.end is not None
    pp, dp = t.meta.pp_size, t.meta.dp_size
    events: list[dict[str, Any]] = []
    tid = {name: i for i, name in enumerate(_STREAMS)}
    for sc, label in enumerate(("original", "ideal")):
        for s in range(pp):
            for d in range(dp):
                pid = sc * pp * dp + s * dp + d
                events.append(
                    {
                        "ph": "M",
                        "name": "process_name",
                        "pid": pid,
                        "args": {"name": f"{label} dp{d} pp{s} (rank {int(t.rank[s, d])})"},
                    }
                )
                events.append(
                    {
                        "ph": "M",
                        "name": "process_sort_index",
                        "pid": pid,
                        "args": {"sort_index": pid},
                    }
                )
                for name, i in tid.items():
                    events.append(
                        {
                            "ph": "M",
                            "name": "thread_name",
                            "pid": pid,
                            "tid": i,
                            "args": {"name": name},
                        }
                    )
        offset = 0.0
        for j in range(k):
            start = res.start[:, sc, j, :]
            end = res.end[:, sc, j, :]
            for slot in range(t.n_slots):
                name = str(t.slot_optype[slot])
                s = int(t.slot_stage[slot])
                for d in range(dp):
                    events.append(
                        {
                            "ph": "X",
                            "name": name,
                            "cat": _stream(name),
                            "pid": sc * pp * dp + s * dp + d,
                            "tid": tid[_stream(name)],
                            "ts": round((offset + start[slot, d]) * 1e6, 3),
                            "dur": round(max(end[slot, d] - start[slot, d], 0.0) * 1e6, 3),
                            "args": {
                                "step": int(t.steps[j]),
                                "seq_id": int(t.slot_seq[slot]),
                            },
                        }
                    )
            offset += float(res.step_time[sc, j])
    return events


def write_timeline(t: OpTensor, path: str | Path, steps: int = 2) -> Path:
    """Write the Perfetto-readable timeline JSON of the first `steps` steps; returns the path."""
    p = Path(path)
    doc = {
        "traceEvents": timeline_events(t, steps),
        "displayTimeUnit": "ms",
        "otherData": {
            "trace": t.source,
            "dp_size": t.meta.dp_size,
            "pp_size": t.meta.pp_size,
        },
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "wb") as fh:
                fh.write(data)
        else:
            p.write_bytes(data)
    except OSError as exc:
        raise InputError(f"{p}: cannot write timeline: {exc}") from None
    return p
