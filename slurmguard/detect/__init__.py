"""Detectors: iteration period and step time, change points, localisation, peers.

Public API (inputs are plain numpy arrays / small dataclasses, not ring records):
    RankOps, RankPlace, JobLayout                       (records)
    rank_period, step_times, find_period, acf           (period)
    BatchBocd, detect_changepoints, ChangePoint                       (bocd)
    StepDetector, DetectorConfig, detect_steps, Episode, Profile      (steps)
    PeerScorer, PeerFlag, hard_failures                 (peers)
    Finding, Kind, Severity, Subject, Measure           (findings: what every detector emits)
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): the prolog reaches detect.peers.hard_failures and
# must not pay for numpy, which bocd, period etc. load at import time.
_WHERE = {
    "bocd": ("BatchBocd", "ChangePoint", "detect_changepoints"),
    "steps": ("DetectorConfig", "Episode", "Profile", "StepDetector", "detect_steps"),
    "findings": ("Finding", "Kind", "Measure", "Severity", "Subject"),
    "peers": ("PeerFlag", "PeerScorer", "hard_failures"),
    "period": ("PeriodResult", "StepTimes", "acf", "find_period", "rank_period", "step_times"),
    "records": ("JobLayout", "RankOps", "RankPlace"),
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchBocd",
    "ChangePoint",
    "detect_changepoints",
    "StepDetector",
    "DetectorConfig",
    "detect_steps",
    "Episode",
    "Profile",
    "Finding",
    "Kind",
    "Measure",
    "Severity",
    "Subject",
    "PeerFlag",
    "PeerScorer",
    "hard_failures",
    "PeriodResult",
    "StepTimes",
    "acf",
    "find_period",
    "rank_period",
    "step_times",
    "JobLayout",
    "RankOps",
    "RankPlace",
]
