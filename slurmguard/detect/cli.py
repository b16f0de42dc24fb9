"""`slurmguard detect ...`: run the detectors on recorded data."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import click

from slurmguard.config import load_policy
from slurmguard.errors import InputError


def _policy(ctx: click.Context):
    obj = ctx.find_root().obj or {}
    return load_policy(obj.get("policy_path"))


def read_step_times(path: str) -> list[float]:
    """One column of step times in seconds, one row per iteration. A first row
    that is not a number is a header. Errors name the file and line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    out: list[float] = []
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if len([c for c in row if c.strip()]) != 1:
            raise InputError(f"{path}:{lineno}: expected one column (step time in seconds), got {len(row)}")
        cell = next(c for c in row if c.strip()).strip()
        try:
            v = float(cell)
        except ValueError:
            if lineno == 1 and not out:
                continue  # header
            raise InputError(f"{path}:{lineno}: '{cell}' is not a number") from None
        if not math.isfinite(v) or v <= 0:
            raise InputError(f"{path}:{lineno}: step time must be a positive number of seconds, got {cell}")
        out.append(v)
    if not out:
        raise InputError(f"{path}: no step times")
    return out


@click.group()
def detect() -> None:
    """Run the detectors on recorded data."""


@detect.command("steptimes")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--plain", is_flag=True, help="Plain BOCD: report candidates without verification.")
@click.option("--rule", type=click.Choice(["map_drop", "short_mass"]), default=None,
              help="Candidate rule (default: detection.bocd.rule).")
@click.pass_context
def steptimes(ctx: click.Context, file: str, plain: bool, rule: str | None) -> None:
    """Verified change points of a step-time CSV (one column, seconds), as JSON.

    Each change: index (first iteration at the new level, 0-based), direction
    (slower/faster), mean_before, mean_after (seconds over the verification
    windows), the medians the verification used, and detected_at.
    """
    from slurmguard.detect.bocd import detect_changepoints, episodes

    pol = _policy(ctx).detection.bocd
    x = read_step_times(file)
    cps = detect_changepoints(x, pol, verify=not plain, rule=rule)
    eps = episodes(cps, pol.verify_min_change)
    click.echo(json.dumps({
        "file": file, "iterations": len(x),
        "change_points": [c.to_dict() for c in cps],
        "episodes": [{"onset": e.onset, "slowdown": round(e.slowdown, 4), "recovery": e.recovery}
                     for e in eps],
    }, indent=2))
