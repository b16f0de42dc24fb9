"""The policy: every threshold and setting slurmguard uses, validated strictly.

`policies.yaml` at the repository root is the documented default; each key
there is mirrored by a field here with the same default (the whatif section's
in slurmguard.whatif_policy). Unknown keys are errors, and every error names
the file, the dotted key path and the line.

Lookup order for the file (slurmguard.policyfile): --policy, $SLURMGUARD_POLICY,
/etc/slurmguard/policies.yaml, then the built-in defaults below. Never the
current directory: the policy names the Slurm binaries and the secret, and an
admin's command run as root in a user's directory must not take them from it.
Run as root, a policy (and a secret) that is not owned by root or that group or
others may write is refused (`read_trusted`).
Database URL order: --db, $SLURMGUARD_DB, database.url.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slurmguard.errors import ConfigError
from slurmguard.policyfile import find_policy_file
from slurmguard.whatif_policy import WhatIfPolicy


class Strict(BaseModel):
    # defer_build: a model's validator is built when it first validates, not at import, so a
    # command that loads only some sections (load_policy(sections=...)) builds only those.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, defer_build=True)


# ---------------------------------------------------------------- storage / slurm
class DatabasePolicy(Strict):
    url: str = "sqlite:////var/lib/slurmguard/slurmguard.db"
    """SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://user@host/db."""


