"""Slurm actions with an audit row each: the one place slurmguard changes Slurm.

Every call records who asked, what, on which node/job, why, the outcome and
the evidence. In dry-run mode the action is logged and audited as `dry_run`
but Slurm is not touched. Refusals (NotOurs) and failures are audited too,
then re-raised for the caller to handle.

Write-ahead: before the Slurm call an intent (the action, its target, reason,
evidence with the lease epoch, and the store changes that go with it, its
"effects") is committed; after the call one transaction writes the audit row,
applies the effects and closes the intent. A controller that stops in between
(SIGKILL, its host or its database lost) leaves the intent open, and the next
controller's `reconcile` (every cycle, before any decision) settles it against
Slurm's state:

- the action shows in Slurm (a drain: the node drained by slurmguard; a
  requeue: the job's restart count grew; a sweep submit: its job in the queue;
  ...): the audit row is written now, at the intent's time, under the epoch it
  was taken with (`recorded_late`), and its effects applied;
- it does not: once the intent is older than `unsettled_s` (a fenced leader
  that is still alive may have its command on the way to Slurm until then, and
  no action on the same node or job is taken meanwhile: Unsettled), closed
  with an `error` row saying it was not taken; nothing is redone here, the
  decision that asked for it is taken again from Slurm's state and the
  database (a drain of a node still not drained, a requeue whose restart count
  did not grow, a sweep recorded with no job);
- Slurm keeps no trace of it (a checkpoint signal): recorded as taken
  (`unverified`), never sent twice.

An intent is closed once (Store.close_intent), so an action has exactly one
audit row, also when a fenced old leader finishes its call after the new one
reconciled it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from slurmguard.config import SlurmPolicy
from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.errors import SlurmError, UnknownJob, UnknownNode
from slurmguard.slurm.models import JobInfo, NodeInfo
from slurmguard.store import (
    AuditOutcome,
    IllegalTransition,
    IntentRecord,
    InvalidValue,
    NodeState,
    NotFound,
    Store,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Unsettled(SlurmError):
    """An earlier controller's action on the same node or job is not settled yet."""


#: audit and incident evidence: recorded by a later controller than the one that acted
LATE = "recorded_late"
#: audit evidence of a late row whose action Slurm keeps no trace of (a signal)
UNVERIFIED = "unverified"
#: node flags of a reboot asked for and not yet done (scontrol reboot)
REBOOT_FLAGS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED"})


# ---------------------------------------------------------------- effects
def lifecycle_effect(node: str, to: NodeState, cause: str, evidence: dict[str, Any]) -> dict[str, Any]:
    """The node's lifecycle moves to `to` with the action (skipped in dry-run)."""
    return {"kind": "lifecycle", "node": node, "to": to.value, "cause": cause[:250], "evidence": evidence}


def incident_effect(
    incident_id: int, *, status: str, outcome: str, stamp: Sequence[str] = ()
) -> dict[str, Any]:
    """The incident gets `status` and `outcome`, its action time and the evidence
    keys `stamp` set to when the action was taken."""
    return {"kind": "incident", "id": incident_id, "status": status, "outcome": outcome, "stamp": list(stamp)}


def sweep_effect(sweep_id: int) -> dict[str, Any]:
    """The sweep row gets the submitted job's id (the action's result)."""
    return {"kind": "sweep", "id": sweep_id}


def record_lifecycle(
    store: Store, node: str, to: NodeState, cause: str, evidence: dict[str, Any], actor: str
) -> None:
    """Move the node's lifecycle to `to` unless it is there; a step the lifecycle
    forbids is logged, not raised (it must not stop the loop)."""
    rec = store.get_or_create_node(node)
    if rec.state == to:
        return
    try:
        store.transition(node, to, cause[:250], evidence, actor=actor)
    except IllegalTransition as exc:
        log.warning("lifecycle %s -> %s for %s not recorded: %s", rec.state, to, node, exc)


def apply_effects(
    store: Store,
    effects: Sequence[Mapping[str, Any]],
    *,
    result: Any,
    at: float,
    late: bool,
    actor: str,
    dry_run: bool = False,
) -> None:
    """Apply an action's effects (at: Unix s the action was taken)."""
    for e in effects:
        kind = e.get("kind")
        if kind == "lifecycle":
            if not dry_run:
                record_lifecycle(store, e["node"], NodeState(e["to"]), e["cause"], dict(e["evidence"]), actor)
        elif kind == "incident":
            stamped: dict[str, Any] = {k: at for k in e.get("stamp", ())}
            store.update_incident(
                int(e["id"]),
                status=e["status"],
                action_at=at,
                outcome=e["outcome"],
                evidence={**stamped, **({LATE: True} if late else {})},
            )
        elif kind == "sweep":
            if result is not None:
                store.update_sweep(int(e["id"]), slurm_job_id=str(result), submitted_at=at)
        else:
            raise ValueError(f"action effect of unknown kind {kind!r}")


