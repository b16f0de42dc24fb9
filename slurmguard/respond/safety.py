"""Safety limits on slurmguard's own actions, derived from the audit log.

Circuit breaker (DESIGN.md "Rules that keep it safe"): at most
`max_nodes` nodes drained by slurmguard in the last `window_s`, cluster-wide,
and at most `max_partition_percent` of any partition; past either limit the
controller alerts and stops draining (a detector bug must not empty the
cluster). The percentage limit always allows one node per partition, else a
small partition could never lose a node. Requeues and checkpoint signals
count on their own: at most `breaker.max_job_actions` in the window, each one
checked when it is taken (a node drained once must not let every later cycle
requeue another job). Rate limit: at most `max_actions` Slurm actions of any
kind in `rate_limit.window_s`.

Both are computed from the audit log (successful drains and actions by the
controller's actor), not from memory, so a restarted controller counts what
it did before the restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurmguard.config import SafetyPolicy
from slurmguard.store import AuditOutcome, Store

#: Actions that count against the rate limit.
RATE_LIMITED = (
    "drain",
    "requeue",
    "signal",
    "comment",
    "reboot",
    "resume",
    "reservation_create",
    "reservation_delete",
    "submit",
    "clear_comment",
)


@dataclass(frozen=True)
class SafetyVerdict:
    allowed: bool
    why: str = ""


class SafetyGate:
    def __init__(self, store: Store, policy: SafetyPolicy, actor: str = "slurmguard") -> None:
        self.store = store
        self.policy = policy
        self.actor = actor

    def _ours(self, action: str | Sequence[str], window_s: float, now: float) -> list:
        rows = self.store.audit_entries(action=action, outcome=AuditOutcome.OK, since=now - window_s)
        return [r for r in rows if r.actor == self.actor]

    def drained_recently(self, now: float) -> set[str]:
        return {r.node for r in self._ours("drain", self.policy.breaker.window_s, now) if r.node}

    def may_drain(
        self, node: str, partition_members: Mapping[str, Sequence[str]], now: float
    ) -> SafetyVerdict:
        """May slurmguard drain `node` now? partition_members: partition -> its nodes."""
        b = self.policy.breaker
        recent = self.drained_recently(now)
        if node in recent:
            return SafetyVerdict(True)  # re-draining an already counted node adds nothing
        if len(recent) + 1 > b.max_nodes:
            return SafetyVerdict(
                False,
                f"circuit breaker: {len(recent)} node(s) drained by slurmguard "
                f"in the last {b.window_s:g}s (limit {b.max_nodes})",
            )
        for part, members in partition_members.items():
            if node not in members or not members:
                continue
            in_part = len(recent & set(members)) + 1
            limit = max(1, math.floor(b.max_partition_percent / 100.0 * len(members)))
            if in_part > limit:
                return SafetyVerdict(
                    False,
                    f"circuit breaker: partition {part} would have {in_part} of "
                    f"{len(members)} nodes drained by slurmguard (limit {limit}, "
                    f"{b.max_partition_percent:g}%)",
                )
        return self.may_act(now)

    def breaker_open(self, now: float) -> bool:
        """True while the breaker holds drains back: it raised an alert in the
        window and the drains counted in the window are still at the limit."""
        b = self.policy.breaker
        alerts = [
            r
            for r in self.store.audit_entries(action="alert", since=now - b.window_s)
            if r.actor == self.actor and (r.reason or "").startswith("circuit breaker")
        ]
        return bool(alerts) and len(self.drained_recently(now)) >= b.max_nodes

    def may_act_on_job(self, now: float) -> SafetyVerdict:
        """May slurmguard requeue or signal a job now (breaker for job actions, then rate)?"""
        b = self.policy.breaker
        n = len(self._ours(("requeue", "signal"), b.window_s, now))
        if n >= b.max_job_actions:
            return SafetyVerdict(
                False,
                f"circuit breaker: {n} requeue(s)/signal(s) by slurmguard in "
                f"the last {b.window_s:g}s (limit {b.max_job_actions})",
            )
        return self.may_act(now)

    def may_act(self, now: float) -> SafetyVerdict:
        r = self.policy.rate_limit
        n = len(self._ours(RATE_LIMITED, r.window_s, now))
        if n >= r.max_actions:
            return SafetyVerdict(
                False, f"rate limit: {n} actions in the last {r.window_s:g}s (limit {r.max_actions})"
            )
        return SafetyVerdict(True)
