"""The report as one self-contained HTML file: inline CSS and SVG, no scripts, no fetches.

Stable hooks for tests and for people who script around the file:
`#summary` (`.state-count[data-state]`), `#figures` (`.figure[data-key]`), `#heatmap`
(`svg#fleet-heatmap`, `rect.hm-cell[data-node]`), `#slurm-status`, `#nodes`
(`table#node-table`, `tr.node-row[data-node]`), one `section.node-detail#node-<name>` per
detailed node with `svg.chart-steptime`, `svg.chart-telemetry`, `svg.chart-sweep`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from html import escape

from slurmguard.config import Policy
from slurmguard.report import svg
from slurmguard.report.terminal import figure_items, fmt_time, slurm_line
from slurmguard.report.visuals import (
    ACTION_COLORS,
    ClassBaselines,
    fleet_slowdowns,
    step_charts,
    sweep_charts,
    telemetry_charts,
)
from slurmguard.store import Store
from slurmguard.triage.report_data import FleetSnapshot, SeriesSnapshot
from slurmguard.triage.report_model import NodeRow, Report

DEFAULT_MAX_DETAIL = 100

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;color:#212121;
background:#fafafa;font-size:14px}
header{background:#263238;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header .meta{color:#b0bec5;font-size:12px;margin-top:4px}
nav{padding:6px 24px;background:#eceff1;font-size:13px}nav a{margin-right:14px;color:#37474f}
main{padding:8px 24px 40px}h2{font-size:17px;margin:22px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:14px 0 6px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #ddd;
border-radius:6px;padding:8px 14px;min-width:110px}.card .n{font-size:24px;font-weight:600}
.card .l{font-size:12px;color:#616161}
.figure .n{font-size:18px}
table{border-collapse:collapse;background:#fff;width:100%}th,td{border:1px solid #e0e0e0;
padding:4px 6px;vertical-align:top;text-align:left;font-size:13px}th{background:#f5f5f5}
.state{font-weight:600;border-radius:3px;padding:1px 5px;color:#fff;white-space:nowrap}
.st-healthy{background:#2e7d32}.st-suspect{background:#f9a825}.st-draining{background:#ef6c00}
.st-quarantined{background:#00838f}.st-remediation{background:#8e24aa}
.st-terminal{background:#c62828}.st-none{background:#757575}
.warn{background:#fff8e1;border:1px solid #ffe082;padding:6px 10px;border-radius:4px}
.ok{color:#2e7d32}.bad{color:#c62828;font-weight:600}
ol.chain{margin:4px 0;padding-left:20px}ol.chain li{margin:1px 0}
.stage{display:inline-block;min-width:70px;font-size:11px;color:#fff;border-radius:3px;
padding:0 4px;margin-right:4px;text-align:center}
.stage-detection{background:#d62728}.stage-response{background:#ef6c00}
.stage-sweep{background:#00838f}.stage-triage{background:#8e24aa}.stage-lifecycle{background:#607d8b}
section.node-detail{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 14px;
margin:14px 0}.charts{display:flex;flex-wrap:wrap;gap:8px}
svg text{font-family:inherit}svg .tick{font-size:10px;fill:#555}svg .axis{font-size:11px;fill:#333}
svg .legend{font-size:11px;fill:#333}svg .event-label{font-size:9px}svg .note{font-size:12px;fill:#777}
.next{font-weight:600}.muted{color:#757575}
"""


def _state_badge(state: str | None) -> str:
    cls = state or "none"
    return f'<span class="state st-{escape(cls)}">{escape(state or "not in db")}</span>'


