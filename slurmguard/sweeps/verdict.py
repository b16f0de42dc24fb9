"""Sweep verdicts: pure functions from (job outcome, result, class baseline) to a decision.

Rules (Guard 5.4, "interpreted conservatively"):

* a sweep that crashed, timed out, wrote nothing, wrote malformed JSON, reported errors or
  left a metric unmeasured FAILS, never passes;
* each metric is compared with a reference, the first that exists of: the CLASS baseline
  (median of healthy nodes of the same hardware class, at least `bootstrap_min_nodes`
  within `baseline_max_age_h`), the same-window PEERS (healthy nodes of the class swept
  within `peer_window_min` of this sweep, at least `peer_min_nodes`: a fresh install has no
  baseline yet) and the model's FLOOR (`floors`: spec-sheet figures x fraction). The
  verdict names the one it used ("vs class", "vs peers", "vs floor"). Within
  `pass_tolerance` (5% by default) of a class or peer median passes; only a shortfall
  fails (faster is fine); a floor is a plain minimum;
* a device throttled during the run for a reason of `throttle_fail_reasons` (thermal or
  hardware slowdown, a CPU quota on the CPU path) in `throttle_fail_share` of the samples
  fails, whatever its peers measured;
* a standard-tool stage (DCGM diagnostics, nccl-tests, nvbandwidth, ib_write_bw) that
  reports a failure fails the sweep with its own evidence; a stage that could not run
  properly (missing when required, hung, unreadable output) makes the sweep INCONCLUSIVE:
  the node is neither failed nor returned on it (the scheduler sweeps again, then holds);
* nodes with at least `peer_min_devices` GPUs also compare each GPU with the node's own
  median, which catches one throttled GPU even before a class baseline exists;
* with no reference at all, an unsuspected node's sweep is accepted as a BOOTSTRAP sample;
  a suspected node gets INSUFFICIENT_BASELINE and stays quarantined (no evidence is not a
  pass) while the scheduler sweeps peers for it;
* a 2-node sweep is symmetric: a slow link between node and reference reads slow from both
  ends. It blames the node under test only when the reference is trusted: its own last
  sweep passed and it has not failed its last `reference_max_failures` pair sweeps with
  different partners. Otherwise the result is INCONCLUSIVE (sweep again with another
  reference) rather than a drain of a possibly healthy node.

Reasons fit Slurm's reason field and start with "slurmguard:", e.g.
``slurmguard: sweep1 gpu5 gemm_bf16 -18% vs class``.
"""

from __future__ import annotations

import fnmatch
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from slurmguard.config import ModelFloor, SweepPolicy
from slurmguard.sweeps.baseline import (
    ClassBaseline,
    Metric,
    expected_keys,
    extract_metrics,
)
from slurmguard.sweeps.result import ResultError, SweepResult, Transfer, parse_result_text

REASON_PREFIX = "slurmguard:"
MAX_REASON_LEN = 120
_REASON_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:%+()/=<>\[\]-]")


