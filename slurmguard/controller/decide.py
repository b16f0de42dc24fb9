"""The one place that decides, from the detectors' findings about a job.

The detectors (the step detector, the stall rule and the compute localiser in
controller.assess, the peer scorer in detect.peers) each emit typed findings
(detect.findings) and decide nothing. Here the findings of one job become the
JobAssessment the response acts on: how slow (step_time), whether stalled
(stall), which nodes to blame (slow_rank; else the slow links' common node,
slow_link; else a stall's least-progress rank), with the telemetry of those
nodes as supporting evidence. The tier those figures call for is respond.tiers.classify (the
policy's thresholds), then the cost gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmguard.detect.findings import Finding, Kind
from slurmguard.respond.tiers import Culprit, JobAssessment


@dataclass(frozen=True)
class JobFindings:
    """What the detectors reported about one job in one cycle.

    rank_compute_s / rank_compute_ratio: every judged rank's recent compute
    (s per step) and its ratio to the rank's baseline, keyed "node/rank" (the
    measurements the slow_rank findings were drawn from; the micro-batch
    planner rebalances from them)."""

    job_id: int
    nodes: tuple[str, ...]
    ranks: int
    findings: tuple[Finding, ...] = ()
    rank_compute_s: dict[str, float] = field(default_factory=dict)
    rank_compute_ratio: dict[str, float] = field(default_factory=dict)
    slow_links: tuple[str, ...] = ()
    """The slow link ends (controller.links.slow_links' words), slowest first."""

    def of(self, kind: Kind) -> list[Finding]:
        return [f for f in self.findings if f.kind is kind]


def decide(jf: JobFindings) -> JobAssessment | None:
    """The job's assessment from its findings; None when there is nothing to
    judge (no step level yet and no stall)."""
    steps = next(iter(jf.of(Kind.STEP_TIME)), None)
    stall = next(iter(jf.of(Kind.STALL)), None)
    baseline = steps.value("baseline_s") if steps else (stall.value("baseline_s") if stall else None)
    current = steps.value("current_s") if steps else None
    if baseline is None or (current is None and stall is None):
        return None
    onset = steps.onset if steps else None
    stalled = (stall.value("quiet_s") or 0.0) if stall else 0.0
    if stall is not None and onset is None:
        onset = stall.onset
    telemetry: dict[str, list[str]] = {}
    for f in jf.of(Kind.TELEMETRY):
        if f.subject.node in jf.nodes:
            telemetry.setdefault(f.subject.node or "", []).append(f.text)
    culprits = []
    by_node: dict[str, list[Finding]] = {}
    for f in jf.of(Kind.SLOW_RANK):
        by_node.setdefault(f.subject.node or "", []).append(f)
    for node, found in sorted(by_node.items()):
        found.sort(key=lambda f: f.subject.rank or 0)
        first = found[0]
        culprits.append(
            Culprit(
                node=node,
                ranks=tuple(f.subject.rank for f in found if f.subject.rank is not None),
                gpu=first.subject.gpu,
                why=first.text,
                telemetry=tuple(telemetry.get(node, ())),
                named_for_s=max(f.value("named_for_s") or 0.0 for f in found),
            )
        )
    link = jf.of(Kind.SLOW_LINK)
    if not culprits and not stalled and link and link[0].subject.node is not None:
        # compute names nobody: the slow links' common node (Mycroft, Table 4: network time)
        node = link[0].subject.node
        culprits.append(
            Culprit(
                node=node,
                ranks=tuple(f.subject.rank for f in link if f.subject.rank is not None),
                why=link[0].text,
                telemetry=tuple(telemetry.get(node, ())),
            )
        )
    if not culprits and stall is not None and stall.subject.node is not None:
        # Mycroft: a stall names the rank with the least progress
        s = stall.subject
        culprits.append(
            Culprit(
                node=stall.subject.node,
                ranks=() if s.rank is None else (s.rank,),
                gpu=s.gpu,
                why=stall.text,
                telemetry=tuple(telemetry.get(stall.subject.node, ())),
            )
        )
    why_not = next((f.text for f in jf.of(Kind.UNLOCALISED)), None)
    return JobAssessment(
        job_id=jf.job_id,
        nodes=jf.nodes,
        gpus=jf.ranks,
        baseline_s=baseline,
        current_s=current,
        onset=onset,
        stalled_for_s=stalled,
        culprits=tuple(culprits),
        evidence={
            "ranks": jf.ranks,
            "baseline_s": round(baseline, 6),
            "current_s": None if current is None else round(current, 6),
            "rank_compute_ratio": {k: round(v, 4) for k, v in jf.rank_compute_ratio.items()},
            "rank_compute_s": {k: round(v, 6) for k, v in jf.rank_compute_s.items()},
            **({"localisation": why_not} if why_not and not culprits else {}),
            **({"slow_links": list(jf.slow_links), "link_localisation": link[0].text} if link else {}),
        },
    )