def _anchor(name: str) -> str:
    return "node-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _summary(report: Report) -> str:
    s = report.summary
    cards = [
        (
            f'<div class="card"><div class="n" id="total-nodes">{s.total}</div>'
            '<div class="l">nodes in the database</div></div>'
        )
    ]
    for state, n in s.states.items():
        cards.append(
            f'<div class="card state-count" data-state="{state}"><div class="n">{n}</div>'
            f'<div class="l">{_state_badge(state)}</div></div>'
        )
    for key, label, v in (
        ("drained-by-slurmguard", "drained by slurmguard", s.drained_by_slurmguard),
        ("drained-by-others", "drained by others", s.drained_by_others),
    ):
        text = "?" if v is None else str(v)
        cards.append(
            f'<div class="card" id="{key}"><div class="n">{text}</div><div class="l">{label}</div></div>'
        )
    return (
        '<section id="summary"><h2>Fleet summary</h2><div class="cards">'
        + "".join(cards)
        + "</div></section>"
    )


def _figures(report: Report) -> str:
    items = "".join(
        f'<div class="card figure" data-key="{key}"><div class="n">{escape(value)}</div>'
        f'<div class="l">{escape(label)}</div></div>'
        for key, label, value in figure_items(report.figures)
    )
    since = f" since {fmt_time(report.filters.since)}" if report.filters.since else ""
    return (
        f'<section id="figures"><h2>Fleet figures{escape(since)}</h2>'
        f'<div class="cards">{items}</div><p class="muted">Computed from the database. '
        "The false-positive estimate is the share of concluded drains whose node came back "
        "through a passing sweep with no failed sweep or remediation in between.</p></section>"
    )


def _heatmap(
    report: Report, snap: FleetSnapshot, slow: dict[str, float], policy: Policy, detailed: set[str]
) -> str:
    tiers = policy.response.tiers
    scope = [
        n
        for n in sorted(snap.nodes)
        if report.filters.partition is None or report.filters.partition in snap.nodes[n].partitions
    ]
    cells = []
    for n in scope:
        rec = snap.nodes[n]
        v = slow.get(n)
        val = "no guarded job in the window" if v is None else f"{v:+.1%} step time"
        cells.append(
            svg.Cell(
                n,
                v,
                rec.state.value,
                f"{n}: {val} ({rec.state.value})",
                href=f"#{_anchor(n)}" if n in detailed else None,
            )
        )
    vmax = max(tiers.severe_slowdown * 1.5, 0.05)
    grid = svg.heatmap_grid(
        ident="fleet-heatmap",
        cells=cells,
        vmax=vmax,
        thresholds=[(tiers.moderate_slowdown, "moderate"), (tiers.severe_slowdown, "severe")],
    )
    return (
        '<section id="heatmap"><h2>Fleet heatmap: per-node slowdown</h2>'
        '<p class="muted">One cell per node (name order), coloured by the step-time slowdown '
        "of its newest guarded-job window; the outline is its lifecycle state "
        "(in the style of SMon, paper 004 section 8). Grey: no guarded job in the window."
        f"</p>{grid}</section>"
    )


def _node_table(report: Report, detailed: set[str]) -> str:
    if not report.rows:
        return (
            '<section id="nodes"><h2>Nodes that are not healthy</h2>'
            '<p id="no-rows">No nodes match: every node in scope is healthy.</p></section>'
        )
    src = "Slurm" if report.slurm.reachable else "audit log"
    head = (
        "<tr><th>node</th><th>state</th><th>since</th>"
        f"<th>reason ({src})</th><th>evidence</th><th>next action</th></tr>"
    )
    body = []
    for r in report.rows:
        name = f'<a href="#{_anchor(r.name)}">{escape(r.name)}</a>' if r.name in detailed else escape(r.name)
        owner = '<br><span class="bad">drained by others</span>' if r.drained_by == "other" else ""
        reason = escape(r.reason or (f"comment: {r.comment}" if r.comment else "-"))
        if r.reservations:
            reason += f'<br><span class="muted">reservation {escape(", ".join(r.reservations))}</span>'
        last = r.evidence[-1].text if r.evidence else "-"
        body.append(
            f'<tr class="node-row" data-node="{escape(r.name)}" '
            f'data-state="{escape(r.state.value if r.state else "")}">'
            f"<td>{name}</td><td>{_state_badge(r.state.value if r.state else None)}{owner}</td>"
            f"<td>{fmt_time(r.since)}</td><td>{reason}</td>"
            f"<td>{len(r.evidence)} steps; last: {escape(last)}</td>"
            f'<td class="next" data-code="{escape(r.next_action.code)}">'
            f"{escape(r.next_action.text)}</td></tr>"
        )
    return (
        f'<section id="nodes"><h2>Nodes that are not healthy ({len(report.rows)})</h2>'
        f'<table id="node-table">{head}{"".join(body)}</table></section>'
    )


