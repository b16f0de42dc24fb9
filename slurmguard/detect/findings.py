"""Decision-ready findings: "job J is X% slower since t, caused by node N / link
N-M / GPU g, with this evidence".

`localise` joins the localisers (Mycroft stall and late-rank rules, Greyhound
cross-group comparison, peer-relative telemetry flags) into ranked culprits,
mapped to nodes and GPUs through the job layout; `job_finding` attaches them to
the step-time change found by BOCD. The controller turns a Finding into a
response tier; the agent can build one from what it sees on its node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmguard.config import DetectionPolicy
from slurmguard.detect.bocd import ChangePoint
from slurmguard.detect.steps import Episode
from slurmguard.detect.crossgroup import group_times, slow_groups, suspects
from slurmguard.detect.mycroft import find_stall, late_ranks
from slurmguard.detect.peers import PeerFlag
from slurmguard.detect.records import JobLayout, RankOps


@dataclass(frozen=True)
class Culprit:
    """kind: "gpu", "node", "link" or "nic". weight orders culprits (higher first)."""

    kind: str
    node: str
    gpu: int | None = None
    peer_node: str | None = None
    nic: str | None = None
    rank: int | None = None
    weight: float = 1.0
    evidence: tuple[str, ...] = ()

    def label(self) -> str:
        if self.kind == "link":
            return f"link {self.node}-{self.peer_node}"
        if self.kind == "gpu":
            return f"GPU {self.gpu} of node {self.node}" if self.gpu is not None else f"node {self.node}"
        if self.kind == "nic":
            return f"NIC {self.nic} of node {self.node}"
        return f"node {self.node}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "node": self.node, "gpu": self.gpu, "peer_node": self.peer_node,
                "nic": self.nic, "rank": self.rank, "weight": self.weight, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class Finding:
    """What the detectors concluded about one job.

    kind: "slowdown" (step time up), "stall" (no progress) or "hardware"
    (a hard failure on a node of the job). slowdown is a fraction (0.15 =
    15% slower); since is a Unix time (s) and since_iteration the iteration
    index of the onset.
    """

    job_id: str
    kind: str
    slowdown: float = 0.0
    since: float | None = None
    since_iteration: int | None = None
    baseline_step_s: float | None = None
    current_step_s: float | None = None
    recovered: bool = False
    culprits: tuple[Culprit, ...] = ()
    evidence: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        cause = ", ".join(c.label() for c in self.culprits[:3]) or "cause not localised"
        if self.kind == "stall":
            head = f"job {self.job_id} is stalled"
        elif self.kind == "hardware":
            head = f"job {self.job_id} runs on failing hardware"
        else:
            head = f"job {self.job_id} is {self.slowdown:.0%} slower"
            if self.recovered:
                head = f"job {self.job_id} was {self.slowdown:.0%} slower (recovered)"
        if self.since is not None:
            head += f" since t={self.since:.0f}"
        if self.since_iteration is not None:
            head += f" (iteration {self.since_iteration})"
        return f"{head}, caused by {cause}"

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "kind": self.kind, "slowdown": self.slowdown, "since": self.since,
                "since_iteration": self.since_iteration, "baseline_step_s": self.baseline_step_s,
                "current_step_s": self.current_step_s, "recovered": self.recovered,
                "culprits": [c.to_dict() for c in self.culprits], "evidence": list(self.evidence),
                "summary": self.summary()}


def localise(layout: JobLayout, ops: list[RankOps] | None = None, now_ns: int | None = None,
             peer_flags: list[PeerFlag] | None = None, policy: DetectionPolicy | None = None,
             since_ns: int = 0) -> tuple[list[Culprit], bool]:
    """Ranked culprits for a job, and whether it is stalled.

    Weights: a stall's least-progress rank 4, a hard hardware failure 4, a
    constantly late rank 3, a peer-flagged device 2, a slow group's suspects 1
    (a place named by several localisers adds up).
    """
    p = policy or DetectionPolicy()
    score: dict[tuple, list] = {}
    stalled = False

    def add(key: tuple, culprit: Culprit, w: float, why: str) -> None:
        if key in score:
            score[key][1] += w
            score[key][2].append(why)
        else:
            score[key] = [culprit, w, [why]]

    job_nodes = set(layout.nodes)
    if ops:
        if now_ns is not None:
            st = find_stall(ops, now_ns, p.mycroft)
            if st is not None:
                stalled = True
                r = st.culprit
                node, gpu = layout.node_of(r), layout.gpu_of(r)
                add(("gpu", node, gpu), Culprit("gpu", node, gpu, rank=r), 4.0,
                    f"stall on communicator {st.comm}: rank {r} made the least progress "
                    f"({st.progress[r]} ops vs max {max(st.progress.values())}); "
                    f"ranks {list(st.waiting)} wait inside the collective")
        for lr in late_ranks(ops, p.mycroft, since_ns=since_ns):
            node, gpu = layout.node_of(lr.rank), layout.gpu_of(lr.rank)
            add(("gpu", node, gpu), Culprit("gpu", node, gpu, rank=lr.rank), 3.0,
                f"rank {lr.rank} {lr.which}s collectives on communicator {lr.comm} "
                f"{lr.median_late_s:.2f} s after its peers in {lr.fraction:.0%} of {lr.instances}")
        times = group_times(ops, since_ns)
        slow = slow_groups(times, p.cross_group)
        if slow:
            sus = suspects(slow, times, layout)
            worst = slow[0]
            why = (f"communicator {worst.comm} (op {worst.op}, {worst.nbytes} B) takes "
                   f"{worst.seconds * 1e3:.2f} ms, {worst.excess:.0%} above the median of "
                   f"{worst.cluster_size} comparable groups")
            for node, gpu in sus.gpus:
                add(("gpu", node, gpu), Culprit("gpu", node, gpu), 1.0, why)
            for a, b in sus.links:
                add(("link", a, b), Culprit("link", a, peer_node=b), 1.0, why)
    for f in peer_flags or []:
        if f.node not in job_nodes:
            continue
        w = 4.0 if f.hard else 2.0
        if f.device.startswith("gpu"):
            g = int(f.device[3:])
            add(("gpu", f.node, g), Culprit("gpu", f.node, g), w, "; ".join(f.reasons))
        elif f.device in ("node", "host"):
            add(("node", f.node), Culprit("node", f.node), w, "; ".join(f.reasons))
        else:
            add(("nic", f.node, f.device), Culprit("nic", f.node, nic=f.device), w, "; ".join(f.reasons))
    ranked = sorted(score.values(), key=lambda e: -e[1])
    out = [Culprit(c.kind, c.node, c.gpu, c.peer_node, c.nic, c.rank, w, tuple(why))
           for c, w, why in ranked]
    return out, stalled


def job_finding(job_id: str, change: ChangePoint | Episode | None, culprits: list[Culprit],
                stalled: bool = False, step_end_s: list[float] | None = None,
                evidence: list[str] | None = None) -> Finding | None:
    """Attach culprits to the job's step-time change (or stall).

    step_end_s: Unix time at which each iteration ended, to turn the onset
    iteration into a time. Returns None when there is nothing to report.
    """
    ev = list(evidence or [])
    if stalled:
        return Finding(job_id, "stall", culprits=tuple(culprits), evidence=tuple(ev))
    if change is None:
        if any(c.weight >= 4.0 for c in culprits):
            return Finding(job_id, "hardware", culprits=tuple(culprits), evidence=tuple(ev))
        return None
    if isinstance(change, ChangePoint):
        onset, slow, base, cur, rec = (change.index, change.relative_change, change.level_before,
                                       change.level_after, False)
        ev.append(f"step time {base:.3f} s -> {cur:.3f} s at iteration {onset} "
                  f"(verified over {change.detected_at - change.index + 1} iterations)")
    else:
        onset, slow, base, cur, rec = (change.onset, change.slowdown, change.baseline,
                                       change.level_s, change.recovery is not None)
        ev.append(f"step time {base:.3f} s -> {cur:.3f} s from iteration {onset}"
                  + (f" until {change.recovery}" if rec else ""))
    since = step_end_s[onset] if step_end_s is not None and 0 <= onset < len(step_end_s) else None
    return Finding(job_id, "slowdown", slow, since, onset, base, cur, rec, tuple(culprits), tuple(ev))