class SlurmPolicy(Strict):
    backend: Literal["commands", "restd"] = "commands"
    """commands: sinfo/squeue/scontrol/sbatch. restd: slurmrestd's REST API with
    JWT auth; operations its API version lacks use the commands
    (slurmguard/slurm/restd.py lists them). pyslurm is not offered: it builds
    only against one Slurm release."""
    command_timeout_s: float = Field(15.0, gt=0)
    """Timeout of one scontrol/sinfo/squeue/sbatch call or REST request, seconds."""
    bin_dir: str | None = None
    """Directory of the Slurm commands; None = search PATH."""
    restd_url: str | None = Field(None, pattern=r"^https?://[^\s/]+(:\d+)?/?$")
    """slurmrestd base URL, e.g. http://127.0.0.1:6820; required with backend restd."""
    restd_api: str = Field("v0.0.38", pattern=r"^v0\.0\.\d+$")
    """OpenAPI plugin version in the request paths (v0.0.38 = Slurm 22.05's)."""
    restd_user: str = Field("root", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")
    """Slurm user the token is for (X-SLURM-USER-NAME); it needs operator rights."""
    restd_jwt_key_file: str | None = None
    """The cluster's JWT key (AuthAltParameters=jwt_key=...): tokens are signed here."""
    restd_token_file: str | None = None
    """Else a file holding a token from `scontrol token` (re-read when it changes);
    neither: $SLURM_JWT."""
    restd_token_lifespan_s: int = Field(1800, ge=60)
    """Lifetime of the tokens signed from restd_jwt_key_file, seconds."""

    @model_validator(mode="after")
    def _restd_needs_url(self) -> SlurmPolicy:
        if self.backend == "restd" and not self.restd_url:
            raise ValueError("backend restd needs restd_url (e.g. http://127.0.0.1:6820)")
        if self.restd_jwt_key_file and self.restd_token_file:
            raise ValueError("give restd_jwt_key_file or restd_token_file, not both")
        return self


# ---------------------------------------------------------------- detection
class PeriodPolicy(Strict):
    acf_threshold: float = Field(0.95, gt=0, le=1)
    """Greyhound 4.2: first lag whose ACF reaches M is the iteration period."""
    min_period: int = Field(2, ge=1)
    max_period: int = Field(1024, ge=2)
    window_ops: int = Field(8192, ge=16)
    """Most recent ops of a rank used for the ACF."""
    min_repeats: int = Field(3, ge=2)
    """A period is accepted only if the window holds this many iterations."""
    acf_tolerance: float = Field(0.02, ge=0, lt=1)
    """The period is the first lag reaching max(acf_threshold, best ACF - this), so
    a half-iteration that almost repeats does not beat the real period."""


class BocdPolicy(Strict):
    hazard: float = Field(0.004, gt=0, lt=1)
    """Constant hazard H = 1/expected run length (iterations)."""
    max_run_length: int = Field(32, ge=8)
    """Run-length truncation; longer runs share the last slot."""
    rule: Literal["map_drop", "short_mass"] = "map_drop"
    """Candidate rule: the MAP run length drops below the current level's age
    (map_drop), or P(r_t < short_run) > change_probability (short_mass).
    P(r_t = 0) itself always equals the hazard; `slurmguard bench detect` compares."""
    short_run: int = Field(4, ge=1)
    """short_mass rule: fire when P(r_t < short_run) exceeds change_probability."""
    change_probability: float = Field(0.9, gt=0, lt=1)
    verify_min_change: float = Field(0.10, gt=0)
    """Greyhound verification: means before/after must differ by this fraction."""
    verify_window: int = Field(8, ge=2)
    """Iterations on each side of a change point used by the verification."""
    verify_min_after: int = Field(4, ge=1)
    """Samples after a candidate needed before it is verified (bounds the delay)."""
    prior_cv: float = Field(0.03, gt=0)
    """Prior guess of the step-time jitter (relative s.d.); the model learns the real one."""
    max_period: int = Field(8, ge=1, le=64)
    """Longest step pattern recognised (every p-th step longer: gradient
    accumulation, an optimizer step every p micro-steps), iterations."""
    significance: float = Field(2.0, gt=0)
    """A change is verified when its size minus this many standard errors of the
    after-window median still clears half the bar (and rejected when its size plus
    this many is below 3/4 of the bar)."""


class CrossGroupPolicy(Strict):
    median_excess: float = Field(0.10, gt=0)
    """Greyhound 4.3's comparison applied to compute (controller.assess.localise): a
    rank is slow when its compute grew by more than this fraction beyond its own
    baseline and its same-role peers' (2x this with nothing to compare with).
    A stall's threshold is response.tiers.stall_s. Also the excess over the median
    of the job's links of one direction that makes a link slow (controller.links)."""
    min_groups: int = Field(3, ge=2)
    """Links of one direction (NCCL profiler plugin per-link times) needed before
    any is judged slow against their median (controller.links)."""


class PeerPolicy(Strict):
    robust_z: float = Field(3.5, gt=0)
    """A signal deviates when |x - median| / (1.4826 MAD) exceeds this."""
    min_signals: int = Field(2, ge=1)
    """A node is flagged only when this many signals deviate together..."""
    consecutive_windows: int = Field(3, ge=1)
    """...over this many consecutive windows."""
    window_s: float = Field(30.0, gt=0)
    min_peers: int = Field(4, ge=2)
    mad_floor: float = Field(0.01, ge=0)
    """The robust scale is at least this fraction of |median| (identical peers: MAD = 0)."""


class DetectionPolicy(Strict):
    period: PeriodPolicy = Field(default_factory=PeriodPolicy)
    bocd: BocdPolicy = Field(default_factory=BocdPolicy)
    cross_group: CrossGroupPolicy = Field(default_factory=CrossGroupPolicy)
    peers: PeerPolicy = Field(default_factory=PeerPolicy)


# ---------------------------------------------------------------- response
class TierPolicy(Strict):
    moderate_slowdown: float = Field(0.10, gt=0)
    """Sustained step-time slowdown (fraction) that drains at checkpoint."""
    severe_slowdown: float = Field(0.20, gt=0)
    """Slowdown (fraction) that drains and requeues now."""
    sustained_s: float = Field(60.0, ge=0)
    """A moderate slowdown must last this long before acting."""
    stall_s: float = Field(120.0, gt=0)
    """No completed iteration for this long is a stall (severe)."""
    checkpoint_signal: str = "USR1"
    """Signal sent to the job's batch step to ask for a checkpoint, for jobs that opted in
    with `--comment=slurmguard:signal` (a job may name its own: `signal=USR2`); other jobs
    are drained under and left running (slurmguard.controller.plans.job_options)."""

    @model_validator(mode="after")
    def _ordered(self) -> TierPolicy:
        if self.severe_slowdown <= self.moderate_slowdown:
            raise ValueError("severe_slowdown must be greater than moderate_slowdown")
        return self


class EscalationPolicy(Strict):
    """Ski-rental costs (Greyhound Algorithm 1), in GPU-seconds.

    An action is taken once the accumulated slowdown cost
    (slow iterations x (t_slow - t_healthy) x GPUs) reaches its cost.
    """

    rebalance_gpu_s: float = Field(60.0, ge=0)
    retopology_gpu_s: float = Field(600.0, ge=0)
    drain_checkpoint_gpu_s: float = Field(1800.0, ge=0)
    requeue_gpu_s: float = Field(3600.0, ge=0)


class ResponsePolicy(Strict):
    tiers: TierPolicy = Field(default_factory=TierPolicy)
    escalation: EscalationPolicy = Field(default_factory=EscalationPolicy)


# ---------------------------------------------------------------- safety
class BreakerPolicy(Strict):
    max_nodes: int = Field(2, ge=0)
    """At most this many nodes drained by slurmguard per window (whole cluster)."""
    max_partition_percent: float = Field(10.0, ge=0, le=100)
    """At most this share of a partition drained by slurmguard per window."""
    window_s: float = Field(3600.0, gt=0)
    max_job_actions: int = Field(4, ge=0)
    """At most this many requeues and checkpoint signals per window (whole cluster): each
    one passes this itself, also when its node was drained by an earlier cycle."""


class RateLimitPolicy(Strict):
    max_actions: int = Field(20, ge=1)
    window_s: float = Field(600.0, gt=0)


class SafetyPolicy(Strict):
    dry_run: bool = False
    breaker: BreakerPolicy = Field(default_factory=BreakerPolicy)
    rate_limit: RateLimitPolicy = Field(default_factory=RateLimitPolicy)


# ---------------------------------------------------------------- daemons
class TelemetryPolicy(Strict):
    """How the agent reads the hardware (agent.telemetry)."""

    infiniband: bool = True
    """With the nvml and dcgm sources, also sample the IB/RoCE ports under
    ib_sysfs_root (the prometheus source reads them from node_exporter, sim
    simulates them)."""
    ib_sysfs_root: str = "/sys/class/infiniband"
    ib_expected_ports: tuple[str, ...] = ()
    """fnmatch patterns of the ports that must be up, as "mlx5_*:1". Empty: the
    ports seen ACTIVE since the agent started (the node's healthy state). A
    port that is not expected and not ACTIVE (uncabled, storage, an unused
    Ethernet port) is ignored, never a link down."""
    prometheus_targets: tuple[str, ...] = ("http://127.0.0.1:9400/metrics", "http://127.0.0.1:9100/metrics")
    """Pages the prometheus source scrapes (dcgm-exporter, node_exporter) on this node."""
    call_timeout_s: float = Field(2.0, gt=0)
    """Longest a source call (NVML, DCGM, sysfs, a scrape) may take (s); a slower
    call is a timeout event, never a hung agent."""


class AgentPolicy(Strict):
    ring_root: str = "/dev/shm/slurmguard"
    sample_interval_s: float = Field(5.0, gt=0)
    report_interval_s: float = Field(10.0, gt=0)
    """Seconds between an agent's reports; half that while one of its ranks runs
    the moderate tier's slowdown or more (agent.daemon.EARLY_REPORT_FRACTION)."""
    telemetry_source: Literal["sim", "nvml", "dcgm", "prometheus", "none"] = "sim"
    telemetry: TelemetryPolicy = Field(default_factory=TelemetryPolicy)
    controller_url: str = "http://127.0.0.1:8642"
    also_report_to: tuple[str, ...] = ()
    """Further controllers that get every report too: the other controller(s) of a
    PostgreSQL pair (controller.lease_retry_s), so the one that takes the lease over
    already has the fleet's reports. Each has its own queue, retry and backoff
    (buffer_max_reports): one that is down delays none of the others."""
    request_timeout_s: float = Field(5.0, gt=0)
    buffer_max_reports: int = Field(1000, ge=1)
    secret_file: str = "/etc/slurmguard/node.key"
    """This node's report key (`slurmguard keys derive NODE`), mode 0600, owned by root;
    `{node}` in the path is replaced by the agent's node name (one policy for all nodes)."""
    tls_ca_file: str | None = None
    """CA bundle that signed the controller's certificate (https controller_url);
    None = the system's trust store."""
    warmup_steps: int = Field(5, ge=0)
    """Iterations skipped before the baseline window (compilation, cache warm-up)."""
    baseline_steps: int = Field(32, ge=3)
    """Iterations (after the warm-up) that set a rank's healthy baseline and its
    step pattern for the step detector; a pattern of period p needs 3p of them
    (32: every period up to detection.bocd.max_period = 8)."""
    report_steps: int = Field(256, ge=8)
    """Most recent iterations of each rank sent in every report."""
    max_ops_per_rank: int = Field(16384, ge=256)
    """Ring records kept per rank for period and step-time analysis. The agent
    reads its rings every second and analyses a rank as soon as half of them
    are new (agent.analysis.READ_AHEAD), so a job that issues more between two
    reports loses none of its iterations."""


class ControllerPolicy(Strict):
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(8642, ge=1, le=65535)
    cycle_interval_s: float = Field(5.0, gt=0)
    """Seconds from one control cycle's start to the next; a report of a slow job
    starts one sooner (controller.daemon.wait_for_cycle, Controller.wants_cycle)."""
    report_stale_s: float = Field(120.0, gt=0)
    secret_file: str = "/etc/slurmguard/secret"
    """Master secret (32+ random bytes, mode 0600, root): each node's report key is
    HMAC-SHA256(master, node) (slurmguard.wire.node_key)."""
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Largest report body accepted (bytes); larger is refused before reading it (413)."""
    request_timeout_s: float = Field(10.0, gt=0)
    """Whole-request limit (s): a client that has not sent its request by then is cut off."""
    workers: int = Field(8, ge=1, le=256)
    """Connections served (read) at once by a listener's event loop, each buffering at
    most max_body_bytes; connections beyond workers + max_pending get 503."""
    max_pending: int = Field(32, ge=0)
    """Accepted connections waiting, unread, for one of the `workers` slots."""
    keepalive_idle_s: float = Field(30.0, ge=0)
    """How long a connection may stay open, idle, after an answer for the client's next
    request (HTTP/1.1 keep-alive), so an agent pays the connection's set-up and tear-down
    once, not per report: longer than agent.report_interval_s. An idle connection holds
    no worker slot and no buffer. 0 = one request per connection."""
    keepalive_max_requests: int = Field(1000, ge=1)
    """Requests served on one connection; the answer to the last says Connection: close."""
    max_idle_connections: int = Field(16384, ge=0)
    """Idle kept-alive connections held per listener (a descriptor each); past it the
    longest idle is closed (its client reconnects). About one per node: raise it, and
    the service's LimitNOFILE, for larger fleets."""
    ip_rate_per_s: float = Field(20.0, gt=0)
    """Requests per second per client address (token bucket; 429 past it)..."""
    ip_burst: int = Field(100, ge=1)
    """...with this many in a burst."""
    node_rate_per_s: float = Field(2.0, gt=0)
    """Signed reports per second per node (token bucket; 429 past it)..."""
    node_burst: int = Field(20, ge=1)
    """...with this many in a burst."""
    tls_cert_file: str | None = None
    """PEM certificate (chain) of the controller: serve HTTPS. None = plain HTTP."""
    tls_key_file: str | None = None
    """PEM private key of tls_cert_file (root, mode 0600)."""
    management_host: str | None = None
    """Address of a second listener for /metrics, /healthz and /v1/jobs/<id>/plan; when set,
    the report listener serves only reports and /healthz. None = one listener."""
    management_port: int = Field(8643, ge=0, le=65535)
    """Port of the management listener (0: any free port)."""
    read_clients: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    """Networks (CIDR) allowed to read /metrics and plans, on either listener (jobs that
    fetch plans run on the compute nodes: add their network)."""
    keep_steps_per_rank: int = Field(256, ge=16, le=4096)
    """Iterations of each rank the controller keeps from a node's latest report (the
    newest; 24 bytes each): bounds its memory at about nodes x GPUs x this x 24 B
    (10,000 x 8 x 256: 0.5 GB). Default: agent.report_steps."""
    lease_retry_s: float = Field(2.0, gt=0)
    """PostgreSQL only (two controllers on one database): seconds between a standby's
    attempts to take the lease; a killed leader is replaced within about this."""
    lease_timeout_s: float = Field(10.0, ge=2)
    """PostgreSQL only: seconds the server waits on a silent leader's session (TCP
    keepalives) before it frees the lease; a leader whose host vanished is replaced
    within about lease_timeout_s + lease_retry_s."""
    keep_samples_per_node: int = Field(4096, ge=64)
    """Telemetry kept per node between two peer windows (each sample is scored once):
    one running sum per device signal the peer scorer averages, plus hard-failure
    samples as sent. Past it the oldest samples are dropped, sums for further device
    signals refused, both counted (slurmguard_telemetry_dropped_total)."""

    @model_validator(mode="after")
    def _tls_pair(self) -> ControllerPolicy:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        for net in self.read_clients:
            import ipaddress  # here: only a policy with read_clients pays its import

            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"read_clients: {net!r} is not a network (CIDR)") from None
        return self


