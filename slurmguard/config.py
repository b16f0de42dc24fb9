"""The policy: every threshold and setting slurmguard uses, validated strictly.

`policies.yaml` at the repository root is the documented default; each key
there is mirrored by a field here with the same default. Unknown keys are
errors, and every error names the file, the dotted key path and the line.

Lookup order for the file: --policy, $SLURMGUARD_POLICY, ./policies.yaml,
/etc/slurmguard/policies.yaml, then the built-in defaults below.
Database URL order: --db, $SLURMGUARD_DB, database.url.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slurmguard.errors import ConfigError

SEARCH_PATHS = ("policies.yaml", "/etc/slurmguard/policies.yaml")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ---------------------------------------------------------------- storage / slurm
class DatabasePolicy(Strict):
    url: str = "sqlite:////var/lib/slurmguard/slurmguard.db"
    """SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://user@host/db."""


class SlurmPolicy(Strict):
    backend: Literal["commands", "pyslurm"] = "commands"
    command_timeout_s: float = Field(15.0, gt=0)
    """Timeout of one scontrol/sinfo/squeue/sbatch call, seconds."""
    bin_dir: str | None = None
    """Directory of the Slurm commands; None = search PATH."""


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
    """Greyhound 4.3: a group is slow if its time exceeds the group median by this."""
    min_groups: int = Field(3, ge=2)


class MycroftPolicy(Strict):
    stall_window_s: float = Field(60.0, gt=0)
    """Ops in flight with no completion for this long is a stall."""
    late_threshold_s: float = Field(1.0, gt=0)
    """Constant late start/end beyond this names the late rank (Mycroft 5)."""
    throughput_drop: float = Field(0.5, gt=0, lt=1)
    """Straggler trigger: throughput falls to this fraction of its baseline."""
    interval_growth: float = Field(2.0, gt=1)
    """Straggler trigger: op interval grows by this factor."""
    max_sampled_ranks: int = Field(10, ge=1)


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
    period: PeriodPolicy = PeriodPolicy()
    bocd: BocdPolicy = BocdPolicy()
    cross_group: CrossGroupPolicy = CrossGroupPolicy()
    mycroft: MycroftPolicy = MycroftPolicy()
    peers: PeerPolicy = PeerPolicy()


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
    """Signal sent to the job's batch step to ask for a checkpoint."""

    @model_validator(mode="after")
    def _ordered(self) -> "TierPolicy":
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
    tiers: TierPolicy = TierPolicy()
    escalation: EscalationPolicy = EscalationPolicy()


# ---------------------------------------------------------------- safety
class BreakerPolicy(Strict):
    max_nodes: int = Field(2, ge=0)
    """At most this many nodes drained by slurmguard per window (whole cluster)."""
    max_partition_percent: float = Field(10.0, ge=0, le=100)
    """At most this share of a partition drained by slurmguard per window."""
    window_s: float = Field(3600.0, gt=0)


class RateLimitPolicy(Strict):
    max_actions: int = Field(20, ge=1)
    window_s: float = Field(600.0, gt=0)


class SafetyPolicy(Strict):
    dry_run: bool = False
    breaker: BreakerPolicy = BreakerPolicy()
    rate_limit: RateLimitPolicy = RateLimitPolicy()


# ---------------------------------------------------------------- daemons
class AgentPolicy(Strict):
    ring_root: str = "/dev/shm/slurmguard"
    sample_interval_s: float = Field(5.0, gt=0)
    report_interval_s: float = Field(10.0, gt=0)
    telemetry_source: Literal["sim", "nvml", "dcgm", "prometheus", "none"] = "sim"
    controller_url: str = "http://127.0.0.1:8642"
    request_timeout_s: float = Field(5.0, gt=0)
    buffer_max_reports: int = Field(1000, ge=1)
    secret_file: str = "/etc/slurmguard/secret"
    warmup_steps: int = Field(5, ge=0)
    """Iterations skipped before the baseline window (compilation, cache warm-up)."""
    baseline_steps: int = Field(32, ge=3)
    """Iterations (after the warm-up) that set a rank's healthy baseline and its
    step pattern for the step detector; a pattern of period p needs 3p of them
    (32: every period up to detection.bocd.max_period = 8)."""
    report_steps: int = Field(256, ge=8)
    """Most recent iterations of each rank sent in every report."""
    max_ops_per_rank: int = Field(16384, ge=256)
    """Ring records kept per rank for period and step-time analysis."""


class ControllerPolicy(Strict):
    listen_host: str = "127.0.0.1"
    listen_port: int = Field(8642, ge=1, le=65535)
    cycle_interval_s: float = Field(5.0, gt=0)
    report_stale_s: float = Field(120.0, gt=0)
    secret_file: str = "/etc/slurmguard/secret"


