"""The sweep result: one versioned JSON schema for 1-node, 2-node and multi-node sweeps.

Every sweep workload (sweeps/node_sweep.py, sweeps/pair_sweep.py) writes exactly one
document of this shape, on GPU and on CPU alike. `parse_result` validates it strictly:
unknown keys, wrong types, non-finite numbers, bad node names or inconsistent indexes
raise ResultError naming the file and the JSON path, so a malformed result becomes a
failing verdict with a readable reason instead of a traceback or, worse, a pass.

Units: throughput in TFLOP/s (1e12 FLOP/s), bandwidths in GB/s (1e9 bytes/s), message
sizes in MiB (size_mb * 2**20 bytes, as nccl-tests counts them), times in seconds,
timestamps in seconds since the Unix epoch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from slurmguard.errors import InputError
from slurmguard.names import NODE_NAME_RULE, is_node_name

SCHEMA_NAME = "slurmguard.sweep"
SCHEMA_VERSION = 1

Kind = Literal["node", "pair", "multi"]
KINDS: tuple[str, ...] = ("node", "pair", "multi")
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")
GEMM_DTYPES: tuple[str, ...] = ("float32", "tf32", "bfloat16", "float16")
SCHEDULES: tuple[str, ...] = ("ring", "tree")
SCOPES: tuple[str, ...] = ("intra", "cross")

_PRINTABLE_RE = re.compile(r"^[\x20-\x7e]*$")


class ResultError(InputError):
    """A sweep result is missing, not JSON, or does not follow the schema.

    `path` is the JSON path of the offending value ("$" for the whole document).
    """

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = source
        self.path = path
        self.problem = message
        super().__init__(f"{source}: {path}: {message}")


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class GemmMeasurement:
    dtype: str
    tflops: float
    """Sustained throughput over the second half of the run (thermal steady state)."""
    tflops_initial: float
    """Throughput of the first timing window; initial >> sustained shows throttling."""
    iterations: int
    seconds: float
    checks: int = 0
    """Products verified against a float64 reference (Freivalds' test) during the run."""
    max_error: float | None = None
    """Largest verification error as a multiple of its rounding bound (> 1: wrong answer)."""


@dataclass(frozen=True)
class DeviceMetrics:
    node: str
    index: int
    name: str
    gemm: tuple[GemmMeasurement, ...] = ()
    membw_gbps: float | None = None
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9."""
    telemetry: Mapping[str, Any] | None = None
    """Sampled during the sweep: {"source": "nvml"|"cgroup"|"none", "samples": N,
    "sm_clock_mhz"/"power_w"/"temperature_c": {"min","median","max"}, "throttle_reasons":
    [names seen], "throttle_share": {name: share of samples (GPU) or CPU periods with it},
    "throttled_s": seconds throttled (cgroup CPU quota on the CPU path)}."""


@dataclass(frozen=True)
class PeerCopy:
    """One directed GPU-to-GPU copy inside a node (the pairwise matrix, off-diagonal)."""

    node: str
    src: int
    dst: int
    gbps: float
    asymmetry: float
    """|bw(src,dst) - bw(dst,src)| / max of the two; 0 = symmetric."""
    vs_node_median: float
    """bw / median of all pairs in this node - 1 (negative = slower than its peers)."""


@dataclass(frozen=True)
class AllReduceMeasurement:
    scope: str  # "intra" (inside one node) | "cross" (across the nodes of the sweep)
    size_mb: int
    ranks: int
    time_s: float
    """Median over repeats of the slowest rank's time."""
    algbw_gbps: float
    busbw_gbps: float
    """algbw * 2(n-1)/n, the nccl-tests bus bandwidth of a ring all-reduce."""


@dataclass(frozen=True)
class Transfer:
    """One directed send/recv between GPUs of two nodes, measured in one pass."""

    schedule: str  # "ring" | "tree" (a 2-node sweep is the 2-rank ring: both directions)
    pass_index: int
    src_node: str
    src_gpu: int
    dst_node: str
    dst_gpu: int
    size_mb: int
    time_s: float
    """Median over repeats of max(sender time, receiver time)."""
    gbps: float


@dataclass(frozen=True)
class SweepErrorRecord:
    where: str
    message: str


STAGE_NAMES: tuple[str, ...] = ("dcgm_diag", "nccl_all_reduce", "nvbandwidth", "ib_write_bw")
STAGE_STATUSES: tuple[str, ...] = ("pass", "fail", "error", "skipped")


@dataclass(frozen=True)
class StageResult:
    """One standard tool run as a sweep stage (slurmguard.sweeps.tools)."""

    name: str
    status: str
    """pass; fail (the tool reported a failure: node evidence); error (missing when
    required, timed out, unreadable output: not the node's fault); skipped (not installed,
    switched off or not applicable)."""
    reason: str
    seconds: float
    figures: Mapping[str, float] = field(default_factory=dict)
    """The tool's own figures, e.g. {"busbw_gbps/1024MB": 480.1} (GB/s, MiB as the tool)."""
    evidence: str = ""
    """The end of the tool's output (at most 4000 characters)."""


@dataclass(frozen=True)
class SweepSettings:
    """The measurement settings a sweep ran with, as recorded in its result ($.settings).

    The sweep workloads (sweeps/sweeplib.py ``Settings``) extend this record with the
    run-only knobs, so the fields written and the fields parsed are the same ones.
    """

    gemm_duration_s: float
    gemm_dtypes: tuple[str, ...]
    gemm_size: int
    membw_bytes: int
    message_sizes_mb: tuple[int, ...]
    repeats: int

    def to_schema(self) -> dict[str, Any]:
        """The ``settings`` object of the result JSON (read back by parse_result)."""
        return {
            "gemm_duration_s": self.gemm_duration_s,
            "gemm_dtypes": list(self.gemm_dtypes),
            "gemm_size": self.gemm_size,
            "membw_bytes": self.membw_bytes,
            "message_sizes_mb": list(self.message_sizes_mb),
            "repeats": self.repeats,
        }


@dataclass(frozen=True)
class SweepResult:
    kind: str
    nodes: tuple[str, ...]
    node_under_test: str
    reference: str | None
    hw_class: str
    device: str
    device_name: str
    devices_per_node: int
    started: float
    finished: float
    settings: SweepSettings
    job_id: str | None = None
    devices: tuple[DeviceMetrics, ...] = ()
    p2p: tuple[PeerCopy, ...] = ()
    allreduce: tuple[AllReduceMeasurement, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    errors: tuple[SweepErrorRecord, ...] = ()
    stages: tuple[StageResult, ...] = ()
    injected: Mapping[str, Any] | None = None
    """The faults the development tools' launcher injected (slurmguard_dev.sweepfaults);
    None from the product's own run, which cannot inject any."""
    schema: str = SCHEMA_NAME
    version: int = SCHEMA_VERSION

    @property
    def label(self) -> str:
        """Short sweep name used in reasons: sweep1 (1 node), sweep2 (pair), sweepN."""
        return f"sweep{len(self.nodes)}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["injected"] = dict(self.injected) if self.injected is not None else None
        # schema/version first: a reader sees what it is before anything else
        return {"schema": d.pop("schema"), "version": d.pop("version"), **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)


# ---------------------------------------------------------------- validation
@dataclass
class _V:
    """Strict field access with JSON-path error messages."""

    source: str
    errors: list[str] = field(default_factory=list)

    def fail(self, path: str, message: str) -> ResultError:
        return ResultError(self.source, path, message)

    def obj(self, value: Any, path: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {_tname(value)}")
        req, opt = tuple(required), tuple(optional)
        for k in value:
            if not isinstance(k, str) or (k not in req and k not in opt):
                raise self.fail(f"{path}.{k}", "unknown key")
        for k in req:
            if k not in value:
                raise self.fail(f"{path}.{k}", "missing")
        return value

    def num(self, value: Any, path: str, *, minimum: float = 0.0, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"expected a number, got {_tname(value)}")
        v = float(value)
        if not math.isfinite(v):
            raise self.fail(path, "expected a finite number")
        if v < minimum or (positive and v <= 0):
            raise self.fail(path, f"expected a number {'>' if positive else '>='} {minimum:g}, got {v:g}")
        return v

    def int_(self, value: Any, path: str, *, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"expected an integer, got {_tname(value)}")
        if value < minimum:
            raise self.fail(path, f"expected an integer >= {minimum}, got {value}")
        return value

    def str_(
        self, value: Any, path: str, *, choices: tuple[str, ...] | None = None, max_len: int = 256
    ) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {_tname(value)}")
        if choices is not None and value not in choices:
            raise self.fail(path, f"expected one of {', '.join(choices)}, got {value!r}")
        if len(value) > max_len or not _PRINTABLE_RE.match(value):
            raise self.fail(path, f"expected printable ASCII text of at most {max_len} characters")
        return value

    def node(self, value: Any, path: str) -> str:
        s = self.str_(value, path)
        if not is_node_name(s):
            raise self.fail(path, f"invalid node name {s!r} ({NODE_NAME_RULE})")
        return s

    def list_(self, value: Any, path: str) -> list:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list, got {_tname(value)}")
        return value


def _tname(v: Any) -> str:
    if v is None:
        return "null"
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "list",
        dict: "object",
    }.get(type(v), type(v).__name__)


def parse_result_text(text: str | bytes | None, source: str = "<result>") -> SweepResult:
    """Parse and validate a result document. Raises ResultError on anything wrong."""
    if text is None:
        raise ResultError(source, "$", "no result was written")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ResultError(source, "$", f"not UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ResultError(source, "$", "empty result")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ResultError(
            source, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except ValueError as exc:
        raise ResultError(source, "$", str(exc)) from None
    return parse_result(data, source)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON constant {name}")


def parse_result(data: Any, source: str = "<result>") -> SweepResult:
    """Validate an already-decoded result document (see module docstring for units)."""
    v = _V(source)
    top = v.obj(
        data,
        "$",
        required=(
            "schema",
            "version",
            "kind",
            "nodes",
            "node_under_test",
            "reference",
            "hw_class",
            "device",
            "device_name",
            "devices_per_node",
            "started",
            "finished",
            "settings",
            "devices",
            "p2p",
            "allreduce",
            "transfers",
            "errors",
        ),
        optional=("job_id", "injected", "stages"),
    )
    if top["schema"] != SCHEMA_NAME:
        raise v.fail("$.schema", f"expected {SCHEMA_NAME!r}, got {top['schema']!r}")
    version = v.int_(top["version"], "$.version")
    if version != SCHEMA_VERSION:
        raise v.fail(
            "$.version", f"unsupported schema version {version} (this slurmguard reads {SCHEMA_VERSION})"
        )
    kind = v.str_(top["kind"], "$.kind", choices=KINDS)
    nodes = tuple(v.node(n, f"$.nodes[{i}]") for i, n in enumerate(v.list_(top["nodes"], "$.nodes")))
    want = {"node": (1, 1), "pair": (2, 2), "multi": (3, 4096)}[kind]
    if not want[0] <= len(nodes) <= want[1]:
        raise v.fail(
            "$.nodes",
            f"a {kind} sweep has {want[0] if want[0] == want[1] else f'{want[0]}+'}"
            f" node(s), got {len(nodes)}",
        )
    if len(set(nodes)) != len(nodes):
        raise v.fail("$.nodes", "duplicate node names")
    nut = v.node(top["node_under_test"], "$.node_under_test")
    if nut not in nodes:
        raise v.fail("$.node_under_test", f"{nut!r} is not one of the sweep's nodes")
    reference = None
    if top["reference"] is not None:
        reference = v.node(top["reference"], "$.reference")
        if reference not in nodes or reference == nut:
            raise v.fail("$.reference", f"{reference!r} must be another node of the sweep")
    if kind == "pair" and reference is None:
        raise v.fail("$.reference", "a pair sweep names its reference node")
    if kind == "node" and reference is not None:
        raise v.fail("$.reference", "a 1-node sweep has no reference")
    hw_class = v.str_(top["hw_class"], "$.hw_class", max_len=128)
    if not hw_class:
        raise v.fail("$.hw_class", "empty hardware class")
    device = v.str_(top["device"], "$.device", choices=DEVICE_TYPES)
    device_name = v.str_(top["device_name"], "$.device_name", max_len=128)
    dpn = v.int_(top["devices_per_node"], "$.devices_per_node", minimum=0)
    started = v.num(top["started"], "$.started")
    finished = v.num(top["finished"], "$.finished")
    if finished < started:
        raise v.fail("$.finished", "finished before it started")
    job_id = top.get("job_id")
    if job_id is not None:
        job_id = v.str_(job_id, "$.job_id", max_len=64)
    settings = _settings(v, top["settings"])
    node_set = set(nodes)

    def gpu(value: Any, path: str) -> int:
        i = v.int_(value, path)
        if i >= max(dpn, 1):
            raise v.fail(path, f"GPU index {i} out of range (devices_per_node={dpn})")
        return i

    def member(value: Any, path: str) -> str:
        n = v.node(value, path)
        if n not in node_set:
            raise v.fail(path, f"{n!r} is not one of the sweep's nodes")
        return n

    devices = []
    for i, d in enumerate(v.list_(top["devices"], "$.devices")):
        p = f"$.devices[{i}]"
        d = v.obj(d, p, required=("node", "index", "name", "gemm", "membw_gbps"), optional=("telemetry",))
        gemm = []
        seen_dt: set[str] = set()
        for j, g in enumerate(v.list_(d["gemm"], f"{p}.gemm")):
            q = f"{p}.gemm[{j}]"
            g = v.obj(
                g,
                q,
                required=("dtype", "tflops", "tflops_initial", "iterations", "seconds"),
                optional=("checks", "max_error"),
            )
            dt = v.str_(g["dtype"], f"{q}.dtype", choices=GEMM_DTYPES)
            if dt in seen_dt:
                raise v.fail(f"{q}.dtype", f"duplicate dtype {dt}")
            seen_dt.add(dt)
            me = g.get("max_error")
            gemm.append(
                GemmMeasurement(
                    dt,
                    v.num(g["tflops"], f"{q}.tflops"),
                    v.num(g["tflops_initial"], f"{q}.tflops_initial"),
                    v.int_(g["iterations"], f"{q}.iterations"),
                    v.num(g["seconds"], f"{q}.seconds"),
                    v.int_(g.get("checks", 0), f"{q}.checks"),
                    None if me is None else v.num(me, f"{q}.max_error"),
                )
            )
        mb = d["membw_gbps"]
        tel = d.get("telemetry")
        devices.append(
            DeviceMetrics(
                member(d["node"], f"{p}.node"),
                gpu(d["index"], f"{p}.index"),
                v.str_(d["name"], f"{p}.name", max_len=128),
                tuple(gemm),
                None if mb is None else v.num(mb, f"{p}.membw_gbps"),
                None if tel is None else _telemetry(v, tel, f"{p}.telemetry"),
            )
        )
    keys = [(d.node, d.index) for d in devices]
    if len(set(keys)) != len(keys):
        raise v.fail("$.devices", "the same GPU is listed twice")

    p2p = []
    for i, c in enumerate(v.list_(top["p2p"], "$.p2p")):
        p = f"$.p2p[{i}]"
        c = v.obj(c, p, required=("node", "src", "dst", "gbps", "asymmetry", "vs_node_median"))
        src, dst = gpu(c["src"], f"{p}.src"), gpu(c["dst"], f"{p}.dst")
        if src == dst:
            raise v.fail(f"{p}.dst", "a copy needs two different GPUs")
        p2p.append(
            PeerCopy(
                member(c["node"], f"{p}.node"),
                src,
                dst,
                v.num(c["gbps"], f"{p}.gbps"),
                v.num(c["asymmetry"], f"{p}.asymmetry"),
                v.num(c["vs_node_median"], f"{p}.vs_node_median", minimum=-1.0),
            )
        )

    allreduce = []
    for i, a in enumerate(v.list_(top["allreduce"], "$.allreduce")):
        p = f"$.allreduce[{i}]"
        a = v.obj(a, p, required=("scope", "size_mb", "ranks", "time_s", "algbw_gbps", "busbw_gbps"))
        allreduce.append(
            AllReduceMeasurement(
                v.str_(a["scope"], f"{p}.scope", choices=SCOPES),
                v.int_(a["size_mb"], f"{p}.size_mb", minimum=1),
                v.int_(a["ranks"], f"{p}.ranks", minimum=2),
                v.num(a["time_s"], f"{p}.time_s", positive=True),
                v.num(a["algbw_gbps"], f"{p}.algbw_gbps"),
                v.num(a["busbw_gbps"], f"{p}.busbw_gbps"),
            )
        )

    transfers = []
    for i, t in enumerate(v.list_(top["transfers"], "$.transfers")):
        p = f"$.transfers[{i}]"
        t = v.obj(
            t,
            p,
            required=(
                "schedule",
                "pass_index",
                "src_node",
                "src_gpu",
                "dst_node",
                "dst_gpu",
                "size_mb",
                "time_s",
                "gbps",
            ),
        )
        sn, dn = member(t["src_node"], f"{p}.src_node"), member(t["dst_node"], f"{p}.dst_node")
        if sn == dn:
            raise v.fail(f"{p}.dst_node", "a cross-node transfer needs two different nodes")
        transfers.append(
            Transfer(
                v.str_(t["schedule"], f"{p}.schedule", choices=SCHEDULES),
                v.int_(t["pass_index"], f"{p}.pass_index"),
                sn,
                gpu(t["src_gpu"], f"{p}.src_gpu"),
                dn,
                gpu(t["dst_gpu"], f"{p}.dst_gpu"),
                v.int_(t["size_mb"], f"{p}.size_mb", minimum=1),
                v.num(t["time_s"], f"{p}.time_s", positive=True),
                v.num(t["gbps"], f"{p}.gbps"),
            )
        )

    errors = []
    for i, e in enumerate(v.list_(top["errors"], "$.errors")):
        p = f"$.errors[{i}]"
        e = v.obj(e, p, required=("where", "message"))
        errors.append(
            SweepErrorRecord(
                v.str_(e["where"], f"{p}.where", max_len=128), _clean(e["message"], v, f"{p}.message")
            )
        )
    stages = []
    for i, st in enumerate(v.list_(top.get("stages", []), "$.stages")):
        p = f"$.stages[{i}]"
        st = v.obj(st, p, required=("name", "status", "reason", "seconds", "figures", "evidence"))
        figs = (
            v.obj(
                st["figures"],
                f"{p}.figures",
                required=(),
                optional=tuple(k for k in st["figures"] if isinstance(k, str) and len(k) <= 128),
            )
            if isinstance(st["figures"], dict)
            else v.obj(st["figures"], f"{p}.figures", ())
        )
        stages.append(
            StageResult(
                v.str_(st["name"], f"{p}.name", choices=STAGE_NAMES),
                v.str_(st["status"], f"{p}.status", choices=STAGE_STATUSES),
                _clean(st["reason"], v, f"{p}.reason"),
                v.num(st["seconds"], f"{p}.seconds"),
                {k: v.num(x, f"{p}.figures.{k}", minimum=-1e300) for k, x in figs.items()},
                _clean(st["evidence"], v, f"{p}.evidence", limit=4000),
            )
        )
    injected = top.get("injected")
    if injected is not None and not isinstance(injected, dict):
        raise v.fail("$.injected", f"expected an object or null, got {_tname(injected)}")
    return SweepResult(
        kind=kind,
        nodes=nodes,
        node_under_test=nut,
        reference=reference,
        hw_class=hw_class,
        device=device,
        device_name=device_name,
        devices_per_node=dpn,
        started=started,
        finished=finished,
        settings=settings,
        job_id=job_id,
        devices=tuple(devices),
        p2p=tuple(p2p),
        allreduce=tuple(allreduce),
        transfers=tuple(transfers),
        errors=tuple(errors),
        stages=tuple(stages),
        injected=injected,
    )


def _clean(value: Any, v: _V, path: str, limit: int = 1000) -> str:
    """Error messages come from exceptions; keep them but make them one printable line."""
    if not isinstance(value, str):
        raise v.fail(path, f"expected a string, got {_tname(value)}")
    return (
        re.sub(r"[^\x20-\x7e]+", " ", value)[-limit:]
        if limit > 1000
        else re.sub(r"[^\x20-\x7e]+", " ", value)[:limit]
    )


_TELEMETRY_STATS = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "temperature_c")


def _telemetry(v: _V, value: Any, path: str) -> dict[str, Any]:
    t = v.obj(
        value,
        path,
        required=("source", "samples"),
        optional=(*_TELEMETRY_STATS, "throttle_reasons", "throttle_share", "throttled_s", "error"),
    )
    out: dict[str, Any] = {
        "source": v.str_(t["source"], f"{path}.source", choices=("nvml", "cgroup", "none")),
        "samples": v.int_(t["samples"], f"{path}.samples"),
    }
    for k in _TELEMETRY_STATS:
        if t.get(k) is not None:
            st = v.obj(t[k], f"{path}.{k}", required=("min", "median", "max"))
            out[k] = {q: v.num(st[q], f"{path}.{k}.{q}") for q in ("min", "median", "max")}
    if t.get("throttle_reasons") is not None:
        out["throttle_reasons"] = [
            v.str_(x, f"{path}.throttle_reasons[{i}]", max_len=64)
            for i, x in enumerate(v.list_(t["throttle_reasons"], f"{path}.throttle_reasons"))
        ]
    if t.get("throttle_share") is not None:
        sh = t["throttle_share"]
        if not isinstance(sh, dict):
            raise v.fail(f"{path}.throttle_share", f"expected an object, got {_tname(sh)}")
        out["throttle_share"] = {
            v.str_(k, f"{path}.throttle_share", max_len=64): v.num(x, f"{path}.throttle_share.{k}")
            for k, x in sh.items()
        }
    if t.get("throttled_s") is not None:
        out["throttled_s"] = v.num(t["throttled_s"], f"{path}.throttled_s")
    if t.get("error") is not None:
        out["error"] = _clean(t["error"], v, f"{path}.error")
    return out


def _settings(v: _V, value: Any) -> SweepSettings:
    s = v.obj(
        value,
        "$.settings",
        required=(
            "gemm_duration_s",
            "gemm_dtypes",
            "gemm_size",
            "membw_bytes",
            "message_sizes_mb",
            "repeats",
        ),
    )
    dts = tuple(
        v.str_(d, f"$.settings.gemm_dtypes[{i}]", choices=GEMM_DTYPES)
        for i, d in enumerate(v.list_(s["gemm_dtypes"], "$.settings.gemm_dtypes"))
    )
    sizes = tuple(
        v.int_(m, f"$.settings.message_sizes_mb[{i}]", minimum=1)
        for i, m in enumerate(v.list_(s["message_sizes_mb"], "$.settings.message_sizes_mb"))
    )
    return SweepSettings(
        v.num(s["gemm_duration_s"], "$.settings.gemm_duration_s", positive=True),
        dts,
        v.int_(s["gemm_size"], "$.settings.gemm_size", minimum=1),
        v.int_(s["membw_bytes"], "$.settings.membw_bytes", minimum=1),
        sizes,
        v.int_(s["repeats"], "$.settings.repeats", minimum=1),
    )


def load_result(path: str, read_text: Any = None) -> SweepResult:
    """Read and parse a result file; a missing/unreadable file is a ResultError too."""
    try:
        if read_text is not None:
            text = read_text(path)
        else:
            with open(path, "rb") as fh:
                text = fh.read()
    except FileNotFoundError:
        raise ResultError(path, "$", "no result file (the sweep did not write one)") from None
    except OSError as exc:
        raise ResultError(path, "$", f"cannot read: {exc.strerror or exc}") from None
    return parse_result_text(text, path)
