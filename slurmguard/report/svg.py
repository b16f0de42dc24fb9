"""Small inline-SVG charts for the HTML report: no JavaScript, no external assets.

Times on x axes are Unix seconds (UTC). Every text that comes from data is escaped.
Each chart is an <svg> with a caller-given id/class so tests and browsers can find it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
STATE_COLORS = {
    "healthy": "#2e7d32",
    "suspect": "#f9a825",
    "draining": "#ef6c00",
    "quarantined": "#00838f",
    "remediation": "#8e24aa",
    "terminal": "#c62828",
}


@dataclass(frozen=True)
class Line:
    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str = PALETTE[0]
    width: float = 2.0
    dash: str | None = None


@dataclass(frozen=True)
class Band:
    label: str
    xs: Sequence[float]
    lo: Sequence[float]
    hi: Sequence[float]
    color: str = "#9e9e9e"


@dataclass(frozen=True)
class Event:
    """A vertical line at time x: an action or a detection."""

    x: float
    label: str
    color: str = "#555"
    dash: str | None = "4 3"


@dataclass(frozen=True)
class Marker:
    """A point marker (change point, deviating window)."""

    x: float
    y: float
    label: str
    color: str = "#d62728"
    shape: str = "triangle"


@dataclass(frozen=True)
class Cell:
    name: str
    value: float | None
    state: str | None = None
    title: str = ""
    href: str | None = None


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    """Relative deviation from the baseline (fraction, -0.2 = 20% below)."""
    failing: bool = False


@dataclass
class _Frame:
    x0: float
    x1: float
    y0: float
    y1: float
    left: float = 58
    right: float = 12
    top: float = 22
    bottom: float = 34
    width: float = 640
    height: float = 220
    parts: list[str] = field(default_factory=list)

    def px(self, x: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return self.left + (x - self.x0) / span * (self.width - self.left - self.right)

    def py(self, y: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return self.height - self.bottom - (y - self.y0) / span * (self.height - self.top - self.bottom)


def _num(v: float) -> str:
    return f"{v:.1f}"


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        out.append(round(v, 10))
        v += step
    return out


def _fmt_y(v: float) -> str:
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3f}".rstrip("0").rstrip(".") if v else "0"


def _fmt_t(t: float, span: float) -> str:
    d = datetime.fromtimestamp(t, UTC)
    return d.strftime("%m-%d %H:%M") if span > 86400 else d.strftime("%H:%M")


def _axes(f: _Frame, y_label: str) -> None:
    p = f.parts
    p.append(
        f'<rect x="{_num(f.left)}" y="{_num(f.top)}" width="{_num(f.width - f.left - f.right)}" '
        f'height="{_num(f.height - f.top - f.bottom)}" fill="#fff" stroke="#ccc"/>'
    )
    for v in _nice_ticks(f.y0, f.y1):
        y = f.py(v)
        p.append(
            f'<line x1="{_num(f.left)}" x2="{_num(f.width - f.right)}" y1="{_num(y)}" '
            f'y2="{_num(y)}" stroke="#eee"/>'
        )
        p.append(
            f'<text x="{_num(f.left - 4)}" y="{_num(y + 4)}" text-anchor="end" '
            f'class="tick">{escape(_fmt_y(v))}</text>'
        )
    span = f.x1 - f.x0
    for i in range(5):
        x = f.x0 + span * i / 4
        p.append(
            f'<text x="{_num(f.px(x))}" y="{_num(f.height - f.bottom + 14)}" '
            f'text-anchor="middle" class="tick">{escape(_fmt_t(x, span))}</text>'
        )
    p.append(
        f'<text x="12" y="{_num((f.top + f.height - f.bottom) / 2)}" class="axis" '
        f'transform="rotate(-90 12 {_num((f.top + f.height - f.bottom) / 2)})" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )


def _path(f: _Frame, xs: Sequence[float], ys: Sequence[float | None]) -> str:
    segs, pen = [], False
    for x, y in zip(xs, ys):
        if y is None or not math.isfinite(y):
            pen = False
            continue
        segs.append(f"{'L' if pen else 'M'}{_num(f.px(x))},{_num(f.py(y))}")
        pen = True
    return " ".join(segs)


def line_chart(
    *,
    ident: str,
    css_class: str,
    title: str,
    y_label: str,
    lines: Sequence[Line],
    band: Band | None = None,
    events: Sequence[Event] = (),
    markers: Sequence[Marker] = (),
    width: int = 640,
    height: int = 220,
) -> str:
    """Time series with an optional peer band, vertical event lines and point markers."""
    xs = [x for ln in lines for x in ln.xs] + [e.x for e in events]
    if band:
        xs += list(band.xs)
    ys = [y for ln in lines for y in ln.ys if y is not None and math.isfinite(y)]
    if band:
        ys += [v for v in (*band.lo, *band.hi) if math.isfinite(v)]
    if not xs or not ys:
        return (
            f'<svg id="{escape(ident)}" class="{escape(css_class)} empty" width="{width}" '
            f'height="40" role="img"><text x="8" y="24" class="note">{escape(title)}: '
            "no data</text></svg>"
        )
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 1.0
    f = _Frame(min(xs), max(xs), lo - pad, hi + pad, width=width, height=height)
    _axes(f, y_label)
    p = f.parts
    if band and band.xs:
        top = [f"{_num(f.px(x))},{_num(f.py(v))}" for x, v in zip(band.xs, band.hi)]
        bot = [f"{_num(f.px(x))},{_num(f.py(v))}" for x, v in zip(reversed(band.xs), reversed(band.lo))]
        p.append(
            f'<polygon class="band" points="{" ".join(top + bot)}" fill="{band.color}" '
            f'fill-opacity="0.25" stroke="none"><title>{escape(band.label)}</title></polygon>'
        )
    labelled: list[float] = []
    for e in events:
        x = f.px(e.x)
        dash = f' stroke-dasharray="{e.dash}"' if e.dash else ""
        p.append(
            f'<line class="event" x1="{_num(x)}" x2="{_num(x)}" y1="{_num(f.top)}" '
            f'y2="{_num(f.height - f.bottom)}" stroke="{e.color}"{dash}>'
            f"<title>{escape(e.label)}</title></line>"
        )
        # A short visible tag per event; events closer than 10 px share the first tag.
        if all(abs(x - o) >= 10 for o in labelled):
            labelled.append(x)
            tag = e.label.split(":")[0][:14]
            p.append(
                f'<text class="event-label" x="{_num(x - 3)}" y="{_num(f.top + 4)}" '
                f'transform="rotate(-90 {_num(x - 3)} {_num(f.top + 4)})" '
                f'text-anchor="end" fill="{e.color}">{escape(tag)}</text>'
            )
    for ln in lines:
        d = _path(f, ln.xs, ln.ys)
        if d:
            dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
            p.append(
                f'<path d="{d}" fill="none" stroke="{ln.color}" stroke-width="{ln.width}"'
                f"{dash}><title>{escape(ln.label)}</title></path>"
            )
    for m in markers:
        x, y = f.px(m.x), f.py(m.y)
        if m.shape == "triangle":
            shape = (
                f'<polygon class="marker change-point" points="{_num(x)},{_num(y - 7)} '
                f'{_num(x - 6)},{_num(y + 4)} {_num(x + 6)},{_num(y + 4)}" fill="{m.color}">'
            )
        else:
            shape = f'<circle class="marker" cx="{_num(x)}" cy="{_num(y)}" r="3" fill="{m.color}">'
        p.append(f"{shape}<title>{escape(m.label)}</title></{shape.split()[0][1:]}>")
    # legend
    items = [(ln.label, ln.color, "line") for ln in lines]
    if band:
        items.append((band.label, band.color, "band"))
    lx = f.left
    for label, color, kind in items:
        sw = (
            f'<rect x="{_num(lx)}" y="6" width="14" height="8" fill="{color}" fill-opacity="0.35"/>'
            if kind == "band"
            else f'<line x1="{_num(lx)}" x2="{_num(lx + 14)}" y1="10" y2="10" stroke="{color}" '
            'stroke-width="2"/>'
        )
        p.append(sw + f'<text x="{_num(lx + 18)}" y="14" class="legend">{escape(label)}</text>')
        lx += 26 + 6.2 * len(label)
    return (
        f'<svg id="{escape(ident)}" class="{escape(css_class)}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>{''.join(p)}</svg>"
    )


def slowdown_color(v: float | None, vmax: float) -> str:
    """White (no slowdown) to dark red (>= vmax); grey for no data; blue-ish if faster."""
    if v is None or not math.isfinite(v):
        return "#e0e0e0"
    t = max(0.0, min(1.0, v / vmax)) if vmax > 0 else 0.0
    # white -> yellow -> orange -> dark red
    stops = ((0.0, (255, 255, 255)), (0.35, (255, 224, 130)), (0.7, (244, 124, 32)), (1.0, (150, 20, 20)))
    for (a, ca), (b, cb) in itertools.pairwise(stops):
        if t <= b:
            u = (t - a) / (b - a)
            r, g, bl = (round(ca[i] + (cb[i] - ca[i]) * u) for i in range(3))
            return f"#{r:02x}{g:02x}{bl:02x}"
    return "#961414"


#: swatches in a heatmap's colour scale
LEGEND_STEPS = 24


def _colour_scale(x: float, y: float, vmax: float, width: int) -> str:
    """The slowdown colour scale from 0 to vmax as LEGEND_STEPS swatches `width` wide."""
    return "".join(
        f'<rect x="{x + i * width}" y="{y}" width="{width}" height="10" '
        f'fill="{slowdown_color(vmax * i / (LEGEND_STEPS - 1), vmax)}"/>'
        for i in range(LEGEND_STEPS)
    )


def heatmap_grid(
    *,
    ident: str,
    cells: Sequence[Cell],
    vmax: float,
    thresholds: Sequence[tuple[float, str]] = (),
    cols: int | None = None,
    cell: int = 0,
) -> str:
    """A grid of nodes coloured by slowdown (SMon-style), outlined by lifecycle state."""
    n = len(cells)
    if n == 0:
        return (
            f'<svg id="{escape(ident)}" class="heatmap empty" width="300" height="30">'
            '<text x="4" y="20" class="note">no nodes</text></svg>'
        )
    cols = cols or max(8, min(80, math.ceil(math.sqrt(n * 3))))
    if cell <= 0:  # auto: big cells for a small fleet, small ones for thousands
        cell = 28 if n <= 100 else (18 if n <= 1000 else 10)
    rows = math.ceil(n / cols)
    gap = 2
    w = cols * (cell + gap) + 10
    legend_h = 40
    h = rows * (cell + gap) + legend_h + 10
    p: list[str] = []
    for i, c in enumerate(cells):
        x = 5 + (i % cols) * (cell + gap)
        y = 5 + (i // cols) * (cell + gap)
        stroke = STATE_COLORS.get(c.state or "", "#bdbdbd")
        sw = 2.5 if c.state and c.state != "healthy" else 0.5
        rect = (
            f'<rect class="hm-cell" data-node="{escape(c.name)}" '
            f'data-state="{escape(c.state or "")}" x="{x}" y="{y}" width="{cell}" '
            f'height="{cell}" fill="{slowdown_color(c.value, vmax)}" stroke="{stroke}" '
            f'stroke-width="{sw}"><title>{escape(c.title or c.name)}</title></rect>'
        )
        p.append(f'<a href="{escape(c.href)}">{rect}</a>' if c.href else rect)
    # colour scale legend
    ly = rows * (cell + gap) + 16
    steps = LEGEND_STEPS
    p.append(_colour_scale(5, ly, vmax, 10))
    p.append(f'<text x="5" y="{ly + 24}" class="tick">0%</text>')
    p.append(
        f'<text x="{5 + steps * 10}" y="{ly + 24}" class="tick" text-anchor="end">&#8805;{vmax:.0%}</text>'
    )
    for v, label in thresholds:
        tx = 5 + min(v / vmax, 1.0) * steps * 10 if vmax else 5
        p.append(
            f'<line x1="{_num(tx)}" x2="{_num(tx)}" y1="{ly - 2}" y2="{ly + 12}" stroke="#000"/>'
            f'<text x="{_num(tx)}" y="{ly - 4}" class="tick" text-anchor="middle">'
            f"{escape(label)}</text>"
        )
    lx = 5 + steps * 10 + 30
    for state, color in STATE_COLORS.items():
        p.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="#fff" stroke="{color}" '
            f'stroke-width="2.5"/><text x="{lx + 14}" y="{ly + 9}" class="legend">'
            f"{state}</text>"
        )
        lx += 20 + 7 * len(state)
    w = max(w, lx + 10)
    return (
        f'<svg id="{escape(ident)}" class="heatmap" viewBox="0 0 {w} {h}" width="{w}" '
        f'height="{h}" role="img" aria-label="fleet slowdown heatmap">{"".join(p)}</svg>'
    )


def deviation_bars(
    *, ident: str, css_class: str, title: str, bars: Sequence[Bar], tolerance: float, width: int = 640
) -> str:
    """One horizontal bar per metric: deviation from the class baseline, tolerance shaded."""
    if not bars:
        return (
            f'<svg id="{escape(ident)}" class="{escape(css_class)} empty" width="{width}" '
            f'height="40"><text x="8" y="24" class="note">{escape(title)}: no metrics'
            "</text></svg>"
        )
    row = 16
    label_w = 170
    top = 24
    h = top + row * len(bars) + 26
    lim = max(0.1, tolerance * 2, *(abs(b.value) * 1.1 for b in bars))
    plot_w = width - label_w - 20

    def px(v: float) -> float:
        return label_w + (v + lim) / (2 * lim) * plot_w

    p = [
        (
            f'<rect x="{_num(px(-tolerance))}" y="{top - 4}" width="{_num(px(tolerance) - px(-tolerance))}" '
            f'height="{row * len(bars) + 4}" fill="#c8e6c9" fill-opacity="0.6">'
            f"<title>pass band: within {tolerance:.0%} of the class median</title></rect>"
        ),
        (
            f'<line x1="{_num(px(0))}" x2="{_num(px(0))}" y1="{top - 6}" '
            f'y2="{top + row * len(bars)}" stroke="#333"/>'
        ),
        (f'<text x="{_num(px(0))}" y="{top - 10}" class="tick" text-anchor="middle">class median</text>'),
    ]
    for i, b in enumerate(bars):
        y = top + i * row
        x0, x1 = sorted((px(0), px(b.value)))
        color = "#c62828" if b.failing else "#1976d2"
        p.append(
            f'<text x="{label_w - 6}" y="{y + 11}" class="tick" text-anchor="end">'
            f"{escape(b.label)}</text>"
            f'<rect class="bar{" failing" if b.failing else ""}" x="{_num(x0)}" y="{y + 2}" '
            f'width="{_num(max(x1 - x0, 1))}" height="{row - 5}" fill="{color}">'
            f"<title>{escape(b.label)}: {b.value:+.1%} vs class median</title></rect>"
        )
    for v in (-lim, -tolerance, tolerance, lim):
        p.append(f'<text x="{_num(px(v))}" y="{h - 8}" class="tick" text-anchor="middle">{v:+.0%}</text>')
    return (
        f'<svg id="{escape(ident)}" class="{escape(css_class)}" viewBox="0 0 {width} {h}" '
        f'width="{width}" height="{h}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>{''.join(p)}</svg>"
    )


def matrix_heatmap(
    values: Sequence[Sequence[float]],
    *,
    x_label: str,
    y_label: str,
    value_label: str,
    title: str = "",
    floor: float = 1.0,
) -> str:
    """A standalone SVG of a (rows, cols) matrix, row 0 at the bottom, coloured
    by how far each value is above `floor` (the what-if worker heatmap: rows =
    pipeline stages, columns = DP ranks, values = slowdown S_w >= 1). Cells
    carry their value as a tooltip, and as text when the matrix has at most 64
    cells; axis ticks are drawn up to 32 rows or columns."""
    rows = len(values)
    cols = len(values[0]) if rows else 0
    flat = [float(v) for row in values for v in row]
    vmax = max([v - floor for v in flat if math.isfinite(v)] + [1e-3])
    cell = 36 if rows * cols <= 64 else (18 if max(rows, cols) <= 64 else 8)
    left, top, bottom = 60, 30 if title else 10, 70
    w = left + cols * cell + 20
    h = top + rows * cell + bottom
    p: list[str] = []
    if title:
        p.append(f'<text x="{left}" y="18" font-size="12">{escape(title)}</text>')
    for r in range(rows):
        y = top + (rows - 1 - r) * cell
        for c in range(cols):
            v = float(values[r][c])
            x = left + c * cell
            p.append(
                f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" '
                f'fill="{slowdown_color(v - floor, vmax)}" stroke="#fff" stroke-width="0.5">'
                f"<title>{escape(y_label)} {r}, {escape(x_label)} {c}: {v:.3f}</title></rect>"
            )
            if rows * cols <= 64:
                dark = v - floor > 0.6 * vmax
                p.append(
                    f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 3:.1f}" font-size="9" '
                    f'text-anchor="middle" fill="{"#fff" if dark else "#000"}">{v:.2f}</text>'
                )
    ticks = 11 if cell >= 18 else 8
    if cols <= 32:
        for c in range(cols):
            p.append(
                f'<text x="{left + c * cell + cell / 2:.1f}" y="{top + rows * cell + 12}" '
                f'font-size="{ticks}" text-anchor="middle">{c}</text>'
            )
    if rows <= 32:
        for r in range(rows):
            p.append(
                f'<text x="{left - 4}" y="{top + (rows - 1 - r) * cell + cell / 2 + 3:.1f}" '
                f'font-size="{ticks}" text-anchor="end">{r}</text>'
            )
    p.append(
        f'<text x="{left + cols * cell / 2:.1f}" y="{top + rows * cell + 28}" font-size="11" '
        f'text-anchor="middle">{escape(x_label)}</text>'
        f'<text x="14" y="{top + rows * cell / 2:.1f}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + rows * cell / 2:.1f})">{escape(y_label)}</text>'
    )
    ly = top + rows * cell + 40
    p.append(_colour_scale(left, ly, vmax, 8))
    p.append(
        f'<text x="{left}" y="{ly + 22}" font-size="9">{floor:g}</text>'
        f'<text x="{left + LEGEND_STEPS * 8}" y="{ly + 22}" font-size="9" text-anchor="end">{floor + vmax:.2f}</text>'
        f'<text x="{left + LEGEND_STEPS * 8 + 8}" y="{ly + 9}" font-size="9">{escape(value_label)}</text>'
    )
    w = max(w, left + LEGEND_STEPS * 8 + 8 + 8 * len(value_label) + 10)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
        f'font-family="sans-serif" role="img" aria-label="{escape(title or value_label)}">'
        f'<rect width="{w}" height="{h}" fill="#fff"/>{"".join(p)}</svg>\n'
    )
