"""The report in a terminal: summary, fleet figures, one row per node that is not healthy."""

from __future__ import annotations

from collections import OrderedDict
from datetime import datetime

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slurmguard.triage.report import human_duration
from slurmguard.triage.report_model import FleetFigures, NodeRow, Report

_STATE_STYLE = {
    "healthy": "green",
    "suspect": "yellow",
    "draining": "dark_orange",
    "quarantined": "cyan",
    "remediation": "magenta",
    "terminal": "bold red",
}
_STAGE_LABEL = OrderedDict(detection="detect", response="respond", sweep="sweep", triage="triage")


def fmt_time(t: datetime | None) -> str:
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M")


def pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def slurm_line(report: Report) -> str:
    v = report.slurm
    if v.reachable:
        return "reasons: live from Slurm"
    return (
        f"reasons: from the audit log (Slurm not reachable: {v.error})"
        if v.checked
        else f"reasons: from the audit log ({v.error})"
    )


def chain_text(row: NodeRow, per_stage: int = 1, width: int = 90) -> str:
    """The evidence chain condensed: the newest `per_stage` steps of each stage, in order."""
    parts = []
    for stage, label in _STAGE_LABEL.items():
        steps = [e for e in row.evidence if e.stage == stage]
        if not steps:
            continue
        shown = steps[-per_stage:]
        more = f" (+{len(steps) - len(shown)} earlier)" if len(steps) > len(shown) else ""
        parts.append(f"{label}: " + "; ".join(_clip(e.text, width) for e in shown) + more)
    return " -> ".join(parts) or "-"


def figure_items(f: FleetFigures) -> list[tuple[str, str, str]]:
    """(key, label, value) of each fleet figure, shared by the terminal and HTML output."""
    return [
        (
            "detection_delay",
            "median detection delay",
            f"{human_duration(f.detection_delay_median_s)} ({f.incidents} incidents)",
        ),
        (
            "quarantine_time",
            "median time in quarantine",
            (
                f"{human_duration(f.quarantine_median_s)} ({f.quarantine_stays} stays, "
                f"{f.quarantine_ongoing} ongoing)"
            ),
        ),
        (
            "sweep_pass_rate",
            "sweep pass rate",
            f"{pct(f.sweep_pass_rate)} ({f.sweeps_passed}/{f.sweeps_final})",
        ),
        ("returned_replaced", "nodes returned / replaced", f"{f.nodes_returned} / {f.nodes_replaced}"),
        (
            "false_positive",
            "drains cleared by a passing sweep (FP estimate)",
            (
                f"{pct(f.false_positive_estimate, 1)} ({f.drains_cleared}/{f.drains_concluded}); "
                "Guard Table 3: 12.4%"
            ),
        ),
    ]


def render_terminal(report: Report, console: Console | None = None) -> None:
    console = console or Console(width=max(140, Console().width))
    s = report.summary
    head = Table(title="Fleet", title_justify="left", show_header=True)
    for col in ("nodes", *s.states.keys(), "drained by slurmguard", "drained by others"):
        head.add_column(col, justify="right")
    head.add_row(
        str(s.total),
        *[Text(str(v), style=_STATE_STYLE.get(k, "")) if v else "0" for k, v in s.states.items()],
        "?" if s.drained_by_slurmguard is None else str(s.drained_by_slurmguard),
        "?"
        if s.drained_by_others is None
        else str(s.drained_by_others) + (f" ({s.unregistered} not in db)" if s.unregistered else ""),
    )
    console.print(head)
    figs = Table(
        title="Fleet figures" + (f" since {fmt_time(report.filters.since)}" if report.filters.since else ""),
        title_justify="left",
        show_header=False,
    )
    figs.add_column("figure")
    figs.add_column("value")
    for _, label, value in figure_items(report.figures):
        figs.add_row(label, value)
    console.print(figs)
    console.print(Text(slurm_line(report), style="dim" if report.slurm.reachable else "yellow"))
    if not report.rows:
        console.print(
            "No nodes match: every node in scope is healthy."
            if not _filtered(report)
            else "No nodes match the filters."
        )
        return
    t = Table(title=f"{len(report.rows)} node(s)", title_justify="left", show_lines=True)
    for col, kw in (
        ("NODE", {"no_wrap": True}),
        ("STATE", {}),
        ("SINCE", {"no_wrap": True}),
        ("REASON (Slurm)" if report.slurm.reachable else "REASON (audit log)", {}),
        ("EVIDENCE", {"ratio": 3}),
        ("NEXT", {"ratio": 2}),
    ):
        t.add_column(col, overflow="fold", **kw)
    for r in report.rows:
        state = r.state.value if r.state else "(not in db)"
        if r.drained_by == "other":
            state += "\ndrained by others"
        reason = r.reason or (f"comment: {r.comment}" if r.comment else "-")
        if r.reservations:
            reason += f"\nreservation {', '.join(r.reservations)}"
        t.add_row(
            r.name,
            Text(state, style=_STATE_STYLE.get(r.state.value if r.state else "", "")),
            fmt_time(r.since),
            reason,
            chain_text(r),
            r.next_action.text,
        )
    console.print(t)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _filtered(report: Report) -> bool:
    f = report.filters
    return bool(f.nodes or f.states or f.since or f.partition)