# ---------------------------------------------------------------- sweeps / triage
class ModelFloor(Strict):
    """Lowest acceptable sweep figures of one device model: spec-sheet values times `fraction`.

    Judges a sweep only when its class has no baseline and no healthy peer was swept in the
    same window (a cold start). Spec figures are dense (no sparsity), per device; a metric
    without a figure here is not judged by the floor."""

    model: str = Field(min_length=1)
    """fnmatch pattern on the result's device_name ("NVIDIA H100 80GB HBM3", "cpu *")."""
    fraction: float = Field(0.5, gt=0, le=1)
    """Share of each spec figure a healthy device must reach in the sweep."""
    gemm_tflops: dict[str, float] = {}
    """Spec TFLOP/s per GEMM dtype (float32, tf32, bfloat16, float16)."""
    membw_gbps: float | None = Field(None, gt=0)
    """Device memory bandwidth, GB/s (the sweep counts bytes read + written of a copy)."""
    p2p_gbps: float | None = Field(None, gt=0)
    """GPU-to-GPU copy inside the node, one direction, GB/s (NVLink per-direction figure)."""
    allreduce_intra_gbps: float | None = Field(None, gt=0)
    """Intra-node all-reduce bus bandwidth, GB/s."""
    send_gbps: float | None = Field(None, gt=0)
    """Cross-node send/recv per GPU and direction, GB/s (e.g. 50 for one 400 Gb/s NIC per GPU)."""
    allreduce_cross_gbps: float | None = Field(None, gt=0)
    """Cross-node all-reduce bus bandwidth, GB/s."""

    @field_validator("gemm_tflops")
    @classmethod
    def _known_dtypes(cls, v: dict[str, float]) -> dict[str, float]:
        known = ("float32", "tf32", "bfloat16", "float16")
        for k, x in v.items():
            if k not in known:
                raise ValueError(f"unknown GEMM dtype {k!r} (known: {', '.join(known)})")
            if not x > 0:
                raise ValueError(f"{k}: spec TFLOP/s must be positive, got {x}")
        return v


