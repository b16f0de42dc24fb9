"""Detectors: iteration period and step time, change points, localisation, peers.

Public API (inputs are plain numpy arrays / small dataclasses, not ring records):
    RankOps, RankPlace, JobLayout                       (records)
    rank_period, step_times, find_period, acf           (period)
    BatchBocd, detect_changepoints, ChangePoint                       (bocd)
    StepDetector, DetectorConfig, detect_steps, Episode, Profile      (steps)
    group_times, slow_groups, suspects                  (crossgroup)
    find_stall, late_ranks, StragglerTriggers, sample_ranks          (mycroft)
    PeerScorer, PeerFlag, hard_failures                 (peers)
    localise, job_finding, Finding, Culprit             (findings)
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): the prolog reaches detect.peers.hard_failures and
# must not pay for numpy, which bocd, period etc. load at import time.
_WHERE = {
    "bocd": ("BatchBocd", "ChangePoint", "detect_changepoints"),
    "steps": ("DetectorConfig", "Episode", "Profile", "StepDetector", "detect_steps"),
    "crossgroup": ("group_times", "slow_groups", "suspects"),
    "findings": ("Culprit", "Finding", "job_finding", "localise"),
    "mycroft": ("StragglerTriggers", "find_stall", "late_ranks", "sample_ranks"),
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
    "BatchBocd", "ChangePoint", "detect_changepoints",
    "StepDetector", "DetectorConfig", "detect_steps", "Episode", "Profile",
    "group_times", "slow_groups", "suspects",
    "Culprit", "Finding", "job_finding", "localise",
    "StragglerTriggers", "find_stall", "late_ranks", "sample_ranks",
    "PeerFlag", "PeerScorer", "hard_failures",
    "PeriodResult", "StepTimes", "acf", "find_period", "rank_period", "step_times",
    "JobLayout", "RankOps", "RankPlace",
]
