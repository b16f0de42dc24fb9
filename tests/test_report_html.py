"""The HTML report: self-contained, opened in headless Chromium, screenshot taken and checked."""

from __future__ import annotations

import re
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from slurmguard.config import Policy
from slurmguard.report.html import report_html
from slurmguard.runner import SubprocessRunner
from slurmguard.triage.report import build_report
from slurmguard.triage.report_data import FleetSnapshot
from slurmguard.triage.report_model import ReportFilters

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "headless Chromium is needed for the HTML report test: apt-get install -y chromium", pytrace=False
        )
    return path


def _browser(tmp_path: Path, *args: str) -> str:
    argv = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", *args]
    return SubprocessRunner().run(argv, timeout=120).stdout


def _render(store, slurm, filters: ReportFilters | None = None, **kw) -> str:
    filters = filters or ReportFilters()
    snap = FleetSnapshot.load(store)
    rep = build_report(store, slurm, Policy(), filters, snapshot=snap)
    return report_html(store, rep, snap, Policy(), **kw)


def test_html_is_self_contained(report_fleet):
    store, slurm, _, _ = report_fleet
    page = _render(store, slurm)
    assert page.startswith("<!DOCTYPE html>")
    # nothing to fetch: no scripts, no external stylesheets, images, fonts or links
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert not re.search(r'(src|href)="(?!#)', page)
    assert "http://" not in page and "https://" not in page


def test_html_in_headless_chromium(report_fleet, tmp_path):
    from PIL import Image

    store, slurm, _, fleet = report_fleet
    html = tmp_path / "report.html"
    html.write_text(_render(store, slurm), encoding="utf-8")
    shot = tmp_path / "report.png"
    _browser(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", html.as_uri())
    dom = _browser(tmp_path, "--dump-dom", html.as_uri())

    # key elements, after Chromium parsed and laid out the page
    for ident in (
        "summary",
        "figures",
        "heatmap",
        "fleet-heatmap",
        "nodes",
        "node-table",
        "slurm-status",
        "generated",
        "drained-by-slurmguard",
        "drained-by-others",
    ):
        assert f'id="{ident}"' in dom, ident
    for state in ("healthy", "suspect", "draining", "quarantined", "remediation", "terminal"):
        assert re.search(rf'class="card state-count" data-state="{state}"><div class="n">2?\d', dom)
    for key in (
        "detection_delay",
        "quarantine_time",
        "sweep_pass_rate",
        "returned_replaced",
        "false_positive",
    ):
        assert f'data-key="{key}"' in dom
    assert len(re.findall(r'<rect class="hm-cell"', dom)) == 20
    rows = re.findall(r'<tr class="node-row" data-node="([^"]+)"', dom)
    assert len(rows) == 13 and fleet.unregistered in rows
    rem = fleet.first("remediation")
    section = dom[dom.index(f'id="node-{rem}"') :]
    section = section[: section.index("</section>")]
    assert "chart chart-steptime" in section and "change-point" in section
    assert 'class="event"' in section  # the drain/checkpoint moments on the step-time chart
    assert section.count("chart chart-telemetry") == 5 and 'class="band"' in section
    assert "chart chart-sweep" in section and 'class="bar failing"' in section
    assert "next rung: reboot" in section

    # the screenshot is a real rendering, not a blank page
    assert shot.stat().st_size > 30_000
    with Image.open(shot) as im:
        assert im.size == (1400, 2000)
        colours = im.convert("RGB").getcolors(maxcolors=1_000_000)
        assert colours is not None and len(colours) > 200
        # the header bar is dark, the page background light
        assert sum(im.convert("RGB").getpixel((700, 15))) < 200
        assert sum(im.convert("RGB").getpixel((5, 1500))) > 700


def test_html_of_empty_database(sqlite_store, tmp_path):
    page = _render(sqlite_store, None)
    assert 'id="no-rows"' in page and 'class="heatmap empty"' in page
    html = tmp_path / "empty.html"
    html.write_text(page, encoding="utf-8")
    dom = _browser(tmp_path, "--dump-dom", html.as_uri())
    assert 'id="summary"' in dom and "No nodes match" in dom


def test_html_detail_cap_and_window(report_fleet):
    store, slurm, _, _ = report_fleet
    page = _render(store, slurm, max_detail=2)
    assert page.count('class="node-detail"') == 2 and 'id="detail-cap"' in page
    # a window that ends before any series: sections stay, charts say there is no data
    page = _render(store, slurm, ReportFilters(window=timedelta(seconds=1)))
    assert "chart-steptime" not in page and "chart chart-sweep" in page