_GEMM_HOPPER = {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}
_DEFAULT_FLOORS: tuple[dict, ...] = (  # built on use: see Strict.model_config
    # spec sheets, dense: H100 SXM5 (HBM3 3.35 TB/s, NVLink 4 450 GB/s per direction,
    # one 400 Gb/s NIC per GPU), H200 (HBM3e 4.8 TB/s), A100 SXM4 80GB (2.039 TB/s,
    # NVLink 3 300 GB/s per direction, one 200 Gb/s NIC per GPU)
    {
        "model": "NVIDIA H100 80GB HBM3",
        "gemm_tflops": _GEMM_HOPPER,
        "membw_gbps": 3350.0,
        "p2p_gbps": 450.0,
        "send_gbps": 50.0,
    },
    {
        "model": "NVIDIA H200*",
        "gemm_tflops": _GEMM_HOPPER,
        "membw_gbps": 4800.0,
        "p2p_gbps": 450.0,
        "send_gbps": 50.0,
    },
    {
        "model": "NVIDIA A100-SXM4-80GB",
        "gemm_tflops": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
        "membw_gbps": 2039.0,
        "p2p_gbps": 300.0,
        "send_gbps": 25.0,
    },
)


class ToolStage(Strict):
    """One standard tool run as a sweep stage (where installed)."""

    run: Literal["auto", "required", "never"] = "auto"
    """auto: run where the tool is installed, recorded as skipped where not; required: a
    missing tool is a stage error (the node is held, never failed, for it); never: off."""
    command: str = Field(min_length=1)
    """Executable name (looked up in PATH on the node) or absolute path."""
    args: tuple[str, ...] = ()
    """Extra arguments appended to the ones slurmguard sets."""
    timeout_s: float = Field(600.0, gt=0)
    """A run still going after this many seconds is killed: a stage error, never a hang."""
    min_gbps: float | None = Field(None, gt=0)
    """Bandwidth tools: a figure below this fails the stage (GB/s; None = only recorded)."""


