"""Step-time files: one column of seconds per iteration, optionally labelled.

The format `slurmguard detect steptimes` reads and the suite's recorded series
use: UTF-8 text, one step time (seconds) per row; a first row that is not a
number is a header; blank rows are skipped; rows starting with '#' are
comments, and a comment of the form `# key: value` is a label:

    # kind: transient        healthy | hiccup | speedup | small_shift | shift | transient | compound
    # onset: 240             0-based index of the first slow step (the injection), repeatable
    # recovery: 420          0-based index of the first step back at the healthy level
    # severity: 0.3          slowdown as a fraction (estimated from the data when absent)
    # textures: periodic,checkpoints
    # source: slurmguard workloads ddp, 4 nodes, node2 CPU cap 50% at 14:02:11

`write_step_file` writes it: `slurmguard bench loop --save-series` and
scripts/record_steptimes.py record real series this way, labelled by the
injection, so the suite, the tests and `detect steptimes` read one format.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from slurmguard.errors import InputError, read_user_text

#: Longest believable step (seconds, ~11.6 days): above it a value is clock
#: garbage or a unit mistake, not a step time. The detector ignores such samples.
MAX_STEP_S = 1e6

LABEL_KEYS = ("kind", "onset", "recovery", "severity", "textures", "source", "excursion")


def read_step_file(
    path: str | Path, *, skip_invalid: bool = False
) -> tuple[list[float], dict[str, list[str]], int]:
    """(step times, labels, invalid rows skipped). Errors name the file and line.

    A value that is not a step time (NaN, inf, zero, negative, > MAX_STEP_S) is
    an error, or, with skip_invalid, a missing step (kept as NaN, counted).
    """
    text = read_user_text(path, "step file")
    out: list[float] = []
    labels: dict[str, list[str]] = {}
    skipped = 0
    header_ok = True
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if ":" in body:
                key, val = (s.strip() for s in body.split(":", 1))
                if key.lower() in LABEL_KEYS:
                    labels.setdefault(key.lower(), []).append(val)
            continue
        row = next(csv.reader([line]), [])
        cells = [c.strip() for c in row if c.strip()]
        if not cells:
            continue
        if len(cells) != 1:
            raise InputError(f"{path}:{lineno}: expected one column (step time in seconds), got {len(cells)}")
        cell = cells[0]
        try:
            v = float(cell)
        except ValueError:
            if header_ok and not out:
                header_ok = False
                continue  # header
            raise InputError(f"{path}:{lineno}: '{cell}' is not a number") from None
        header_ok = False
        if not math.isfinite(v) or v <= 0 or v > MAX_STEP_S:
            if skip_invalid:
                skipped += 1
                out.append(float("nan"))
                continue
            what = (
                "is implausible (more than 11 days)"
                if math.isfinite(v) and v > 0
                else "must be a positive number of seconds"
            )
            raise InputError(
                f"{path}:{lineno}: step time {what}, got {cell}"
                " (--skip-invalid treats such rows as missing steps)"
            )
        out.append(v)
    if not out:
        raise InputError(f"{path}: no step times")
    return out, labels, skipped


def write_step_file(path: str | Path, steps: list[float], labels: dict[str, object] | None = None) -> Path:
    """Write step times (s) with `# key: value` labels (keys of LABEL_KEYS; a
    list value is repeated, None is left out), 6 decimals (microseconds)."""
    p = Path(path)
    lines = []
    for key, val in (labels or {}).items():
        if key not in LABEL_KEYS:
            raise ValueError(f"unknown step-file label {key!r} (known: {', '.join(LABEL_KEYS)})")
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if v is not None:
                lines.append(f"# {key}: {v}")
    lines.append("step_s")
    lines += [f"{x:.6f}" for x in steps]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def first_step_after(step_ends: list[float], t: float) -> int:
    """Index of the first step that ended after time `t` (same clock as the
    ends, e.g. epoch s): the step during which a fault applied at `t` began to
    act, which is how recorded series are labelled (`# onset:`). len(step_ends)
    when none did."""
    return next((i for i, e in enumerate(step_ends) if e > t), len(step_ends))


def read_step_times(path: str) -> list[float]:
    """One column of step times in seconds (see read_step_file); errors name file and line."""
    return read_step_file(path)[0]