class Outcome(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    BOOTSTRAP = "bootstrap"
    """Accepted without a class baseline: an unsuspected node seeding its class's baseline."""
    INSUFFICIENT_BASELINE = "insufficient_baseline"
    INCONCLUSIVE = "inconclusive"
    """The evidence cannot be pinned on the node: a 2-node sweep with an untrusted
    reference, or a tool stage that could not run properly."""

    @property
    def returns_node(self) -> bool:
        """True when the node may go back into service on this sweep's evidence."""
        return self in (Outcome.PASS, Outcome.BOOTSTRAP)

    @property
    def healthy_sample(self) -> bool:
        """True when the result may join the class baseline."""
        return self in (Outcome.PASS, Outcome.BOOTSTRAP)


@dataclass(frozen=True)
class MetricCheck:
    key: str
    label: str
    value: float | None
    """Measured value; None when the metric is missing from the result."""
    reference: float | None
    """What it was compared with (class/peer/node median, or the floor); None when not judged."""
    count: int
    """Nodes (class/peers basis) or GPUs (node basis) behind the reference; 0 for a floor."""
    basis: str
    """'class', 'peers', 'floor', 'node' (the GPU's own node median), 'stage', 'telemetry'
    (throttled during the run) or 'missing'."""
    deviation: float | None
    """value / reference - 1 (fraction; -0.18 = 18% slow)."""
    ok: bool


@dataclass(frozen=True)
class ReferenceStatus:
    node: str
    trusted: bool
    why: str


@dataclass(frozen=True)
class SweepJudgment:
    node: str
    kind: str
    label: str
    outcome: Outcome
    reason: str
    """Slurm reason / comment text, 'slurmguard: ...', at most MAX_REASON_LEN characters."""
    detail: str
    """Longer one-line explanation for logs and the triage report."""
    failures: tuple[MetricCheck, ...] = ()
    checks: tuple[MetricCheck, ...] = ()
    result: SweepResult | None = None
    reference: str | None = None
    basis: str = "none"
    """Reference the metrics were judged against: 'class', 'peers', 'floor' or 'none'."""
    basis_nodes: tuple[str, ...] = ()
    """The healthy nodes behind a class or peer reference."""
    basis_model: str | None = None
    """The floor's model pattern when basis is 'floor'."""

    @property
    def basis_text(self) -> str:
        """'class baseline (node1,node4)', 'same-window peers (node1)', 'policy floor (H100*)'."""
        return describe_basis(self.basis, self.basis_nodes, self.basis_model)


BASIS_NAMES = {
    "class": "class baseline",
    "peers": "same-window peers",
    "floor": "policy floor",
    "none": "no reference",
}


def describe_basis(basis: str, nodes: Sequence[str] = (), model: str | None = None) -> str:
    name = BASIS_NAMES.get(basis, basis)
    if basis in ("class", "peers") and nodes:
        shown = ",".join(list(nodes)[:6]) + ("..." if len(nodes) > 6 else "")
        return f"{name} ({shown})"
    if basis == "floor" and model:
        return f"{name} ({model})"
    return name


def floor_for(device_name: str, policy: SweepPolicy) -> ModelFloor | None:
    """The first policy floor whose model pattern matches the device name."""
    for f in policy.floors:
        if fnmatch.fnmatchcase(device_name, f.model):
            return f
    return None


def floor_value(key: str, floor: ModelFloor) -> float | None:
    """The spec figure of a metric key (see baseline.py) times the floor's fraction."""
    family = key.split("/", 1)[0]
    spec: float | None
    if family.startswith("gemm_"):
        spec = floor.gemm_tflops.get(family[5:])
    else:
        spec = {
            "membw": floor.membw_gbps,
            "p2p": floor.p2p_gbps,
            "allreduce_intra": floor.allreduce_intra_gbps,
            "send": floor.send_gbps,
            "recv": floor.send_gbps,
            "allreduce_cross": floor.allreduce_cross_gbps,
        }.get(family)
    return None if spec is None else spec * floor.fraction


@dataclass(frozen=True)
class JobOutcome:
    """How the sweep job ended, as the scheduler saw it in Slurm."""

    state: str
    """Final Slurm state: COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, OUT_OF_MEMORY..."""
    exit_code: int | None = None
    result_text: str | bytes | None = None
    """The result file's content; None when the file does not exist."""
    source: str = "<result>"


@dataclass(frozen=True)
class PastSweep:
    """A judged sweep from history, for reference trust."""

    result: SweepResult
    outcome: Outcome


def make_reason(text: str) -> str:
    """'slurmguard: <text>', restricted to characters safe on a Slurm command line."""
    body = _REASON_UNSAFE.sub("?", " ".join(text.split()))
    reason = f"{REASON_PREFIX} {body}"
    if len(reason) > MAX_REASON_LEN:
        reason = reason[: MAX_REASON_LEN - 3].rstrip() + "..."
    return reason


def _pct(dev: float) -> str:
    return f"{dev * 100:+.0f}%"


# ---------------------------------------------------------------- reference trust
def reference_status(reference: str, history: Iterable[PastSweep], policy: SweepPolicy) -> ReferenceStatus:
    """Whether a 2-node sweep against `reference` may blame its partner.

    Trusted when the reference's latest sweep as node under test returned it (pass or
    bootstrap) and its trailing run of failed pair sweeps *as reference* does not reach
    `reference_max_failures` distinct partners: two different nodes failing against the
    same reference in a row point at the reference, not at both partners.
    """
    past = sorted(history, key=lambda p: p.result.finished)
    own = [
        p
        for p in past
        if p.result.node_under_test == reference
        and p.outcome in (Outcome.PASS, Outcome.BOOTSTRAP, Outcome.FAIL)
    ]
    if not own:
        return ReferenceStatus(reference, False, f"{reference} has no judged sweep of its own")
    if not own[-1].outcome.returns_node:
        return ReferenceStatus(reference, False, f"{reference} failed its last own sweep")
    partners: list[str] = []
    for p in reversed(
        [
            p
            for p in past
            if p.result.kind == "pair"
            and p.result.reference == reference
            and p.outcome in (Outcome.PASS, Outcome.BOOTSTRAP, Outcome.FAIL)
        ]
    ):
        if p.outcome is not Outcome.FAIL:
            break
        partners.append(p.result.node_under_test)
    distinct = len(set(partners))
    if distinct >= policy.reference_max_failures:
        return ReferenceStatus(
            reference,
            False,
            f"{reference} failed its last {len(partners)} pair sweeps as reference"
            f" with {distinct} different partners",
        )
    return ReferenceStatus(reference, True, f"{reference} passed its last own sweep")


# ---------------------------------------------------------------- judging
def judge_job(
    job: JobOutcome,
    *,
    kind: str,
    node: str,
    baseline: ClassBaseline | None,
    policy: SweepPolicy,
    suspected: bool = True,
    reference: str | None = None,
    ref_status: ReferenceStatus | None = None,
    peers: ClassBaseline | None = None,
    use_floor: bool = True,
) -> SweepJudgment:
    """SweepJudgment for a finished sweep job: crash/timeout/no result/malformed result fail."""
    label = "sweep1" if kind == "node" else "sweep2" if kind == "pair" else "sweepN"
    state = (job.state.split() or ["UNKNOWN"])[0].upper()

    def fail(short: str, detail: str, result: SweepResult | None = None) -> SweepJudgment:
        return SweepJudgment(
            node,
            kind,
            label,
            Outcome.FAIL,
            make_reason(f"{label} {short}"),
            detail,
            result=result,
            reference=reference,
        )

    result: SweepResult | None = None
    parse_error: ResultError | None = None
    if job.result_text is not None:
        try:
            result = parse_result_text(job.result_text, job.source)
        except ResultError as exc:
            parse_error = exc
    if result is not None:
        label = result.label
    if result is not None and result.errors:
        e = result.errors[0]
        return fail(
            f"error in {e.where}: {e.message[:48]}",
            f"{len(result.errors)} error(s); first: {e.where}: {e.message}",
            result,
        )
    if state == "TIMEOUT":
        return fail("timed out", f"sweep job ended in TIMEOUT (exit {job.exit_code})", result)
    if state != "COMPLETED":
        code = "" if job.exit_code is None else f" exit {job.exit_code}"
        return fail(f"crashed ({state}{code})", f"sweep job ended in {state}{code}", result)
    if job.exit_code not in (None, 0):
        return fail(f"crashed (exit {job.exit_code})", f"sweep exited with status {job.exit_code}", result)
    if parse_error is not None:
        if parse_error.path == "$":
            problem = parse_error.problem.split(":")[0]
            short = "no result" if "no result" in problem else f"bad result: {problem}"
        else:
            short = f"bad result: {parse_error.path.removeprefix('$.')}"
        return fail(short, str(parse_error))
    if result is None:
        return fail("no result", f"{job.source}: the sweep completed but wrote no result")
    if result.kind != kind or result.node_under_test != node:
        return fail(
            f"bad result: {result.kind} of {result.node_under_test}",
            f"{job.source}: expected a {kind} sweep of {node}, got a {result.kind} sweep of"
            f" {result.node_under_test}",
            result,
        )
    if reference is not None and result.reference != reference:
        return fail(
            f"bad result: reference {result.reference}",
            f"{job.source}: expected reference {reference}, got {result.reference}",
            result,
        )
    return judge_result(
        result, baseline, policy, suspected=suspected, ref_status=ref_status, peers=peers, use_floor=use_floor
    )


def judge_result(
    result: SweepResult,
    baseline: ClassBaseline | None,
    policy: SweepPolicy,
    *,
    suspected: bool = True,
    ref_status: ReferenceStatus | None = None,
    peers: ClassBaseline | None = None,
    use_floor: bool = True,
) -> SweepJudgment:
    """SweepJudgment for a parsed 1-node or 2-node result against the first reference that
    exists: class baseline, same-window peers, policy floor (module docstring).
    use_floor=False: peers can still be swept, so the loose floor must not judge yet."""
    if result.kind == "multi":
        raise ValueError("multi-node results are judged per link: use judge_multi")
    node, label, tol = result.node_under_test, result.label, policy.pass_tolerance
    for b in (baseline, peers):
        if b is not None and (b.hw_class != result.hw_class or b.kind != result.kind):
            raise ValueError(
                f"baseline of {b.hw_class}/{b.kind} cannot judge a {result.hw_class}/{result.kind} result"
            )

    ref: ClassBaseline | None = None
    floor: ModelFloor | None = None
    if baseline is not None and baseline.node_count >= policy.bootstrap_min_nodes:
        ref, need = baseline, policy.bootstrap_min_nodes
    elif peers is not None and peers.node_count >= policy.peer_min_nodes:
        ref, need = peers, policy.peer_min_nodes
    elif use_floor:
        floor = floor_for(result.device_name, policy)
    basis = ref.basis if ref is not None else "floor" if floor is not None else "none"
    basis_nodes = ref.nodes if ref is not None else ()

    def verdict(
        outcome: Outcome,
        short: str,
        detail: str,
        failures: Sequence[MetricCheck] = (),
        checks: Sequence[MetricCheck] = (),
    ) -> SweepJudgment:
        return SweepJudgment(
            node,
            result.kind,
            label,
            outcome,
            make_reason(f"{label} {short}"),
            detail,
            tuple(failures),
            tuple(checks),
            result,
            result.reference,
            basis,
            basis_nodes,
            floor.model if floor is not None else None,
        )

    if result.errors:
        e = result.errors[0]
        return verdict(
            Outcome.FAIL,
            f"error in {e.where}: {e.message[:48]}",
            f"{len(result.errors)} error(s); first: {e.where}: {e.message}",
        )
    if result.devices_per_node == 0:
        return verdict(Outcome.FAIL, "no GPUs", "the sweep found no devices on the node")
    failed_stages = [st for st in result.stages if st.status == "fail"]
    if failed_stages:
        st = failed_stages[0]
        more = f" +{len(failed_stages) - 1} stages" if len(failed_stages) > 1 else ""
        if result.kind == "pair" and not (ref_status and ref_status.trusted):
            why = ref_status.why if ref_status else f"{result.reference} has no trust record"
            return verdict(
                Outcome.INCONCLUSIVE,
                f"inconclusive, reference {result.reference} untrusted",
                f"stage {st.name} failed: {st.reason}; not blamed on {node}: {why}",
            )
        return verdict(
            Outcome.FAIL,
            f"{st.name} fail: {st.reason[:60]}{more}",
            "; ".join(f"stage {x.name} failed: {x.reason}" for x in failed_stages),
            [
                MetricCheck(f"stage/{x.name}", x.name, None, None, 0, "stage", None, False)
                for x in failed_stages
            ],
        )

    metrics = extract_metrics(result)
    checks: list[MetricCheck] = []
    if result.kind == "node":
        # a GPU that vanished (fell off the bus, failed init) is named as a whole first
        present = {d.index for d in result.devices if d.node == node}
        for k in sorted(set(range(result.devices_per_node)) - present):
            checks.append(MetricCheck(f"device/gpu{k}", f"gpu{k}", None, None, 0, "missing", None, False))
    for key, lab in expected_keys(result).items():
        if key not in metrics:
            checks.append(MetricCheck(key, lab, None, None, 0, "missing", None, False))

    checks.extend(_node_peer_checks(result, metrics, policy))
    checks.extend(throttle_checks(result, policy))

    if ref is not None:
        if ref.devices_per_node is not None and ref.devices_per_node != result.devices_per_node:
            checks.append(
                MetricCheck(
                    "devices_per_node",
                    "gpus",
                    float(result.devices_per_node),
                    float(ref.devices_per_node),
                    ref.node_count,
                    basis,
                    None,
                    False,
                )
            )
        for key, m in metrics.items():
            mb = ref.metrics.get(key)
            if mb is None or mb.count < need or mb.median <= 0:
                continue
            dev = m.value / mb.median - 1.0
            checks.append(MetricCheck(key, m.label, m.value, mb.median, mb.count, basis, dev, dev >= -tol))
    elif floor is not None:
        for key, m in metrics.items():
            lo = floor_value(key, floor)
            if lo is None:
                continue
            dev = m.value / lo - 1.0
            checks.append(MetricCheck(key, m.label, m.value, lo, 0, "floor", dev, dev >= 0.0))

    failures = sorted((c for c in checks if not c.ok), key=_severity)
    if failures:
        worst = failures[0]
        short = _describe(worst) + (f" +{len(failures) - 1} more" if len(failures) > 1 else "")
        if worst.basis == "telemetry":
            # say how the throttled node compared with its reference as well
            compared = [c for c in checks if c.basis == basis and c.deviation is not None]
            if compared:
                short += ", " + _describe(min(compared, key=lambda c: c.deviation or 0.0))
        detail = "; ".join(_describe(c, long=True) for c in failures[:8])
        if (
            result.kind == "pair"
            and not (ref_status and ref_status.trusted)
            and any(c.basis in ("class", "peers", "floor") for c in failures)
        ):
            why = ref_status.why if ref_status else f"{result.reference} has no trust record"
            return verdict(
                Outcome.INCONCLUSIVE,
                f"inconclusive, reference {result.reference} untrusted",
                f"{detail}; not blamed on {node}: {why}",
                failures,
                checks,
            )
        return verdict(Outcome.FAIL, short, detail, failures, checks)
    broken = [st for st in result.stages if st.status == "error"]
    if broken:
        st = broken[0]
        return verdict(
            Outcome.INCONCLUSIVE,
            f"stage {st.name} error: {st.reason[:60]}",
            "; ".join(f"stage {x.name} could not run properly: {x.reason}" for x in broken)
            + "; the node is neither failed nor returned on this sweep",
            (),
            checks,
        )
    judged = {c.key for c in checks if c.basis == basis}
    if basis == "none" or (basis == "floor" and not judged):
        have_c = baseline.node_count if baseline is not None else 0
        have_p = peers.node_count if peers is not None else 0
        why = (
            f"class {have_c}/{policy.bootstrap_min_nodes}, peers {have_p}/{policy.peer_min_nodes},"
            f" no floor for {result.device_name[:40]}"
        )
        if suspected:
            return verdict(
                Outcome.INSUFFICIENT_BASELINE,
                f"no reference: {why}",
                f"class {result.hw_class!r}: {have_c} healthy node(s) in its baseline"
                f" ({policy.bootstrap_min_nodes} needed), {have_p} same-window peer(s)"
                f" ({policy.peer_min_nodes} needed), no policy floor covering"
                f" {result.device_name!r}; a suspected node is not returned without one",
                (),
                checks,
            )
        return verdict(
            Outcome.BOOTSTRAP,
            f"bootstrap sample ({have_c + 1}/{policy.bootstrap_min_nodes} nodes)",
            f"unsuspected node seeds the {result.hw_class!r} baseline",
            (),
            checks,
        )
    unjudged = [k for k in metrics if k not in judged]
    if unjudged and basis != "floor":
        # a floor covers what the admin gave figures for; a median must cover every metric
        outcome = Outcome.INSUFFICIENT_BASELINE if suspected else Outcome.BOOTSTRAP
        return verdict(
            outcome,
            f"{len(unjudged)} metrics without {BASIS_NAMES[basis]}",
            f"no {BASIS_NAMES[basis]} for {', '.join(sorted(unjudged)[:6])}",
            (),
            checks,
        )
    what = (
        f"at or above {describe_basis(basis, (), floor.model if floor else None)}"
        if basis == "floor"
        else f"within {tol:.0%} of the {describe_basis(basis, basis_nodes)} median"
    )
    extra = f"; {len(unjudged)} metrics without a floor figure" if unjudged else ""
    short = "pass" if basis == "class" else f"pass vs {basis}"
    return verdict(Outcome.PASS, short, f"{len(judged)} metrics {what}{extra}", (), checks)


def _severity(c: MetricCheck) -> tuple[int, float]:
    # missing metrics and GPU-count mismatches first, then the largest shortfall against a
    # reference, then throttling seen during the run
    if c.basis == "telemetry":
        return (2, 0.0)
    if c.deviation is None:
        return (0, 0.0)
    return (1, c.deviation)


def _describe(c: MetricCheck, long: bool = False) -> str:
    if c.basis == "missing":
        return f"{c.label} missing"
    if c.basis == "stage":
        return f"{c.label} failed"
    if c.basis == "telemetry":
        return c.label + (" of the run" if long else "")
    if c.key == "devices_per_node":
        return f"gpus {c.value:.0f} vs {c.basis} {c.reference:.0f}"
    text = f"{c.label} {_pct(c.deviation or 0.0)} vs {c.basis}"
    if long:
        if c.basis == "floor":
            text += f" ({c.value:.4g} vs floor {c.reference:.4g})"
        else:
            text += f" ({c.value:.4g} vs median {c.reference:.4g} of {c.count})"
    return text


def throttle_checks(result: SweepResult, policy: SweepPolicy) -> list[MetricCheck]:
    """A device throttled for a reason of `throttle_fail_reasons` in at least
    `throttle_fail_share` of its samples during the device phases fails (basis
    'telemetry'): a node that slows itself down under load is slow for training, whatever
    its peers measured. The share is kept in `value`."""
    out = []
    bad = set(policy.throttle_fail_reasons)
    for d in result.devices:
        share = (d.telemetry or {}).get("throttle_share") or {}
        hits = sorted(
            ((x, n) for n, x in share.items() if n in bad and x >= policy.throttle_fail_share), reverse=True
        )
        if hits:
            x, name = hits[0]
            out.append(
                MetricCheck(
                    f"throttle/gpu{d.index}",
                    f"gpu{d.index} throttled ({name} {x:.0%})",
                    x,
                    policy.throttle_fail_share,
                    0,
                    "telemetry",
                    None,
                    False,
                )
            )
    return out


def _node_peer_checks(
    result: SweepResult, metrics: dict[str, Metric], policy: SweepPolicy
) -> list[MetricCheck]:
    """Each GPU against the median of its node's GPUs, per metric family (1-node only)."""
    if result.kind != "node" or result.devices_per_node < policy.peer_min_devices:
        return []
    families: dict[str, list[Metric]] = defaultdict(list)
    for key, m in metrics.items():
        family, _, rest = key.partition("/")
        if rest.startswith("gpu") and "-" not in rest:  # per-GPU metrics only
            families[family].append(m)
    out = []
    for ms in families.values():
        if len(ms) < policy.peer_min_devices:
            continue
        med = statistics.median(m.value for m in ms)
        if med <= 0:
            continue
        for m in ms:
            dev = m.value / med - 1.0
            if dev < -policy.pass_tolerance:
                out.append(MetricCheck(m.key, m.label, m.value, med, len(ms), "node", dev, False))
    return out


# ---------------------------------------------------------------- multi-node sweeps
@dataclass(frozen=True)
class LinkCheck:
    src_node: str
    dst_node: str
    gpu: int
    size_mb: int
    gbps: float
    reference: float
    deviation: float
    ok: bool


@dataclass(frozen=True)
class LinkDiagnosis:
    checks: tuple[LinkCheck, ...]
    suspect_nodes: tuple[str, ...]
    """Nodes with at least two slow links and at least half of their links slow."""
    slow_links: tuple[tuple[str, str], ...] = field(default=())
    """Slow (src, dst) node pairs whose ends are otherwise fine: a cable or switch port."""


def localize_links(
    transfers: Sequence[Transfer], policy: SweepPolicy, baseline: ClassBaseline | None = None
) -> LinkDiagnosis:
    """Name the node or link behind slow transfers of a ring/tree pass sweep.

    Each transfer is compared with the class baseline of 2-node sends of the same GPU and
    message size when there is one, else with this sweep's own reference for that size (all
    transfers move identical bytes, Greyhound 4.3): the median over nodes of each node's
    median transfer. A plain median of the transfers would not do on small sweeps: in a
    3-node sweep one slow node touches 3 of the 5 transfers and drags the median down with
    it. A degraded node slows every link it touches while its neighbours keep their other
    links fast, so a node is suspect when at least two of its links, and at least half of
    them, are slow.
    """
    per_node: dict[tuple[int, str], list[float]] = defaultdict(list)
    for t in transfers:
        for n in {t.src_node, t.dst_node}:
            per_node[(t.size_mb, n)].append(t.gbps)
    by_size: dict[int, list[float]] = defaultdict(list)
    for (size, _), vals in per_node.items():
        by_size[size].append(statistics.median(vals))
    checks = []
    for t in transfers:
        ref = None
        if baseline is not None:
            b = baseline.metrics.get(f"send/gpu{t.src_gpu}/{t.size_mb}MB")
            if b is not None and b.count >= policy.bootstrap_min_nodes:
                ref = b.median
        if ref is None:
            ref = statistics.median(by_size[t.size_mb])
        dev = t.gbps / ref - 1.0 if ref > 0 else 0.0
        checks.append(
            LinkCheck(
                t.src_node, t.dst_node, t.src_gpu, t.size_mb, t.gbps, ref, dev, dev >= -policy.pass_tolerance
            )
        )
    links: dict[str, set[frozenset[str]]] = defaultdict(set)
    slow: dict[str, set[frozenset[str]]] = defaultdict(set)
    for c in checks:
        pair = frozenset((c.src_node, c.dst_node))
        for n in pair:
            links[n].add(pair)
            if not c.ok:
                slow[n].add(pair)
    suspects = sorted(n for n in links if len(slow[n]) >= 2 and 2 * len(slow[n]) >= len(links[n]))
    lone = sorted(
        {
            (c.src_node, c.dst_node)
            for c in checks
            if not c.ok and c.src_node not in suspects and c.dst_node not in suspects
        }
    )
    return LinkDiagnosis(tuple(checks), tuple(suspects), tuple(lone))


def judge_multi(
    result: SweepResult, policy: SweepPolicy, baseline: ClassBaseline | None = None
) -> list[SweepJudgment]:
    """One verdict per node of a multi-node pass sweep (suspects fail, the rest pass)."""
    if result.errors:
        e = result.errors[0]
        return [
            SweepJudgment(
                n,
                result.kind,
                result.label,
                Outcome.FAIL,
                make_reason(f"{result.label} error in {e.where}: {e.message[:48]}"),
                f"{e.where}: {e.message}",
                result=result,
            )
            for n in result.nodes
        ]
    diag = localize_links(result.transfers, policy, baseline)
    out = []
    for n in result.nodes:
        mine = [c for c in diag.checks if n in (c.src_node, c.dst_node)]
        if n in diag.suspect_nodes:
            bad = sorted((c for c in mine if not c.ok), key=lambda c: c.deviation)
            worst = bad[0]
            peer = worst.dst_node if worst.src_node == n else worst.src_node
            out.append(
                SweepJudgment(
                    n,
                    result.kind,
                    result.label,
                    Outcome.FAIL,
                    make_reason(
                        f"{result.label} gpu{worst.gpu} link {n}-{peer}"
                        f" {_pct(worst.deviation)} vs class, {len(bad)} slow links"
                    ),
                    "; ".join(
                        f"{c.src_node}->{c.dst_node} gpu{c.gpu} {c.size_mb}MB {_pct(c.deviation)}"
                        for c in bad[:8]
                    ),
                    result=result,
                )
            )
        else:
            out.append(
                SweepJudgment(
                    n,
                    result.kind,
                    result.label,
                    Outcome.PASS,
                    make_reason(f"{result.label} pass"),
                    f"{len(mine)} link measurements",
                    result=result,
                )
            )
    return out