# ---------------------------------------------------------------- sweeps / triage
class SweepPolicy(Strict):
    device: Literal["auto", "cuda", "cpu"] = "auto"
    gemm_duration_s: float = Field(60.0, gt=0)
    """Per dtype; long enough for a GPU to reach thermal steady state."""
    gemm_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    gemm_size: int = Field(8192, ge=64)
    membw_bytes: int = Field(1 << 30, ge=1 << 20)
    message_sizes_mb: tuple[int, ...] = (16, 32, 64)
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
    inject_file: str | None = None
    """TESTS/DEMO ONLY: fault file passed to sweep jobs as SLURMGUARD_SWEEP_INJECT_FILE."""


class TriagePolicy(Strict):
    ladder: tuple[Literal["resweep", "reboot", "reimage", "terminal"], ...] = (
        "resweep", "reboot", "reimage", "terminal")
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
class WhatIfPolicy(Strict):
    """Paper 004 (what-if analysis of job traces): thresholds of its metrics."""

    top_worker_percent: float = Field(3.0, gt=0, le=100)
    """M_W (Eq. 5) fixes the workers with the highest 3% of S_w."""
    max_discrepancy: float = Field(0.05, gt=0)
    """Section 6: traces whose simulated original step time is off by more are flagged."""
    straggling_slowdown: float = Field(1.1, ge=1)
    """Section 4.2: a job is straggling when its slowdown S reaches this."""
    dominant_share: float = Field(0.5, gt=0)
    """M_W or M_S at or above this names the cause (sections 5.1, 5.2: 'a majority')."""
    affected_share: float = Field(0.2, gt=0, le=1)
    """A worker is affected when S_w - 1 is at least this share of S - 1 (heatmap cell lit)."""
    widespread_fraction: float = Field(0.5, gt=0, le=1)
    """This share of workers affected is a widespread pattern (section 8, Fig. 14)."""
    seq_imbalance_correlation: float = Field(0.9, gt=-1, le=1)
    """Section 5.3: forward/backward compute correlation suggesting sequence-length imbalance."""
    memory_mb: int = Field(256, ge=16)
    """Simulator working-set budget; scenarios are simulated in chunks that fit."""


# ---------------------------------------------------------------- prolog / epilog
class PrologPolicy(Strict):
    """Slurm Prolog/Epilog (prolog_epilog/): pre-job node checks and the job trace archive."""

    checks: tuple[Literal["gpu_count", "gpu_health", "nic_link"], ...] = (
        "gpu_count", "gpu_health", "nic_link")
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
    epilog_fail_on_cleanup_error: bool = True
    """Rings the epilog cannot remove keep RAM (tmpfs) in use: exit non-zero so Slurm
    drains the node. Archive problems never fail the epilog."""


class Policy(Strict):
    database: DatabasePolicy = DatabasePolicy()
    slurm: SlurmPolicy = SlurmPolicy()
    detection: DetectionPolicy = DetectionPolicy()
    response: ResponsePolicy = ResponsePolicy()
    safety: SafetyPolicy = SafetyPolicy()
    agent: AgentPolicy = AgentPolicy()
    controller: ControllerPolicy = ControllerPolicy()
    sweeps: SweepPolicy = SweepPolicy()
    triage: TriagePolicy = TriagePolicy()
    whatif: WhatIfPolicy = WhatIfPolicy()
    prolog: PrologPolicy = PrologPolicy()


# ---------------------------------------------------------------- loading
class _LineLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (YAML silently keeps the last)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first at line {seen[key]})", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_index(node: yaml.Node, prefix: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map every key path in a composed YAML tree to its 1-based line."""
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


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate policy YAML text. Raises ConfigError 'FILE:LINE: KEY: message'."""
    try:
        root = yaml.compose(text, Loader=_LineLoader)
        data = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{line}: invalid YAML: {problem}") from None
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
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            messages.append(f"{source}:{line}: {_format_loc(loc)}: {msg}")
        raise ConfigError("; ".join(messages)) from None


def find_policy_file(explicit: str | os.PathLike | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    env = os.environ.get("SLURMGUARD_POLICY")
    if env:
        return Path(env)
    for candidate in SEARCH_PATHS:
        p = Path(candidate)
        if p.is_file():
            return p
    return None


def load_policy(path: str | os.PathLike | None = None) -> Policy:
    """Load and validate the policy; built-in defaults when no file is found."""
    p = find_policy_file(path)
    if p is None:
        return Policy()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: policy file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read policy file: {exc}") from None
    return parse_policy(text, str(p))


def database_url(policy: Policy, override: str | None = None) -> str:
    """--db beats $SLURMGUARD_DB beats database.url."""
    return override or os.environ.get("SLURMGUARD_DB") or policy.database.url
