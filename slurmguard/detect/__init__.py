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

from slurmguard.detect.bocd import BatchBocd, ChangePoint, detect_changepoints
from slurmguard.detect.crossgroup import group_times, slow_groups, suspects
from slurmguard.detect.findings import Culprit, Finding, job_finding, localise
from slurmguard.detect.mycroft import StragglerTriggers, find_stall, late_ranks, sample_ranks
from slurmguard.detect.peers import PeerFlag, PeerScorer, hard_failures
from slurmguard.detect.period import PeriodResult, StepTimes, acf, find_period, rank_period, step_times
from slurmguard.detect.records import JobLayout, RankOps, RankPlace
from slurmguard.detect.steps import DetectorConfig, Episode, Profile, StepDetector, detect_steps

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