def _chain(r: NodeRow) -> str:
    items = []
    for e in r.evidence:
        cls = "" if e.ok is None else (' class="ok"' if e.ok else ' class="bad"')
        items.append(
            f'<li{cls}><span class="stage stage-{e.stage}">{e.stage}</span>'
            f"{fmt_time(e.at)} {escape(e.text)} "
            f'<span class="muted">[{escape(e.ref)}]</span></li>'
        )
    return f'<ol class="chain">{"".join(items)}</ol>' if items else "<p>no recorded evidence</p>"


def _detail(
    r: NodeRow, snap: FleetSnapshot, series: SeriesSnapshot, base: ClassBaselines, policy: Policy
) -> str:
    aid = _anchor(r.name)
    parts = [
        f'<section class="node-detail" id="{aid}" data-node="{escape(r.name)}">',
        (
            f"<h3>{escape(r.name)} {_state_badge(r.state.value if r.state else None)} "
            f'<span class="muted">since {fmt_time(r.since)}; class '
            f"{escape(r.hw_class or '-')}</span></h3>"
        ),
        f'<p class="next">Next: {escape(r.next_action.text)}</p>',
        _chain(r),
        '<div class="charts">',
    ]
    for i, c in enumerate(step_charts(r.name, snap, series)):
        events = [svg.Event(t, label, ACTION_COLORS.get(act, "#555")) for t, label, act in c.events]
        parts.append(
            svg.line_chart(
                ident=f"{aid}-steptime-{i}",
                css_class="chart chart-steptime",
                title=f"job {c.job_id}: step time of {r.name} vs the job's other nodes",
                y_label="step time (s)",
                lines=[
                    svg.Line(r.name, c.node.xs, c.node.ys, svg.PALETTE[1]),
                    svg.Line(
                        "other nodes (median)", c.peer_median.xs, c.peer_median.ys, "#424242", 1.2, "5 3"
                    ),
                ],
                band=svg.Band("other nodes (min-max)", c.peer_median.xs, c.band_lo, c.band_hi)
                if c.peer_median.xs
                else None,
                events=events,
                markers=[svg.Marker(t, y, label) for t, y, label in c.change_points],
            )
        )
    for tc in telemetry_charts(r.name, series):
        unit = f" ({tc.unit})" if tc.unit else ""
        band = svg.Band("peers (min-max)", tc.band_xs, tc.band_lo, tc.band_hi) if tc.band_xs else None
        parts.append(
            svg.line_chart(
                ident=f"{aid}-tele-{tc.signal}",
                css_class="chart chart-telemetry",
                title=f"{tc.signal}{unit} of {r.name} vs its peers",
                y_label=f"{tc.signal}{unit}",
                lines=[
                    svg.Line(r.name, tc.node.xs, tc.node.ys, svg.PALETTE[0]),
                    svg.Line("peer median", tc.peer_median.xs, tc.peer_median.ys, "#424242", 1.2, "5 3"),
                ],
                band=band,
                width=420,
                height=180,
                markers=[svg.Marker(t, v, "deviating window", shape="dot") for t, v in tc.deviating],
            )
        )
    for sc in sweep_charts(r.name, snap, base):
        tol = policy.sweeps.pass_tolerance
        bars = [svg.Bar(k, d, d < -tol) for k, d in sc.deviations[:16]]
        title = f"sweep {sc.sweep_id} ({sc.kind}, {sc.verdict}) vs class {sc.hw_class or '-'} " + (
            f"baseline of {sc.baseline_nodes} nodes"
            if sc.baseline_nodes
            else "(no passed sweep of this class yet: no baseline to compare with)"
        )
        parts.append(
            f'<div><div class="muted">{escape(title)}'
            + (f": {escape(sc.failure_reason)}" if sc.failure_reason else "")
            + "</div>"
            + svg.deviation_bars(
                ident=f"{aid}-sweep-{sc.sweep_id}",
                css_class="chart chart-sweep",
                title=title,
                bars=bars,
                tolerance=tol,
            )
            + "</div>"
        )
    parts.append("</div></section>")
    return "".join(parts)


