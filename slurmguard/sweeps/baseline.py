"""Metrics of a sweep result and the class baselines learned from healthy nodes.

Pass criteria are relative (Guard 5): each metric of a node is compared with the median
of the same metric on healthy nodes of the same hardware class, measured under the same
settings, never with a hard-coded absolute figure. Which past results count as healthy
(passed sweeps, bootstrap sweeps of unsuspected nodes) is the caller's decision; this
module only does the arithmetic, purely.

Metric keys (all "higher is better"; units as in slurmguard.sweeps.result):

* 1-node: ``gemm_<dtype>/gpu<i>`` (TFLOP/s), ``membw/gpu<i>`` (GB/s),
  ``p2p/gpu<i>-gpu<j>`` (GB/s, directed), ``allreduce_intra/<size>MB`` (busbw GB/s);
* 2-node, from the node under test's side: ``send/gpu<g>/<size>MB`` (node -> reference),
  ``recv/gpu<g>/<size>MB`` (reference -> node), ``allreduce_cross/<size>MB`` (busbw GB/s).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slurmguard.sweeps.result import SweepResult

DTYPE_SHORT = {"float32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    """Short name for reasons, e.g. 'gpu5 gemm_bf16'."""
    value: float


@dataclass(frozen=True)
class MetricBaseline:
    key: str
    median: float
    count: int
    """Distinct healthy nodes that contributed a value."""


@dataclass(frozen=True)
class ClassBaseline:
    hw_class: str
    kind: str
    fingerprint: str
    nodes: tuple[str, ...]
    """Healthy nodes whose latest comparable result is in the baseline."""
    devices_per_node: int | None
    metrics: Mapping[str, MetricBaseline]
    basis: str = "class"
    """'class' (healthy nodes within the baseline's age) or 'peers' (healthy nodes of the
    class swept in the same window as the judged result)."""

    @property
    def node_count(self) -> int:
        return len(self.nodes)


def settings_fingerprint(result: SweepResult) -> str:
    """Results are comparable only under the same kind, device type and kernel settings.

    Message sizes and dtypes are part of the metric keys, so they are not in here; the
    GEMM duration is, because a short run reads higher than a thermally steady one.
    """
    s = result.settings
    return f"{result.kind}|{result.device}|gemm{s.gemm_size}|dur{s.gemm_duration_s:g}|mem{s.membw_bytes}"


def extract_metrics(result: SweepResult) -> dict[str, Metric]:
    """The judged metrics of a 1-node or 2-node result, keyed as in the module docstring.

    A key measured more than once (a repeated pass) keeps the median of its values.
    Multi-node results are judged link by link instead (see verdict.localize_links).
    """
    values: dict[str, list[float]] = defaultdict(list)
    labels: dict[str, str] = {}

    def add(key: str, label: str, value: float) -> None:
        values[key].append(value)
        labels[key] = label

    node = result.node_under_test
    if result.kind == "node":
        for d in result.devices:
            if d.node != node:
                continue
            for g in d.gemm:
                add(
                    f"gemm_{g.dtype}/gpu{d.index}",
                    f"gpu{d.index} gemm_{DTYPE_SHORT.get(g.dtype, g.dtype)}",
                    g.tflops,
                )
            if d.membw_gbps is not None:
                add(f"membw/gpu{d.index}", f"gpu{d.index} membw", d.membw_gbps)
        for c in result.p2p:
            if c.node == node:
                add(f"p2p/gpu{c.src}-gpu{c.dst}", f"gpu{c.src}-gpu{c.dst} p2p", c.gbps)
        for a in result.allreduce:
            if a.scope == "intra":
                add(f"allreduce_intra/{a.size_mb}MB", f"allreduce {a.size_mb}MB", a.busbw_gbps)
    elif result.kind == "pair":
        for t in result.transfers:
            if t.src_node == node:
                add(f"send/gpu{t.src_gpu}/{t.size_mb}MB", f"gpu{t.src_gpu} send {t.size_mb}MB", t.gbps)
            elif t.dst_node == node:
                add(f"recv/gpu{t.dst_gpu}/{t.size_mb}MB", f"gpu{t.dst_gpu} recv {t.size_mb}MB", t.gbps)
        for a in result.allreduce:
            if a.scope == "cross":
                add(f"allreduce_cross/{a.size_mb}MB", f"allreduce {a.size_mb}MB", a.busbw_gbps)
    return {k: Metric(k, labels[k], statistics.median(v)) for k, v in values.items()}


def expected_keys(result: SweepResult) -> dict[str, str]:
    """Every key a complete result of this kind and settings must have -> its label.

    A GPU that fell off the bus, a dtype that crashed or a direction that was never
    measured shows up as a missing key, which fails the sweep.
    """
    s, n = result.settings, result.devices_per_node
    out: dict[str, str] = {}
    if result.kind == "node":
        for i in range(n):
            for dt in s.gemm_dtypes:
                out[f"gemm_{dt}/gpu{i}"] = f"gpu{i} gemm_{DTYPE_SHORT.get(dt, dt)}"
            out[f"membw/gpu{i}"] = f"gpu{i} membw"
            for j in range(n):
                if i != j:
                    out[f"p2p/gpu{i}-gpu{j}"] = f"gpu{i}-gpu{j} p2p"
        if n >= 2:
            for m in s.message_sizes_mb:
                out[f"allreduce_intra/{m}MB"] = f"allreduce {m}MB"
    elif result.kind == "pair":
        for g in range(n):
            for m in s.message_sizes_mb:
                out[f"send/gpu{g}/{m}MB"] = f"gpu{g} send {m}MB"
                out[f"recv/gpu{g}/{m}MB"] = f"gpu{g} recv {m}MB"
        for m in s.message_sizes_mb:
            out[f"allreduce_cross/{m}MB"] = f"allreduce {m}MB"
    return out


def compute_baseline(
    healthy: Iterable[SweepResult],
    *,
    hw_class: str,
    kind: str,
    fingerprint: str,
    exclude_nodes: Iterable[str] = (),
    finished_from: float | None = None,
    finished_to: float | None = None,
    basis: str = "class",
) -> ClassBaseline:
    """Class baseline from results of nodes believed healthy.

    Only results of this hardware class, kind and settings fingerprint count; results with
    errors never count; each node contributes its most recent result only (a node swept
    ten times must not outvote nine others); `exclude_nodes` (the node being judged) never
    vouches for itself; only results finished within [finished_from, finished_to] count
    (expiry, same window). Per metric: median over the contributing nodes and their count.
    """
    excluded = set(exclude_nodes)
    latest: dict[str, SweepResult] = {}
    for r in healthy:
        if (
            r.hw_class != hw_class
            or r.kind != kind
            or settings_fingerprint(r) != fingerprint
            or r.errors
            or r.node_under_test in excluded
        ):
            continue
        if (finished_from is not None and r.finished < finished_from) or (
            finished_to is not None and r.finished > finished_to
        ):
            continue
        prev = latest.get(r.node_under_test)
        if prev is None or r.finished > prev.finished:
            latest[r.node_under_test] = r
    per_key: dict[str, list[float]] = defaultdict(list)
    for r in latest.values():
        for k, m in extract_metrics(r).items():
            per_key[k].append(m.value)
    dpn = [r.devices_per_node for r in latest.values()]
    return ClassBaseline(
        hw_class=hw_class,
        kind=kind,
        fingerprint=fingerprint,
        nodes=tuple(sorted(latest)),
        devices_per_node=int(statistics.median_low(dpn)) if dpn else None,
        metrics={k: MetricBaseline(k, statistics.median(v), len(v)) for k, v in per_key.items()},
        basis=basis,
    )


def baseline_for(
    result: SweepResult,
    healthy: Iterable[SweepResult],
    *,
    max_age_s: float | None = None,
    now: float | None = None,
) -> ClassBaseline:
    """The class baseline that judges `result`: same class, kind, settings; its node
    excluded; results finished more than `max_age_s` before `now` have expired."""
    since = None if max_age_s is None or now is None else now - max_age_s
    return compute_baseline(
        healthy,
        hw_class=result.hw_class,
        kind=result.kind,
        fingerprint=settings_fingerprint(result),
        exclude_nodes=(result.node_under_test,),
        finished_from=since,
    )


def peers_for(result: SweepResult, healthy: Iterable[SweepResult], window_s: float) -> ClassBaseline:
    """Same-window peers of `result`: healthy nodes of its class and settings whose result
    finished within `window_s` seconds of it (before or after), its own node excluded."""
    return compute_baseline(
        healthy,
        hw_class=result.hw_class,
        kind=result.kind,
        fingerprint=settings_fingerprint(result),
        exclude_nodes=(result.node_under_test,),
        finished_from=result.finished - window_s,
        finished_to=result.finished + window_s,
        basis="peers",
    )
