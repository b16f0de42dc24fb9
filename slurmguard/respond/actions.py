"""Slurm actions with an audit row each: the one place slurmguard changes Slurm.

Every call records who asked, what, on which node/job, why, the outcome and
the evidence. In dry-run mode the action is logged and audited as `dry_run`
but Slurm is not touched. Refusals (NotOurs) and failures are audited too,
then re-raised for the caller to handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from slurmguard.slurm.client import SlurmClient
from slurmguard.slurm.errors import SlurmError
from slurmguard.store import AuditOutcome, Store

log = logging.getLogger(__name__)
T = TypeVar("T")


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
            self.store.audit(action, outcome=AuditOutcome.DRY_RUN, **common)
            return None
        try:
            result = fn()
        except SlurmError as exc:
            self.store.audit(action, outcome=AuditOutcome.ERROR, error=str(exc), **common)
            log.error("%s failed: node=%s job=%s: %s", action, node, job_id, exc)
            raise
        if isinstance(result, str) and action in ("drain", "comment", "reboot"):
            common["reason"] = result  # the prefixed text Slurm actually holds
        self.store.audit(action, outcome=AuditOutcome.OK, **common)
        log.info("%s node=%s job=%s reason=%r", action, node, job_id, common["reason"])
        return result

    def drain(self, node: str, reason: str, evidence: dict[str, Any] | None = None) -> str | None:
        return self._do(
            "drain",
            lambda: self.slurm.drain(node, reason),
            node=node,
            reason=reason,
            argv=["scontrol", "update", f"NodeName={node}", "State=DRAIN"],
            evidence=evidence,
        )

    def resume(self, node: str, evidence: dict[str, Any] | None = None) -> None:
        self._do(
            "resume",
            lambda: self.slurm.resume(node),
            node=node,
            argv=["scontrol", "update", f"NodeName={node}", "State=RESUME"],
            evidence=evidence,
        )

    def comment(self, node: str, text: str, evidence: dict[str, Any] | None = None) -> str | None:
        return self._do(
            "comment",
            lambda: self.slurm.set_comment(node, text),
            node=node,
            reason=text,
            argv=["scontrol", "update", f"NodeName={node}", "Comment=..."],
            evidence=evidence,
        )

    def clear_comment(self, node: str, evidence: dict[str, Any] | None = None) -> None:
        self._do(
            "clear_comment",
            lambda: self.slurm.clear_comment(node),
            node=node,
            argv=["scontrol", "update", f"NodeName={node}", "Comment="],
            evidence=evidence,
        )

    def requeue(self, job_id: int, reason: str, evidence: dict[str, Any] | None = None) -> None:
        self._do(
            "requeue",
            lambda: self.slurm.requeue(job_id),
            job_id=job_id,
            reason=reason,
            argv=["scontrol", "requeue", str(job_id)],
            evidence=evidence,
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

    def signal(self, job_id: int, signal: str, reason: str, evidence: dict[str, Any] | None = None) -> None:
        """Signal the job's steps (where the ranks run), not the batch shell,
        which a USR1 without a trap would kill."""
        self._do(
            "signal",
            lambda: self.slurm.signal(job_id, signal, batch_only=False),
            job_id=job_id,
            reason=reason,
            argv=["scancel", f"--signal={signal}", str(job_id)],
            evidence=evidence,
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
        **kwargs: Any,
    ) -> int | None:
        return self._do(
            "submit",
            lambda: self.slurm.submit(script, **kwargs),
            node=node,
            reason=reason,
            argv=["sbatch", "--parsable"],
            evidence=evidence,
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
