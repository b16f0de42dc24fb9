"""Node lifecycle states and the transitions slurmguard may make on its own.

DESIGN.md "Node lifecycle":
healthy -> suspect (pending verification) -> draining -> quarantined (sweeping)
-> healthy | remediation (reboot/reimage, then sweep again) | terminal (replace).

Anything outside ALLOWED (leaving terminal, skipping the sweep gate back to
healthy, ...) needs an explicit admin override (`force=True`), and the
override is recorded on the transition row.
"""

from __future__ import annotations

from enum import StrEnum

from slurmguard.store.errors import IllegalTransition


class NodeState(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    """Pending verification: node Comment set, still schedulable."""
    DRAINING = "draining"
    """Drained in Slurm; running work continues, nothing new lands."""
    QUARANTINED = "quarantined"
    """Idle, in its maintenance reservation, being swept."""
    REMEDIATION = "remediation"
    """Failed a sweep; on the triage ladder (re-sweep, reboot, reimage)."""
    TERMINAL = "terminal"
    """To be replaced. Only an admin brings a node back from here."""


S = NodeState

ALLOWED: dict[NodeState, frozenset[NodeState]] = {
    # A healthy node is marked suspect (no impact yet), drained straight away
    # (moderate/severe tier), or quarantined directly by a rolling sweep.
    S.HEALTHY: frozenset({S.SUSPECT, S.DRAINING, S.QUARANTINED}),
    # Verification clears a suspect or confirms it.
    S.SUSPECT: frozenset({S.HEALTHY, S.DRAINING, S.QUARANTINED}),
    # A drained node is swept once idle; a hard error (XID, dead NIC) may send
    # it to remediation at once, and the repeat rule to terminal.
    S.DRAINING: frozenset({S.QUARANTINED, S.REMEDIATION, S.TERMINAL}),
    # The sweep gate: pass -> healthy; fail -> triage ladder or replace.
    S.QUARANTINED: frozenset({S.HEALTHY, S.REMEDIATION, S.TERMINAL, S.DRAINING}),
    # Every remediation rung ends in a new sweep, or in giving up.
    S.REMEDIATION: frozenset({S.QUARANTINED, S.TERMINAL}),
    S.TERMINAL: frozenset(),
}

INITIAL_STATE = NodeState.HEALTHY


def parse_state(value: str | NodeState) -> NodeState:
    """NodeState from its string, or IllegalTransition naming the bad value."""
    try:
        return NodeState(value)
    except ValueError:
        names = ", ".join(s.value for s in NodeState)
        raise IllegalTransition(f"unknown node state '{value}' (one of: {names})") from None


def check_transition(node: str, from_state: NodeState, to_state: NodeState, *, force: bool = False) -> None:
    """Raise IllegalTransition unless from_state -> to_state is allowed.

    `force` (admin override) allows any change of state, never a no-op one.
    """
    if from_state == to_state:
        raise IllegalTransition(f"node {node}: already {to_state.value}")
    if force or to_state in ALLOWED[from_state]:
        return
    allowed = ", ".join(sorted(s.value for s in ALLOWED[from_state])) or "none without an admin override"
    raise IllegalTransition(
        f"node {node}: illegal transition {from_state.value} -> {to_state.value} "
        f"(allowed from {from_state.value}: {allowed}; use an admin override to force it)"
    )
