"""Hardware classes and the choice of a reference node for a 2-node sweep.

Hardware class: the first Slurm node feature starting with
`SweepPolicy.hw_class_feature_prefix` (``hwclass=h100x8`` -> ``h100x8``), else the class
stored in the database for the node, else ``default``. Baselines, references and
results are always compared within one class.

Reference (Guard 5.3): another node of the same class that is healthy in the database,
free in Slurm (idle, not drained, no reservation, no reboot pending) and not taken by
another sweep this cycle. Trusted references (their own last sweep passed and they are
not the common element of recent pair failures) come first; a reference that already
gave an inconclusive result in this round is not asked again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slurmguard.config import SweepPolicy
from slurmguard.slurm.models import NodeInfo
from slurmguard.store import NodeRecord, NodeState
from slurmguard.sweeps.quarantine import is_free
from slurmguard.sweeps.verdict import PastSweep, ReferenceStatus, reference_status

DEFAULT_CLASS = "default"


def hw_class(live: NodeInfo | None, record: NodeRecord | None, policy: SweepPolicy) -> str:
    prefix = policy.hw_class_feature_prefix
    if live is not None and prefix:
        for f in live.features:
            if f.startswith(prefix) and len(f) > len(prefix):
                return f[len(prefix) :]
    if record is not None and record.hw_class:
        return record.hw_class
    return DEFAULT_CLASS


@dataclass(frozen=True)
class ReferenceChoice:
    node: str
    status: ReferenceStatus


def choose_reference(
    node: str,
    klass: str,
    *,
    live: Mapping[str, NodeInfo],
    records: Mapping[str, NodeRecord],
    reserved: set[str],
    taken: set[str],
    exclude: Iterable[str],
    history: Iterable[PastSweep],
    policy: SweepPolicy,
) -> ReferenceChoice | None:
    """The best free, healthy, same-class reference for `node`, or None (wait)."""
    skip = set(exclude) | taken | reserved | {node}
    hist = list(history)
    candidates = []
    for name, n in live.items():
        rec = records.get(name)
        if name in skip or rec is None or rec.state is not NodeState.HEALTHY:
            continue
        if not is_free(n) or hw_class(n, rec, policy) != klass:
            continue
        st = reference_status(name, hist, policy)
        candidates.append((not st.trusted, _natural(name), ReferenceChoice(name, st)))
    if not candidates:
        return None
    candidates.sort(key=lambda c: (c[0], c[1]))
    return candidates[0][2]


def _natural(name: str) -> tuple:
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
