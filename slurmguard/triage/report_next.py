"""The recommended next action for a node, derived from its state and history.

Pure function of records: the report and `node show` call it with what they read.
It names what slurmguard will do next on its own, or what a person has to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from slurmguard.config import TriagePolicy
from slurmguard.slurm.models import NodeInfo
from slurmguard.store import (
    ActionStatus,
    NodeState,
    SweepRecord,
    TriageActionRecord,
    Verdict,
)
from slurmguard.sweeps.rungs import entries_in_window, repeat_limit_reached, rung_after
from slurmguard.triage.report_model import NextAction

_OPEN = (ActionStatus.PLANNED, ActionStatus.RUNNING)


def _pending(sweeps: Sequence[SweepRecord]) -> SweepRecord | None:
    for s in reversed(sweeps):
        if s.verdict is Verdict.PENDING:
            return s
    return None


def _sweep_text(s: SweepRecord) -> str:
    job = f"job {s.slurm_job_id}" if s.slurm_job_id else "not yet submitted"
    return f"{s.kind.value} sweep in progress ({job})"


def recommend(
    name: str,
    state: NodeState | None,
    *,
    live: NodeInfo | None,
    slurm_reachable: bool,
    episode_sweeps: Sequence[SweepRecord],
    episode_triage: Sequence[TriageActionRecord],
    all_triage: Sequence[TriageActionRecord],
    now: datetime,
    policy: TriagePolicy,
) -> NextAction:
    """What should happen next to node `name`.

    `episode_*` are the rows since the node last became healthy; `all_triage` its
    whole triage history (for the repeat rule).
    """
    if live is not None and live.drained_by_others:
        who = f" by {live.reason_user}" if live.reason_user else ""
        return NextAction(
            "not_ours",
            f"drained{who} with a reason slurmguard did not write: not ours, the owner must "
            "act (slurmguard will not resume or re-reason it)",
        )
    if state is None:
        return NextAction("investigate", "not in the slurmguard database")
    pending = _pending(episode_sweeps)
    if state is NodeState.HEALTHY:
        return NextAction("none", "in service")
    if state is NodeState.TERMINAL:
        return NextAction(
            "replace",
            f"replace or repair the hardware; then `slurmguard node resume {name}` "
            "(the node is swept again before it takes work)",
        )
    if state is NodeState.SUSPECT:
        if pending is not None:
            return NextAction("sweep_running", _sweep_text(pending))
        return NextAction(
            "wait_verification",
            "wait for verification (the next detector windows confirm or clear it), "
            f"or drain and sweep now: `slurmguard node drain {name} --reason ...`",
        )
    if state is NodeState.DRAINING:
        if live is not None and live.jobs:
            jobs = ", ".join(map(str, live.jobs))
            return NextAction(
                "wait_job_exit", f"waits for job {jobs} to checkpoint/exit; then quarantine and sweep"
            )
        if live is None and not slurm_reachable:
            return NextAction(
                "wait_job_exit",
                "waits for its running job (if any) to checkpoint/exit, then quarantine and "
                "sweep (Slurm not reachable: job list unknown)",
            )
        return NextAction(
            "quarantine_next", "idle: the controller quarantines it and starts the sweeps next cycle"
        )
    if state is NodeState.QUARANTINED:
        if pending is not None:
            return NextAction("sweep_running", _sweep_text(pending))
        finals = [s for s in episode_sweeps if s.verdict is not Verdict.PENDING]
        if finals and finals[-1].verdict is Verdict.PASS:
            kinds = {s.kind.value for s in finals if s.verdict is Verdict.PASS}
            if {"1node", "2node"} <= kinds:
                return NextAction("return_to_service", "both sweeps passed: the gate returns it to service")
            missing = "2node" if "1node" in kinds else "1node"
            return NextAction("sweep_now", f"{missing} sweep still to run")
        return NextAction("sweep_now", "submit the 1-node and 2-node sweeps")
    # remediation: on the triage ladder
    entries = entries_in_window(all_triage, now, policy)
    if repeat_limit_reached(entries, policy):
        return NextAction(
            "replace",
            f"entered triage {entries} times within {policy.repeat_window_days:g} days "
            f"(limit {policy.repeat_limit}): replace, do not climb the ladder again",
        )
    running = [a for a in episode_triage if a.status in _OPEN]
    if running:
        a = running[-1]
        return NextAction(
            "rung_running", f"{a.rung.value} {a.status.value}" + (f": {a.detail}" if a.detail else "")
        )
    if pending is not None:
        return NextAction("sweep_running", _sweep_text(pending))
    done = [a for a in episode_triage if a.status not in _OPEN]
    last = done[-1].rung.value if done else None
    rung = rung_after(last, policy).value
    why = ""
    failed = [s for s in episode_sweeps if s.verdict in (Verdict.FAIL, Verdict.ERROR)]
    if failed and failed[-1].failure_reason:
        why = f" (after failed {failed[-1].kind.value} sweep: {failed[-1].failure_reason})"
    if rung == "terminal":
        return NextAction("replace", f"ladder exhausted{why}: replace")
    return NextAction("next_rung", f"next rung: {rung}{why}")