def unsettled_after(slurm: SlurmPolicy) -> float:
    """ActionExecutor.unsettled_s under `slurm` (policy.slurm): twice its command
    timeout (a command started just before its controller was fenced ends, or is
    killed, within one)."""
    return 2 * slurm.command_timeout_s


def _same_target(
    it: IntentRecord, action: str, node: str | None, job_id: int | None, reason: str | None
) -> bool:
    """Whether the open intent `it` acts on the node, job or reservation (named by
    the reason) an action is about to."""
    if node is not None and it.node == node or job_id is not None and it.job_id == str(job_id):
        return True
    resv = action.startswith("reservation_") and it.action.startswith("reservation_")
    return resv and reason is not None and it.reason == reason


@dataclass
class ActionExecutor:
    slurm: SlurmClient
    store: Store
    actor: str = "slurmguard"
    dry_run: bool = False
    fence: Callable[[], dict[str, Any]] | None = None
    """Called before every action (controller.lease.Lease.fence): raises (a
    SlurmError) when this controller may not act; what it returns (the lease
    epoch) goes into the action's audit evidence."""
    unsettled_s: float = 30.0
    """Seconds after an intent was written during which its command may still
    reach Slurm (its controller fenced but alive): unsettled_after(policy.slurm),
    which every executor built from a policy gets. Until then an intent Slurm does not show taken
    stays open, and its node or job is not acted on."""

    def _do(
        self,
        action: str,
        fn: Callable[[], T],
        *,
        node: str | None = None,
        job_id: int | None = None,
        reason: str | None = None,
        argv: list[str] | None = None,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
    ) -> T | None:
        if self.fence is not None:
            evidence = {**(evidence or {}), **self.fence()}
        common: dict[str, Any] = dict(
            actor=self.actor,
            node=node,
            job_id=None if job_id is None else str(job_id),
            reason=reason,
            argv=argv,
            evidence=evidence,
        )
        if self.dry_run:
            log.warning("dry-run: would %s node=%s job=%s reason=%r", action, node, job_id, reason)
            with self.store.atomic() as tx:
                tx.audit(action, outcome=AuditOutcome.DRY_RUN, **common)
                apply_effects(
                    tx,
                    effects,
                    result=None,
                    at=self.store.clock.now(),
                    late=False,
                    actor=self.actor,
                    dry_run=True,
                )
            return None
        for it in self.store.open_intents():
            if _same_target(it, action, node, job_id, reason):
                raise Unsettled(
                    f"{action} of {node or f'job {job_id}'} waits: the {it.action} of a stopped controller "
                    f"(intent {it.id}) is not settled yet"
                )
        intent = self.store.open_intent(action, effects=effects, **common)
        try:
            result = fn()
        except SlurmError as exc:
            self.store.close_intent(intent, outcome=AuditOutcome.ERROR, error=str(exc))
            log.error("%s failed: node=%s job=%s: %s", action, node, job_id, exc)
            raise
        text = result if isinstance(result, str) and action in ("drain", "comment", "reboot") else None
        # (the prefixed text Slurm actually holds replaces the reason asked for)
        self._complete(intent, result, reason=text, late=False)
        log.info("%s node=%s job=%s reason=%r", action, node, job_id, text or reason)
        return result

    def _complete(
        self,
        intent: IntentRecord,
        result: Any,
        *,
        reason: str | None = None,
        late: bool,
        evidence: dict[str, Any] | None = None,
    ) -> bool:
        """The action's audit row, its effects and the intent's close, in one
        transaction; False when another controller had closed it already. Effects
        that cannot be applied (their incident or sweep gone, a bad value) are
        logged and said in the audit row, which is written all the same: a bad
        record must not keep the action unrecorded (nor its target Unsettled)."""
        extra = dict(evidence or {})
        if intent.action == "submit" and result is not None:
            extra["submitted_job"] = result
        at = intent.at.timestamp() if late else self.store.clock.now()
        when = at if late else None
        try:
            with self.store.atomic() as tx:
                row = tx.close_intent(intent, outcome=AuditOutcome.OK, reason=reason, evidence=extra, at=when)
                if row is None:
                    return False
                apply_effects(tx, intent.effects, result=result, at=at, late=late, actor=self.actor)
            return True
        except (NotFound, InvalidValue, ValueError, KeyError, TypeError) as exc:
            why = f"{type(exc).__name__}: {exc}"[:400]
            log.error(
                "%s %s: its store changes not applied: %s", intent.action, intent.node or intent.job_id, why
            )
            extra["effects_failed"] = why
            return (
                self.store.close_intent(
                    intent, outcome=AuditOutcome.OK, reason=reason, evidence=extra, at=when
                )
                is not None
            )

    # ------------------------------------------------------------ reconciling
    def reconcile(self, nodes: Mapping[str, NodeInfo], jobs: Mapping[int, JobInfo]) -> list[str]:
        """Settle the intents a stopped controller left open against Slurm's state
        (nodes, jobs: the cycle's view); what was done, one line each. Fenced:
        only the active controller records (NotLeader otherwise)."""
        intents = self.store.open_intents()
        if not intents:
            return []
        now = self.fence() if self.fence is not None else {}
        by = {"recorded_by_epoch": now["lease_epoch"]} if "lease_epoch" in now else {}
        reservations: set[str] | None = None
        out = []
        for it in intents:
            if it.action.startswith("reservation_") and reservations is None:
                reservations = {r.name for r in self.slurm.reservations()}
            seen, result = self._seen(it, nodes, jobs, reservations or set())
            target = it.node or f"job {it.job_id}"
            if seen is False and self.store.clock.now() - it.at.timestamp() < self.unsettled_s:
                continue  # perhaps still on its way: settled on a later cycle
            if seen is False:
                if self.store.close_intent(
                    it,
                    outcome=AuditOutcome.ERROR,
                    error=f"not taken: its controller stopped before Slurm showed the {it.action}",
                    evidence={LATE: True, **by},
                    at=it.at,
                ):
                    out.append(f"{it.action} {target}: not taken")
                continue
            ev = {LATE: True, **by, **({UNVERIFIED: True} if seen is None else {})}
            if self._complete(it, result, late=True, evidence=ev):
                out.append(f"{it.action} {target}: recorded late")
        for line in out:
            log.warning("action left by a stopped controller: %s", line)
        return out

    def _seen(
        self,
        it: IntentRecord,
        nodes: Mapping[str, NodeInfo],
        jobs: Mapping[int, JobInfo],
        reservations: set[str],
    ) -> tuple[bool | None, Any]:
        """(whether Slurm shows the intent's action taken (None: it cannot tell),
        the action's result where it has one)."""
        a = it.action
        if a in ("drain", "resume", "comment", "clear_comment", "reboot") and it.node:
            n = nodes.get(it.node) or self._node(it.node)
            if n is None:
                return None, None
            if a == "drain":
                return n.drained_by_us, n.reason
            if a == "resume":
                return not n.drained, None
            if a == "reboot":  # asked for (a flag until it happens), or happened since
                booted = n.boot_time is not None and n.boot_time >= it.at.timestamp()
                return bool(n.flags & REBOOT_FLAGS) or booted, n.reason
            if a == "comment":
                return bool(n.comment and it.reason and it.reason in n.comment), n.comment
            return not n.comment, None
        if a in ("requeue", "cancel") and it.job_id:
            jid = int(it.job_id)
            j = jobs.get(jid) or self._job(jid)
            if a == "cancel":
                # a job in a final state (slurm.models.FINAL_JOB_STATES) has
                # nothing left for a cancel to do
                return j is None or j.ended, None
            if j is None or "restarts_before" not in it.evidence:
                return None, None
            return j.restarts > int(it.evidence["restarts_before"]), None
        if a == "submit" and it.evidence.get("job_name"):
            found = [j.job_id for j in jobs.values() if j.name == it.evidence["job_name"]]
            return (True, found[0]) if found else (False, None)
        if a == "reservation_create":
            return it.reason in reservations, None
        if a == "reservation_delete":
            return it.reason not in reservations, None
        return None, None  # a signal: Slurm keeps no trace of it

    def _node(self, name: str) -> NodeInfo | None:
        try:
            return self.slurm.node(name)
        except UnknownNode:
            return None

    def _job(self, job_id: int) -> JobInfo | None:
        try:
            return self.slurm.job(job_id)
        except UnknownJob:
            return None

    # ------------------------------------------------------------ actions
    def drain(
        self,
        node: str,
        reason: str,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
    ) -> str | None:
        return self._do(
            "drain",
            lambda: self.slurm.drain(node, reason),
            node=node,
            reason=reason,
            argv=["scontrol", "update", f"NodeName={node}", "State=DRAIN"],
            evidence=evidence,
            effects=effects,
        )

    def resume(self, node: str, evidence: dict[str, Any] | None = None) -> None:
        self._do(
            "resume",
            lambda: self.slurm.resume(node),
            node=node,
            argv=["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            evidence=evidence,
        )

    def comment(
        self,
        node: str,
        text: str,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
    ) -> str | None:
        return self._do(
            "comment",
            lambda: self.slurm.set_comment(node, text),
            node=node,
            reason=text,
            argv=["scontrol", "update", f"NodeName={node}", "Comment=..."],
            evidence=evidence,
            effects=effects,
        )

    def clear_comment(self, node: str, evidence: dict[str, Any] | None = None) -> None:
        self._do(
            "clear_comment",
            lambda: self.slurm.clear_comment(node),
            node=node,
            argv=["scontrol", "update", f"NodeName={node}", "Comment="],
            evidence=evidence,
        )

    def requeue(
        self,
        job_id: int,
        reason: str,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
        *,
        restarts: int | None = None,
    ) -> None:
        """restarts: the job's restart count now (read from Slurm when not given):
        a grown count tells a later controller that this requeue happened."""
        if restarts is None and not self.dry_run:
            try:
                restarts = self.slurm.job(job_id).restarts
            except UnknownJob:
                pass  # the requeue fails, audited as such
        self._do(
            "requeue",
            lambda: self.slurm.requeue(job_id),
            job_id=job_id,
            reason=reason,
            argv=["scontrol", "requeue", str(job_id)],
            evidence={**(evidence or {}), **({} if restarts is None else {"restarts_before": restarts})},
            effects=effects,
        )

    def cancel(
        self, job_id: int, reason: str, node: str | None = None, evidence: dict[str, Any] | None = None
    ) -> None:
        self._do(
            "cancel",
            lambda: self.slurm.cancel(job_id),
            job_id=job_id,
            node=node,
            reason=reason,
            argv=["scancel", str(job_id)],
            evidence=evidence,
        )

    def signal(
        self,
        job_id: int,
        signal: str,
        reason: str,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Signal the job's steps (where the ranks run), not the batch shell,
        which a USR1 without a trap would kill."""
        self._do(
            "signal",
            lambda: self.slurm.signal(job_id, signal, batch_only=False),
            job_id=job_id,
            reason=reason,
            argv=["scancel", f"--signal={signal}", str(job_id)],
            evidence=evidence,
            effects=effects,
        )

    def create_reservation(
        self, name: str, nodes: list[str], duration_min: int, evidence: dict[str, Any] | None = None
    ) -> None:
        self._do(
            "reservation_create",
            lambda: self.slurm.create_reservation(name, nodes, duration_min=duration_min),
            node=nodes[0] if len(nodes) == 1 else None,
            reason=name,
            argv=["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={','.join(nodes)}"],
            evidence=evidence,
        )

    def delete_reservation(
        self, name: str, node: str | None = None, evidence: dict[str, Any] | None = None
    ) -> None:
        self._do(
            "reservation_delete",
            lambda: self.slurm.delete_reservation(name),
            node=node,
            reason=name,
            argv=["scontrol", "delete", f"ReservationName={name}"],
            evidence=evidence,
        )

    def submit(
        self,
        script: str,
        *,
        node: str | None = None,
        reason: str,
        evidence: dict[str, Any] | None = None,
        effects: Sequence[dict[str, Any]] = (),
        **kwargs: Any,
    ) -> int | None:
        """kwargs: SlurmClient.submit's; its job_name goes into the evidence (a later
        controller finds the job by it)."""
        name = kwargs.get("job_name")
        return self._do(
            "submit",
            lambda: self.slurm.submit(script, **kwargs),
            node=node,
            reason=reason,
            argv=["sbatch", "--parsable"],
            evidence={**(evidence or {}), **({"job_name": name} if name else {})},
            effects=effects,
        )

    def reboot(
        self, node: str, reason: str, next_state: str = "resume", evidence: dict[str, Any] | None = None
    ) -> str | None:
        return self._do(
            "reboot",
            lambda: self.slurm.reboot(node, reason, next_state=next_state),
            node=node,
            reason=reason,
            argv=["scontrol", "reboot", "ASAP", f"nextstate={next_state.upper()}", node],
            evidence=evidence,
        )