class ToolStages(Strict):
    """The field's standard tools as optional sweep stages; their figures are stored beside
    slurmguard's own, and a stage that reports a failure fails the sweep with its evidence."""

    dcgm_diag: ToolStage = Field(default_factory=lambda: ToolStage(command="dcgmi", timeout_s=900.0))
    """`dcgmi diag -r LEVEL -j` on the 1-node sweep."""
    dcgm_level: Literal[1, 2, 3] = 1
    """dcgmi diag run level: 1 quick (about a minute), 2 medium, 3 long (tens of minutes)."""
    nccl_all_reduce: ToolStage = Field(
        default_factory=lambda: ToolStage(command="all_reduce_perf", args=("-b", "1G", "-e", "4G", "-f", "2"))
    )
    """nccl-tests all_reduce_perf over all GPUs of the node (1-node sweep), -c 1 (checked)."""
    nvbandwidth: ToolStage = Field(default_factory=lambda: ToolStage(command="nvbandwidth"))
    """nvbandwidth's copy benchmarks (1-node sweep)."""
    ib_write_bw: ToolStage = Field(default_factory=lambda: ToolStage(command="ib_write_bw", timeout_s=120.0))
    """perftest ib_write_bw per HCA pair, node under test -> reference (2-node sweep)."""
    ib_hcas: tuple[str, ...] = ()
    """HCAs measured by ib_write_bw (mlx5_0 ...); empty = every device in /sys/class/infiniband."""
    ib_port_base: int = Field(18515, ge=1024, le=65000)
    """TCP port of the first ib_write_bw server; one port per HCA from here."""


