"""A node's current episode out of service, read back from the database.

An episode starts when a node leaves `healthy` (drained by the controller, or taken by a
rolling sweep) and ends when the sweep gate returns it (or it reaches `terminal`). The
scheduler and the triage ladder decide their next step only from this record plus the
Slurm view, so a restarted controller continues where the old one stopped.

Rounds: every rung of the triage ladder ends in a new sweep round. A triage action
records the id of the newest sweep of the episode when it was taken (`after_sweep_id`),
so the sweeps of the current round are exactly those with a larger id.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from slurmguard.store import (
    NodeState,
    Store,
    SweepKind,
    SweepRecord,
    TriageActionRecord,
)
from slurmguard.sweeps.records import outcome_of
from slurmguard.sweeps.verdict import Outcome

ROLLING = "rolling"
"""Evidence key set on the transition that starts a rolling (unsuspected) sweep."""
PEER = "peer"
"""Evidence key (the hardware class) on a rolling start that sweeps a same-window peer."""
LAST_SWEEP = "last_sweep_id"
"""Evidence key on the return-to-healthy transition: sweeps up to this id are history."""
AFTER_SWEEP = "after_sweep_id"
"""Evidence key on triage actions: the round after this action has sweeps with larger ids."""


@dataclass(frozen=True)
class NodeEpisode:
    node: str
    state: NodeState
    started_at: datetime | None
    """When the node left healthy; None when it is healthy (no episode)."""
    rolling: bool
    """Started by a rolling sweep of a node nobody suspected."""
    sweeps: tuple[SweepRecord, ...]
    """This episode's sweeps, oldest first."""
    actions: tuple[TriageActionRecord, ...]
    """This episode's triage actions, oldest first."""

    @property
    def last_action(self) -> TriageActionRecord | None:
        return self.actions[-1] if self.actions else None

    @property
    def round_start(self) -> int:
        """Sweeps of the current round have ids above this."""
        a = self.last_action
        if a is None:
            return 0
        v = a.evidence.get(AFTER_SWEEP)
        return int(v) if isinstance(v, int) else 0

    @property
    def round_sweeps(self) -> tuple[SweepRecord, ...]:
        lo = self.round_start
        return tuple(s for s in self.sweeps if s.id > lo)

    @property
    def last_sweep_id(self) -> int:
        return max((s.id for s in self.sweeps), default=self.round_start)

    @property
    def suspected(self) -> bool:
        """A drained node, or a rolling node that already failed something, is suspected:
        it is never accepted as a bootstrap sample of its class."""
        if not self.rolling or self.actions:
            return True
        return any(outcome_of(s) == Outcome.FAIL.value for s in self.sweeps)

    def pending(self) -> SweepRecord | None:
        for s in reversed(self.sweeps):
            if outcome_of(s) is None:
                return s
        return None

    def round_kind(self, kind: SweepKind) -> list[SweepRecord]:
        return [s for s in self.round_sweeps if s.kind is kind]


def load_episode(store: Store, node: str) -> NodeEpisode:
    """The episode `node` is in (an empty one when it is healthy)."""
    history = store.node_history(node)
    start_idx = 0
    watermark = 0
    for i, t in enumerate(history):
        if t.to_state is NodeState.HEALTHY:
            start_idx = i + 1
            v = t.evidence.get(LAST_SWEEP) if isinstance(t.evidence, dict) else None
            watermark = int(v) if isinstance(v, int) else watermark
    state = history[-1].to_state if history else NodeState.HEALTHY
    rest = history[start_idx:]
    if not rest:
        return NodeEpisode(node, state, None, False, (), ())
    started = rest[0].at
    rolling = bool(isinstance(rest[0].evidence, dict) and rest[0].evidence.get(ROLLING))
    sweeps = tuple(s for s in store.sweeps(node=node, since=started) if s.id > watermark)
    actions = tuple(store.triage_actions(node, since=started))
    return NodeEpisode(node, state, started, rolling, sweeps, actions)
