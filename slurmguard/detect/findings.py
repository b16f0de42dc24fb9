"""The one record every detector emits: a typed finding.

Detectors report conditions; one place decides (slurmguard.controller.decide,
node-problem-detector's split). A detector never picks a tier or names the
node to drain: it says what it saw about which subject, with the measured
evidence and its units, and when it knew.

Kinds and their detectors:
    step_time    the job's step detector (detect.steps via controller.assess):
                 current level against the learned baseline, with the onset
                 of an open slowdown. Emitted whenever a level is known, also
                 when it is not slower: "no slowdown" is a finding too.
    stall        no rank of the job completed a collective for
                 response.tiers.stall_s (controller.assess); the subject is the
                 rank with the least progress
    slow_rank    a rank whose compute grew beyond its own baseline and its
                 same-role peers' (controller.assess.localise)
    unlocalised  the job is judged but no node's compute explains it (why)
    telemetry    a device deviating from its peers on several signals
                 (detect.peers.PeerScorer), or a hard failure (XID, link down)

Pure dataclasses, no numpy: the prolog imports detect.peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    STEP_TIME = "step_time"
    STALL = "stall"
    SLOW_RANK = "slow_rank"
    SLOW_LINK = "slow_link"
    UNLOCALISED = "unlocalised"
    TELEMETRY = "telemetry"


class Severity(str, Enum):
    """How much the detector itself makes of it (the decision applies the policy).

    info: a measurement or a reason for no action; warning: a deviation beyond
    the detector's bar; critical: a hard failure or a stall."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Subject:
    """What a finding is about: a job, a node, a rank of a job, a device of a node."""

    job_id: int | None = None
    node: str | None = None
    rank: int | None = None
    device: str | None = None
    """gpu<N>, a NIC name, "host" or "node" (several devices of the node together)."""
    gpu: int | None = None
    """The CUDA device index a rank reported, when known."""

    def label(self) -> str:
        parts = []
        if self.job_id is not None:
            parts.append(f"job {self.job_id}")
        if self.node is not None:
            parts.append(f"node {self.node}")
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.device is not None:
            parts.append(self.device)
        return " ".join(parts) or "-"


@dataclass(frozen=True)
class Measure:
    """One piece of evidence: name, value and unit ("s", "s/step", "fraction",
    "epoch_s", "z", or the telemetry signal's own unit), and what it was compared
    with (reference, same unit), when it was."""

    name: str
    value: float
    unit: str
    reference: float | None = None


@dataclass(frozen=True)
class Finding:
    """kind, subject, evidence, severity, detected_at (Unix s: when the detector
    knew), the detector's name, an onset (Unix s) where it locates one, and a
    sentence for people (what `sinfo -R` and the incident show)."""

    kind: Kind
    subject: Subject
    detector: str
    detected_at: float
    severity: Severity = Severity.INFO
    evidence: tuple[Measure, ...] = ()
    onset: float | None = None
    text: str = ""

    def measure(self, name: str) -> Measure | None:
        return next((m for m in self.evidence if m.name == name), None)

    def value(self, name: str) -> float | None:
        m = self.measure(name)
        return None if m is None else m.value

    def to_dict(self) -> dict:
        return {
            "kind": self.kind.value,
            "subject": self.subject.label(),
            "detector": self.detector,
            "severity": self.severity.value,
            "detected_at": self.detected_at,
            "onset": self.onset,
            "evidence": [
                {
                    "name": m.name,
                    "value": m.value,
                    "unit": m.unit,
                    **({} if m.reference is None else {"reference": m.reference}),
                }
                for m in self.evidence
            ],
            "text": self.text,
        }