class SweepPolicy(Strict):
    device: Literal["auto", "cuda", "cpu"] = "auto"
    gemm_duration_s: float = Field(60.0, gt=0)
    """Per dtype; long enough for a GPU to reach thermal steady state."""
    gemm_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    gemm_size: int = Field(8192, ge=64)
    membw_bytes: int = Field(1 << 30, ge=1 << 20)
    message_sizes_mb: tuple[int, ...] = (64, 1024)
    """Collective and send/recv sizes, MiB; bus bandwidth is reached from about 1 GiB."""
    repeats: int = Field(5, ge=1)
    time_limit_min: int = Field(30, ge=1)
    pass_tolerance: float = Field(0.05, gt=0, lt=1)
    """A metric passes within this fraction of its hardware-class median."""
    bootstrap_min_nodes: int = Field(3, ge=1)
    """Healthy-node results needed before a class baseline is trusted."""
    rolling_enabled: bool = False
    rolling_nodes_per_hour: float = Field(1.0, ge=0)
    partition: str | None = None
    peer_min_devices: int = Field(4, ge=2)
    """Nodes with at least this many GPUs also compare each GPU with the node's own median."""
    reference_max_failures: int = Field(2, ge=1)
    """A reference whose last N pair sweeps as reference failed, each with a different
    partner, is no longer trusted (the common element is the reference)."""
    comm_timeout_s: float = Field(300.0, gt=0)
    """Rendezvous and collective timeout inside a sweep, seconds (a dead peer is a fail)."""
    workload_dir: str | None = None
    """Directory of node_sweep.py/pair_sweep.py/templates; None = sweeps/ beside the package."""
    python: str | None = None
    """Interpreter on the nodes that runs the workloads; None = the controller's own."""
    result_dir: str = "/var/lib/slurmguard/sweeps"
    """Where sweep jobs write results and logs; shared by the controller and the nodes."""
    hw_class_feature_prefix: str = "hwclass="
    """A node feature with this prefix names its hardware class; else the DB's, else 'default'."""
    quarantine_reservation_min: int = Field(10080, ge=10)
    """Length of the MAINT reservation holding a node under verification, minutes."""
    start_timeout_min: int = Field(10, ge=1)
    """A sweep job still pending after this is cancelled and counts as not run, minutes."""
    master_addr: str | None = None
    """Rendezvous address of pair sweeps; None = the batch host's hostname."""
    workload_args: tuple[str, ...] = ()
    """Extra workload options appended to every sweep job (e.g. --threads 1)."""
    baseline_max_age_h: float = Field(168.0, gt=0)
    """A healthy node's result older than this no longer counts in its class baseline,
    hours; the baseline is re-learned (same-window peers, rolling or `sweep baseline`)."""
    peer_window_min: float = Field(60.0, gt=0)
    """Same-window peers: healthy nodes of the class whose passed sweep finished within
    this many minutes of the judged one. They judge a sweep while the class has no baseline."""
    peer_min_nodes: int = Field(2, ge=1)
    """Same-window peers needed before they can judge a sweep."""
    peer_sweeps: bool = True
    """Without a baseline, sweep idle healthy peers of the class (one at a time, never a busy
    node) so a drained node can be judged; False = hold until a baseline exists."""
    floors: tuple[ModelFloor, ...] = Field(
        default_factory=lambda: tuple(ModelFloor(**f) for f in _DEFAULT_FLOORS)
    )
    """Per-model floors: the reference of last resort (no baseline, no peer)."""
    killed_retries: int = Field(2, ge=0)
    """A sweep job cancelled or preempted by Slurm (not ended by the node) is submitted again
    this many times before it counts as a failed sweep."""
    comm_iters: int = Field(20, ge=1)
    """Back-to-back collectives timed together per measurement (after comm_warmup)."""
    comm_warmup: int = Field(5, ge=0)
    """Untimed collectives before each measurement (connections, NCCL channels, clocks)."""
    telemetry_interval_s: float = Field(1.0, gt=0)
    """Clocks, power, temperature and throttle reasons sampled this often during a sweep."""
    throttle_fail_reasons: tuple[str, ...] = (
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "cpu_quota",
    )
    """Throttle reasons that fail a sweep when seen during the device phases (NVML
    clocks-event names; cpu_quota: a cgroup CPU limit on the CPU path). sw_power_cap is
    normal for a GPU at full load and is not in the list."""
    throttle_fail_share: float = Field(0.1, gt=0, le=1)
    """Share of telemetry samples (GPU) or scheduler periods (CPU) with one of those reasons
    from which the sweep fails."""
    stages: ToolStages = Field(default_factory=ToolStages)


