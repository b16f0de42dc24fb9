"""The `whatif` section of the policy, importable without pydantic.

`slurmguard whatif`'s start-up is most of its time (`slurmguard bench whatif`),
and without a policy file it needs only this section's defaults: importing
pydantic and slurmguard.config for them was about a quarter of the command.
So the section is a frozen stdlib dataclass, which slurmguard.config validates
as the `whatif` field of `Policy` with the rules of every other section:
pydantic reads each field's metadata as keyword arguments of `pydantic.Field`
(it ignores a name that is not one, so tests/test_config.py tries every bound)
and `__pydantic_config__` as the model configuration (unknown keys are errors).
Bounds as plain metadata, not annotated_types' Gt/Le: that import alone costs
some 8 ms. Constructed directly (the analysis, tests) it validates nothing,
like `model_construct`.

A top-level module, not in slurmguard.whatif: slurmguard.config imports it, and
slurmguard.whatif.rings imports slurmguard.config (no cycles between packages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class WhatIfPolicy:
    """Paper 004 (what-if analysis of job traces): thresholds of its metrics."""

    # slurmguard.config.Strict's settings, read by pydantic (a ClassVar, not a field); frozen is
    # the dataclass's own
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid", "validate_default": True}

    top_worker_percent: float = field(default=3.0, metadata={"gt": 0, "le": 100})
    """M_W (Eq. 5) fixes the workers with the highest 3% of S_w (percent, default 3)."""
    max_discrepancy: float = field(default=0.05, metadata={"gt": 0})
    """Section 6: traces whose simulated original step time is off by more are flagged
    (fraction, default 0.05)."""
    straggling_slowdown: float = field(default=1.1, metadata={"ge": 1})
    """Section 4.2: a job is straggling when its slowdown S reaches this (ratio, default 1.1)."""
    dominant_share: float = field(default=0.5, metadata={"gt": 0})
    """M_W or M_S at or above this names the cause (sections 5.1, 5.2: 'a majority';
    default 0.5)."""
    affected_share: float = field(default=0.2, metadata={"gt": 0, "le": 1})
    """A worker is affected when S_w - 1 is at least this share of S - 1 (heatmap cell lit;
    default 0.2)."""
    widespread_fraction: float = field(default=0.5, metadata={"gt": 0, "le": 1})
    """This share of workers affected is a widespread pattern (section 8, Fig. 14; default 0.5)."""
    seq_imbalance_correlation: float = field(default=0.9, metadata={"gt": -1, "le": 1})
    """Section 5.3: forward/backward compute correlation suggesting sequence-length imbalance
    (default 0.9)."""
    memory_mb: int = field(default=256, metadata={"ge": 16})
    """Simulator working-set budget (MB, default 256); scenarios are simulated in chunks that fit."""
