"""What a node agent sends the controller: one versioned, signed JSON report.

Reports carry rolling windows (the last `max_steps` iterations of each rank,
the telemetry samples since the previous report), so the controller can
rebuild its view from the next report after a restart and a lost report
costs nothing but latency. Raw ring records stay on the node.

Authentication: HMAC-SHA256 over "<unix time>\\n<body>" with a shared secret
(headers X-Slurmguard-Time and X-Slurmguard-Signature); the controller rejects
a bad signature, a time more than `MAX_SKEW_S` away from its own, and a
sequence number it has already seen from that agent.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from slurmguard.errors import ConfigError

SCHEMA_VERSION = 1
MAX_SKEW_S = 300.0
TIME_HEADER = "X-Slurmguard-Time"
SIG_HEADER = "X-Slurmguard-Signature"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepSample(_Model):
    """One iteration of one rank. end: Unix seconds; step_s/comm_s: seconds
    (comm_s = time inside collectives during the iteration, overlapping ones
    counted once; after a receive the hook cannot time, the time until the
    rank's next collective: see agent.analysis.waited_until)."""

    end: float
    step_s: float = Field(ge=0)
    comm_s: float = Field(ge=0)


class ChangeReport(_Model):
    """A verified step-time change seen by the agent's BOCD (Unix seconds, seconds)."""

    at: float
    direction: str
    before_s: float
    after_s: float


class RankReport(_Model):
    rank: int = Field(ge=0)
    local_rank: int | None = None
    gpu: int | None = None
    source: str = "nccl"
    period_ops: int | None = None
    """Collectives per iteration the agent found (None: no iteration found yet)."""
    role: str | None = Field(None, max_length=64)
    """What work the rank does (agent.analysis.role_of): ranks of one job with
    the same role are peers (same pipeline stage, same kind of shard); None: unknown."""
    baseline_step_s: float | None = None
    """Median step time of the rank's first stable window (s); None until known."""
    baseline_compute_s: float | None = None
    steps: list[StepSample] = Field(default_factory=list)
    total_steps: int = 0
    last_progress: float | None = None
    """Unix s of the rank's last completed collective."""
    in_flight_since: float | None = None
    """Unix s when the oldest collective still in flight started (None: none)."""
    lost_records: int = 0
    changes: list[ChangeReport] = Field(default_factory=list)
    exited: bool = False
    """The rank's process is gone while its ring stays (it died, or the job
    ends): its silence is not a stall and its last steps are not a slowdown."""


class JobReport(_Model):
    job_id: int = Field(gt=0)
    world_size: int | None = None
    ranks: list[RankReport] = Field(default_factory=list)


class TelemetryRecord(_Model):
    signal: str
    value: float
    unit: str = ""
    timestamp: float
    gpu: int | None = None
    nic: str | None = None


class AgentReport(_Model):
    schema_version: int = SCHEMA_VERSION
    node: str
    seq: int = Field(ge=0)
    sent_at: float
    jobs: list[JobReport] = Field(default_factory=list)
    telemetry: list[TelemetryRecord] = Field(default_factory=list)
    events: list[str] = Field(default_factory=list)
    ring_errors: dict[str, int] = Field(default_factory=dict)
    """Ring problems this agent counted since it started, by kind
    (agent/rings.py ERROR_KINDS: invalid, untrusted, unreadable,
    corrupt_records, dropped_samples, analysis)."""


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    return hmac.new(secret, timestamp.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def verify(secret: bytes, timestamp: str, body: bytes, signature: str, now: float) -> str | None:
    """None if valid, else why not (for the log; the client only sees 401)."""
    try:
        ts = float(timestamp)
    except (TypeError, ValueError):
        return "missing or malformed time header"
    if abs(now - ts) > MAX_SKEW_S:
        return f"time {ts:.0f} is {abs(now - ts):.0f}s from the controller's clock"
    if not signature or not hmac.compare_digest(sign(secret, timestamp, body), signature):
        return "bad signature"
    return None


def read_secret(path: str | Path) -> bytes:
    """The shared secret (file content, stripped); ConfigError if unusable."""
    p = Path(path)
    try:
        data = p.read_bytes().strip()
    except FileNotFoundError:
        raise ConfigError(f"{p}: shared secret file not found (create it with 32+ random bytes, mode 0600)") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read shared secret: {exc}") from None
    if len(data) < 16:
        raise ConfigError(f"{p}: shared secret too short (need at least 16 bytes)")
    return data
