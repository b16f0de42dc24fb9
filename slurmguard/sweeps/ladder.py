"""The triage ladder (Guard 6, Fig. 10): what happens to a node that failed its sweeps.

Rungs come from `TriagePolicy.ladder` (default resweep, reboot, reimage, terminal), each
more invasive than the last; every rung except terminal ends in a new sweep round
(lifecycle remediation -> quarantined). Guard's repeat rule: a node entering triage for
the `repeat_limit`-th time within `repeat_window_days` goes straight to terminal. Both
rules are the pure functions of triage/rungs.py, which the report's "what next" shows.

Bookkeeping lives in the database, so a restarted controller continues the same rung:

* a rung is a triage action row: planned -> running -> done | failed | skipped; the first
  action of an episode has is_entry=True (what the repeat rule counts);
* every action carries `after_sweep_id` (the sweep round it starts comes after that id)
  and `failed_sweep` (the sweep whose failure it answers), which makes entering the
  ladder idempotent: a second attempt for the same failed sweep records nothing new;
* reboot: evidence `boot_time_before` and `issued`; the reboot is issued only while the
  node shows neither a reboot flag nor a newer boot time, so a restart never reboots a
  node twice. Done when Slurm reports a boot time after the request and no reboot flag;
  failed after `reboot_timeout_s` (e.g. a node that never comes back);
* reimage: the site command (`reimage_command` + node name) runs through the command
  runner with `reimage_timeout_s`; it should start the reimage and return. No command
  configured -> the rung is skipped with a row saying so. A reimage found `running` after
  a controller restart is marked failed (outcome unknown) rather than run twice;
* terminal: drained with a reason saying "replace", quarantine reservation removed (the
  drain keeps it out), lifecycle terminal. Only an admin brings it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slurmguard.clock import Clock
from slurmguard.config import TriagePolicy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.runner import CommandError, CommandRunner, SubprocessRunner
from slurmguard.slurm.errors import NotOurs, SlurmError
from slurmguard.slurm.models import NodeInfo
from slurmguard.store import (
    ActionStatus,
    NodeState,
    Store,
    TriageActionRecord,
    TriageRung,
)
from slurmguard.sweeps.episode import AFTER_SWEEP, NodeEpisode
from slurmguard.sweeps.quarantine import REBOOT_FLAGS
from slurmguard.sweeps.rungs import entries_in_window, entry_rung, rung_after, window_start
from slurmguard.sweeps.verdict import make_reason

log = logging.getLogger(__name__)

FAILED_SWEEP = "failed_sweep"
OPEN = (ActionStatus.PLANNED, ActionStatus.RUNNING)


@dataclass(frozen=True)
class LadderStep:
    """One decision of the ladder for one node (typed record between decide and apply)."""

    node: str
    action: str
    """enter | start | poll | finish | next_rung | blocked"""
    why: str
    rung: TriageRung | None = None
    data: dict[str, Any] = field(default_factory=dict)


class TriageLadder:
    """Enters, advances and executes the ladder for nodes in `remediation`.

    delete_quarantine: callback removing the node's quarantine reservation (terminal).
    """

    def __init__(
        self,
        policy: TriagePolicy,
        store: Store,
        executor: ActionExecutor,
        clock: Clock,
        *,
        runner: CommandRunner | None = None,
        actor: str = "slurmguard",
        delete_quarantine: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.store = store
        self.executor = executor
        self.clock = clock
        self.runner = runner or SubprocessRunner()
        self.actor = actor
        self.delete_quarantine = delete_quarantine or (lambda node: None)

    # ------------------------------------------------------------------ entering
    def next_rung(self, episode: NodeEpisode) -> tuple[TriageRung, bool, str, int]:
        """(rung, is_entry, why, entry_count) for the failure that ends the current round."""
        if episode.actions:
            last = episode.actions[-1].rung
            return rung_after(last, self.policy), False, f"next rung after {last.value}", 0
        since = window_start(self.clock.now(), self.policy)
        earlier = entries_in_window(
            self.store.recent_triage_entries(episode.node, since), self.clock.now(), self.policy
        )
        rung, why, count = entry_rung(earlier, self.policy)
        return rung, True, why, count

    def enter(
        self,
        node: str,
        episode: NodeEpisode,
        *,
        failed_sweep: int | None,
        reason: str,
        evidence: dict[str, Any] | None = None,
    ) -> TriageActionRecord:
        """A sweep round failed (or a hard error): plan the next rung and move the node to
        remediation. Idempotent per failed sweep."""
        last = episode.last_action
        if last is not None and failed_sweep is not None and last.evidence.get(FAILED_SWEEP) == failed_sweep:
            action = last
        else:
            rung, entry, why, count = self.next_rung(episode)
            ev = {
                AFTER_SWEEP: episode.last_sweep_id,
                FAILED_SWEEP: failed_sweep,
                "reason": reason,
                "why": why,
                **({"entry_count": count} if entry else {}),
                **(evidence or {}),
            }
            action = self.store.add_triage_action(
                node,
                rung,
                is_entry=entry,
                status=ActionStatus.PLANNED,
                detail=f"{why}; after: {reason}"[:500],
                evidence=ev,
            )
            log.info("triage %s: %s planned (%s)", node, rung.value, why)
        if episode.state is not NodeState.REMEDIATION:
            self.store.transition(
                node,
                NodeState.REMEDIATION,
                f"triage: {action.rung.value} after {reason}"[:250],
                {
                    "triage_action": action.id,
                    "rung": action.rung.value,
                    FAILED_SWEEP: failed_sweep,
                    **(evidence or {}),
                },
                actor=self.actor,
            )
        return action

    # ------------------------------------------------------------------ remediation
    def decide(self, node: str, live: NodeInfo | None, episode: NodeEpisode) -> LadderStep:
        a = episode.last_action
        if a is None:
            rung, _, why, _ = self.next_rung(episode)
            return LadderStep(node, "enter", f"in remediation without a rung: {why}", rung)
        if a.status is ActionStatus.PLANNED:
            if live is not None and live.drained_by_others and a.rung is not TriageRung.TERMINAL:
                return LadderStep(
                    node,
                    "blocked",
                    f"{a.rung.value} planned, but the node is taken out"
                    f" by someone else ({live.reason!r}): not ours",
                    a.rung,
                )
            return LadderStep(node, "start", f"{a.rung.value} planned", a.rung)
        if a.status is ActionStatus.RUNNING:
            return LadderStep(node, "poll", f"{a.rung.value} running", a.rung)
        if a.status is ActionStatus.DONE:
            return LadderStep(node, "finish", f"{a.rung.value} done", a.rung)
        return LadderStep(node, "next_rung", f"{a.rung.value} {a.status.value}", a.rung)

    def apply(self, step: LadderStep, live: NodeInfo | None, episode: NodeEpisode) -> str:
        node = step.node
        a = episode.last_action
        if step.action == "enter":
            act = self.enter(node, episode, failed_sweep=None, reason="remediation requested")
            return f"triage: {act.rung.value} planned"
        assert a is not None
        if step.action == "next_rung":
            rung, _, why, _ = self.next_rung(episode)
            act = self.store.add_triage_action(
                node,
                rung,
                status=ActionStatus.PLANNED,
                detail=f"{why} ({a.status.value})",
                evidence={AFTER_SWEEP: episode.last_sweep_id, "after_action": a.id, "why": why},
            )
            return f"triage: {rung.value} planned after {a.rung.value} {a.status.value} (action {act.id})"
        if step.action == "finish":
            return self._finish(node, a)
        if a.rung is TriageRung.RESWEEP:
            self.store.update_triage_action(a.id, status=ActionStatus.DONE, detail="sweep again")
            return self._finish(node, a)
        if a.rung is TriageRung.REBOOT:
            return self._reboot(node, live, a)
        if a.rung is TriageRung.REIMAGE:
            return self._reimage(node, a)
        return self._terminal(node, live, a)

    def _finish(self, node: str, a: TriageActionRecord) -> str:
        if a.rung is TriageRung.TERMINAL:
            self.store.transition(
                node,
                NodeState.TERMINAL,
                f"triage: terminal: {a.detail or 'replace'}"[:250],
                {"triage_action": a.id, **a.evidence},
                actor=self.actor,
            )
            return "terminal"
        self.store.transition(
            node,
            NodeState.QUARANTINED,
            f"triage: {a.rung.value} done; sweep again",
            {"triage_action": a.id, "rung": a.rung.value},
            actor=self.actor,
        )
        return f"{a.rung.value} done; sweeping again"

    # ------------------------------------------------------------------ rungs
    def _fail(self, a: TriageActionRecord, why: str, evidence: dict[str, Any] | None = None) -> str:
        self.store.update_triage_action(a.id, status=ActionStatus.FAILED, detail=why[:500], evidence=evidence)
        log.warning("triage %s failed: %s", a.rung.value, why)
        return f"{a.rung.value} failed: {why}"

    def _reboot(self, node: str, live: NodeInfo | None, a: TriageActionRecord) -> str:
        if live is None:
            return self._fail(a, "node unknown to Slurm")
        now = self.clock.now()
        ev = a.evidence
        if a.status is ActionStatus.PLANNED:
            if live.drained_by_others:
                return self._fail(a, f"taken out by someone else ({live.reason!r}); not rebooting it")
            a = self.store.update_triage_action(
                a.id,
                status=ActionStatus.RUNNING,
                evidence={"boot_time_before": live.boot_time, "issued": False, "requested_at": now},
            )
            ev = a.evidence
        before = ev.get("boot_time_before")
        rebooted = before is not None and live.boot_time is not None and live.boot_time > before
        if not ev.get("issued"):
            if rebooted or live.flags & REBOOT_FLAGS:
                # issued by a controller that stopped before it could record so
                self.store.update_triage_action(
                    a.id, status=ActionStatus.RUNNING, evidence={"issued": True, "issued_at": now}
                )
            else:
                reason = make_reason(
                    f"triage reboot: {ev.get('reason') or 'sweep failed'!s}".replace("slurmguard: ", "")
                )
                try:
                    self.executor.reboot(
                        node,
                        reason,
                        next_state=self.policy.reboot_next_state,
                        evidence={"triage_action": a.id},
                    )
                except NotOurs as exc:
                    return self._fail(a, str(exc))
                except SlurmError as exc:
                    return self._fail(a, f"scontrol reboot failed: {exc}")
                self.store.update_triage_action(
                    a.id, status=ActionStatus.RUNNING, evidence={"issued": True, "issued_at": now}
                )
                return f"reboot issued (next state {self.policy.reboot_next_state})"
        if rebooted and not (live.flags & REBOOT_FLAGS):
            self.store.update_triage_action(
                a.id,
                status=ActionStatus.DONE,
                detail="rebooted",
                evidence={"boot_time_after": live.boot_time},
            )
            return self._finish(node, a)
        if not (live.flags & REBOOT_FLAGS) and a.status is ActionStatus.RUNNING and ev.get("issued"):
            # Slurm dropped the request (22.05 returns a node that keeps answering to service
            # after ResumeTimeout) without a new boot time: the node was not rebooted
            return self._fail(
                a,
                f"Slurm cleared the reboot request but the boot time did not change"
                f" (Slurm: {live.state_text}); not rebooted",
                {"state_at_fail": live.state_text, "boot_time": live.boot_time},
            )
        issued_at = ev.get("issued_at") or ev.get("requested_at") or now
        if now - float(issued_at) > self.policy.reboot_timeout_s:
            return self._fail(
                a,
                f"reboot not completed within {self.policy.reboot_timeout_s:g}s"
                f" (Slurm: {live.state_text}, reason {live.reason!r})",
                {"state_at_timeout": live.state_text, "reason_at_timeout": live.reason},
            )
        if live.drained_by_others:
            return self._fail(
                a, f"Slurm took the node out during the reboot ({live.reason!r}); needs an admin"
            )
        return f"waiting for reboot ({live.state_text})"

    def _reimage(self, node: str, a: TriageActionRecord) -> str:
        argv = list(self.policy.reimage_command)
        if a.status is ActionStatus.RUNNING:
            return self._fail(a, "controller restarted while the reimage command ran; outcome unknown")
        if not argv:
            self.store.update_triage_action(
                a.id, status=ActionStatus.SKIPPED, detail="skipped: triage.reimage_command is empty"
            )
            return "reimage skipped (no reimage_command)"
        argv.append(node)
        self.store.update_triage_action(
            a.id, status=ActionStatus.RUNNING, evidence={"argv": argv, "started_at": self.clock.now()}
        )
        self.store.audit("reimage", actor=self.actor, node=node, reason="triage reimage", argv=argv)
        try:
            res = self.runner.run(argv, timeout=self.policy.reimage_timeout_s, check=True)
        except CommandError as exc:
            return self._fail(
                a, f"reimage command failed: {exc}"[:400], {"stderr": (exc.stderr or "")[-1000:]}
            )
        self.store.update_triage_action(
            a.id,
            status=ActionStatus.DONE,
            detail="reimage command succeeded",
            evidence={"stdout": res.stdout[-1000:]},
        )
        return self._finish(node, a)

    def _terminal(self, node: str, live: NodeInfo | None, a: TriageActionRecord) -> str:
        why = a.detail or "triage ladder exhausted"
        reason = make_reason(f"terminal: replace node ({why.split(';')[0]})")
        note = ""
        if live is not None and not live.drained_by_others:
            if not (live.drained_by_us and (live.reason or "").startswith(reason)):
                try:
                    self.executor.drain(node, reason, evidence={"triage_action": a.id})
                except NotOurs as exc:
                    note = f"; not drained: {exc}"
        elif live is not None:
            note = f"; left as drained by someone else ({live.reason!r})"
        self.delete_quarantine(node)
        self.store.update_triage_action(
            a.id, status=ActionStatus.DONE, detail=f"{why}{note}"[:500], evidence={"drain_reason": reason}
        )
        return self._finish(node, a)