class TriagePolicy(Strict):
    ladder: tuple[Literal["resweep", "reboot", "reimage", "terminal"], ...] = (
        "resweep",
        "reboot",
        "reimage",
        "terminal",
    )
    repeat_limit: int = Field(3, ge=1)
    """Guard 6: entering triage this many times within repeat_window_days -> terminal."""
    repeat_window_days: float = Field(7.0, gt=0)
    reboot_next_state: Literal["resume", "drain", "down"] = "resume"
    reimage_command: tuple[str, ...] = ()
    """Site command run as argv with the node name appended; empty = skip rung."""
    reimage_timeout_s: float = Field(3600.0, gt=0)
    reboot_timeout_s: float = Field(1800.0, gt=0)
    """A reboot not completed (new boot time, reboot flags cleared) by then fails its rung."""

    @field_validator("ladder")
    @classmethod
    def _ends_terminal(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or v[-1] != "terminal":
            raise ValueError("the triage ladder must end with 'terminal'")
        return v


# ---------------------------------------------------------------- what-if analysis
# WhatIfPolicy (slurmguard.whatif_policy) is a stdlib dataclass that pydantic validates with
# Strict's rules: `slurmguard whatif` reads its defaults without importing pydantic.


# ---------------------------------------------------------------- prolog / epilog
class PrologPolicy(Strict):
    """Slurm Prolog/Epilog (prolog_epilog/): pre-job node checks and the job trace archive."""

    checks: tuple[Literal["gpu_count", "gpu_health", "nic_link"], ...] = (
        "gpu_count",
        "gpu_health",
        "nic_link",
    )
    """Checks the prolog runs; a failing one exits non-zero and Slurm drains the node."""
    timeout_s: float = Field(8.0, gt=0, le=60)
    """Total budget of the prolog (s): a check still running then is a failure."""
    check_timeout_s: float = Field(5.0, gt=0)
    """Each check's own limit (s), capped by what is left of timeout_s."""
    nvml: bool = True
    """False: the GPU checks pass without touching NVML (nodes without the NVIDIA driver)."""
    expected_gpus: int | None = Field(None, ge=0)
    """GPUs NVML must see; None = the node's Gres=gpu count in slurm.conf (0 without Gres)."""
    max_ecc_dbe: int = Field(0, ge=0)
    """Volatile (since driver load) uncorrectable ECC errors tolerated per GPU."""
    ib_sysfs_root: str = "/sys/class/infiniband"
    ib_ports: tuple[str, ...] = ()
    """fnmatch patterns of the ports checked, as "mlx5_0:1"; empty = every port."""
    min_ib_ports: int = Field(0, ge=0)
    """Fewer ACTIVE ports than this fails the node (0 = no count check)."""
    min_ib_rate_gbps: float | None = Field(None, gt=0)
    """An ACTIVE port below this rate (Gb/s) fails; None = no rate check."""
    fail_on_internal_error: bool = False
    """A prolog bug or a bad policy file: False = log and pass, so that one typo cannot
    drain every node of the cluster."""
    trace_store: str = "/var/lib/slurmguard/traces"
    """Epilog archive: <trace_store>/<job_id>/<node>/ ring files + manifest.json."""
    trace_retention_days: float = Field(30.0, gt=0)
    """Job archives older than this are pruned by the epilog."""
    max_archive_mb: int = Field(4096, ge=1)
    """Per job and node: rings beyond this many MB are not archived (still removed)."""
    min_free_mb: int = Field(1024, ge=0)
    """Never fill the trace store's file system below this many free MB."""
    max_ring_entries: int = Field(4096, ge=1)
    """Directory entries of a job's ring directory the epilog looks at; the rest are removed
    unread and counted (a job can create millions of files)."""
    ring_root_shared: bool = False
    """True when several nodes share one ring root (the development cluster, all slurmd on
    one host): rings naming another node of the job are left for that node's epilog. False
    (a real cluster, /dev/shm per node): every ring in the directory is this node's."""
    epilog_lock_timeout_s: float = Field(2.0, ge=0, le=30)
    """Shared ring root only: wait this long for another epilog's lock, then go on without it."""
    epilog_fail_on_cleanup_error: bool = True
    """Rings the epilog cannot remove keep RAM (tmpfs) in use: exit non-zero so Slurm
    drains the node. Archive problems never fail the epilog."""


class Policy(Strict):
    database: DatabasePolicy = Field(default_factory=DatabasePolicy)
    slurm: SlurmPolicy = Field(default_factory=SlurmPolicy)
    detection: DetectionPolicy = Field(default_factory=DetectionPolicy)
    response: ResponsePolicy = Field(default_factory=ResponsePolicy)
    safety: SafetyPolicy = Field(default_factory=SafetyPolicy)
    agent: AgentPolicy = Field(default_factory=AgentPolicy)
    controller: ControllerPolicy = Field(default_factory=ControllerPolicy)
    sweeps: SweepPolicy = Field(default_factory=SweepPolicy)
    triage: TriagePolicy = Field(default_factory=TriagePolicy)
    whatif: WhatIfPolicy = Field(default_factory=WhatIfPolicy)
    prolog: PrologPolicy = Field(default_factory=PrologPolicy)


# ---------------------------------------------------------------- loading
@functools.cache
def _line_loader() -> type:
    """SafeLoader that rejects duplicate keys (YAML silently keeps the last).

    Built on first use: PyYAML is imported only when there is a policy text to read."""
    import yaml

    class _LineLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return loader.construct_mapping(node, deep=deep)

    _LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return _LineLoader


def _line_index(node: Any, prefix: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map every key path in a composed YAML tree to its 1-based line."""
    import yaml

    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = prefix + (k.value,)
            out[path] = k.start_mark.line + 1
            _line_index(v, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = prefix + (i,)
            out[path] = item.start_mark.line + 1
            _line_index(item, path, out)
    return out


def _format_loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _unvalidated_defaults(section: Any) -> Any:
    """A section's defaults without building its validator: WhatIfPolicy is a stdlib
    dataclass, whose constructor validates nothing."""
    return section.model_construct() if issubclass(section, BaseModel) else section()


class PolicySections:
    """What `load_policy(sections=...)` returns when there is no policy file: the named
    sections' built-in defaults (attributes, as on a Policy). Reading a section that was not
    named is an AttributeError saying so, never a silent default."""

    def __init__(self, sections: Mapping[str, Any]):
        self.__dict__.update(sections)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"policy section {name!r} was not loaded: add it to load_policy(sections=...)")


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate policy YAML text. Raises ConfigError 'FILE:LINE: KEY: message'."""
    import yaml

    try:
        root = yaml.compose(text, Loader=_line_loader())
        data = yaml.load(text, Loader=_line_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{where}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: the policy must be a mapping of sections")
    lines = _line_index(root) if root is not None else {}
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        messages = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"])
            # pydantic appends validator names for unions/literals; trim to existing paths
            probe = loc
            while probe and probe not in lines:
                probe = probe[:-1]
            line = lines.get(probe, 1)
            # a dataclass section (WhatIfPolicy) reports an unknown key as an unexpected argument
            unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")
            msg = "unknown key" if unknown else err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            messages.append(f"{source}:{line}: {_format_loc(loc)}: {msg}")
        raise ConfigError("; ".join(messages)) from None


def read_trusted(
    path: str | os.PathLike, what: str, *, secret: bool = False, as_root: bool | None = None
) -> bytes:
    """Content of a file that steers what root does (a policy, a secret).

    Run as root (as_root: default euid 0), the file must be owned by root and not writable by its
    group or others, else whoever may write it could make root run their programs
    or forge reports. A secret must also not be readable by others. The checks are
    made on the opened descriptor, so what is checked is what is read.
    """
    p = Path(path)
    as_root = os.geteuid() == 0 if as_root is None else as_root
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: {what} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if as_root and st.st_uid != 0:
            raise ConfigError(
                f"{p}: {what} is owned by uid {st.st_uid}, not root; refusing it (chown root {p})"
            )
        if as_root and mode & 0o022:
            raise ConfigError(
                f"{p}: {what} is writable by group or others (mode {mode:04o}); refusing it (chmod go-w {p})"
            )
        if secret and mode & 0o007:
            raise ConfigError(
                f"{p}: {what} is accessible by others (mode {mode:04o}); refusing it (chmod 600 {p})"
            )
        if st.st_size > 16 << 20:
            raise ConfigError(f"{p}: {what} is {st.st_size} bytes; too large")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror}") from None
    finally:
        os.close(fd)


def load_policy(
    path: str | os.PathLike | None = None, *, trusted: bool = True, sections: tuple[str, ...] | None = None
) -> Policy:
    """Load and validate the policy; built-in defaults when no file is found.

    trusted=False only for `slurmguard policy check FILE`, which validates a file
    without acting on it (no owner check). sections: the sections a command reads. With a
    policy file it changes nothing (the whole file is validated, as for every command);
    without one, only those sections' defaults are made, and without building a validator
    (the start-up of a short command: building them, with pydantic's plugin discovery, is
    most of the cost of the policy), in a PolicySections."""
    if sections is not None:
        unknown = [s for s in sections if s not in Policy.model_fields]
        if unknown:
            raise ValueError(f"not policy sections: {', '.join(unknown)}")
    p = find_policy_file(path)
    if p is None:
        if sections is not None:
            # tests/test_config.py checks that these equal the validated defaults
            models = {s: Policy.model_fields[s].annotation for s in sections}
            return PolicySections({s: _unvalidated_defaults(m) for s, m in models.items()})  # type: ignore[return-value]
        return Policy()
    raw = read_trusted(p, "policy file", as_root=None if trusted else False)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: cannot read policy file: {exc}") from None
    return parse_policy(text, str(p))


def database_url(policy: Policy, override: str | None = None) -> str:
    """--db beats $SLURMGUARD_DB beats database.url."""
    return override or os.environ.get("SLURMGUARD_DB") or policy.database.url