def detail_rows(report: Report, max_detail: int = DEFAULT_MAX_DETAIL) -> list[NodeRow]:
    """The rows that get a detail section with charts: the first `max_detail` known nodes."""
    return [r for r in report.rows if r.state is not None][:max_detail]


def report_html(
    store: Store, report: Report, snap: FleetSnapshot, policy: Policy, *, max_detail: int = DEFAULT_MAX_DETAIL
) -> str:
    """Load the chart series (detailed nodes and their jobs only) and render the page."""
    names = [r.name for r in detail_rows(report, max_detail)]
    prefer = {n: {i.job_id for i in snap.incidents_by_node.get(n, ())} for n in names}
    series = SeriesSnapshot.load(
        store, report.generated_at - report.filters.window, names, prefer_jobs=prefer
    )
    return render_html(report, snap, series, policy, max_detail=max_detail)


def render_html(
    report: Report,
    snap: FleetSnapshot,
    series: SeriesSnapshot,
    policy: Policy,
    *,
    max_detail: int = DEFAULT_MAX_DETAIL,
) -> str:
    """The whole report page. Detailed sections (charts) for the first `max_detail` rows."""
    detailed_rows = detail_rows(report, max_detail)
    detailed = {r.name for r in detailed_rows}
    slow = fleet_slowdowns(series)
    base = ClassBaselines(snap.sweeps)
    f = report.filters
    flt = [
        f"{k}={v}"
        for k, v in (
            ("node", ",".join(f.nodes)),
            ("state", ",".join(s.value for s in f.states)),
            ("since", fmt_time(f.since) if f.since else ""),
            ("partition", f.partition or ""),
        )
        if v
    ]
    warn = "" if report.slurm.reachable else " warn"
    skipped = len([r for r in report.rows if r.state is not None]) - len(detailed_rows)
    more = (
        f'<p class="muted" id="detail-cap">{skipped} more nodes have no detail section '
        f"(limit {max_detail}; use --node or --max-detail).</p>"
        if skipped > 0
        else ""
    )
    body = [
        f'<header><h1>slurmguard triage report</h1><div class="meta" id="generated">generated '
        f"{escape(_iso(report.generated_at))}"
        + (f" &middot; filters: {escape(' '.join(flt))}" if flt else "")
        + f" &middot; chart window {escape(_span(f.window))}</div></header>",
        (
            '<nav><a href="#summary">summary</a><a href="#figures">figures</a>'
            '<a href="#heatmap">heatmap</a><a href="#nodes">nodes</a></nav><main>'
        ),
        (
            f'<p id="slurm-status" class="{warn.strip()}" data-reachable='
            f'"{str(report.slurm.reachable).lower()}">{escape(slurm_line(report))}</p>'
        ),
        _summary(report),
        _figures(report),
        _heatmap(report, snap, slow, policy, detailed),
        _node_table(report, detailed),
        '<section id="details"><h2>Per-node detail</h2>' + more,
        *(_detail(r, snap, series, base, policy) for r in detailed_rows),
        "</section></main>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>slurmguard triage report</title>"
        f"<style>{CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def _span(d: timedelta) -> str:
    s = d.total_seconds()
    return f"{s / 86400:g}d" if s % 86400 == 0 else f"{s / 3600:g}h"


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")
