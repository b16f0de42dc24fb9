"""The SMon worker heatmap (paper 004 section 8, Fig. 14).

One cell per worker: x = DP rank, y = PP rank, colour depth = the worker's
slowdown S_w. The patterns read at a glance: a single dark cell (a problematic
worker), a dark row at the top (the last stage), or everything tinted
(sequence-length imbalance and other widespread causes).

Drawn as SVG by the same chart module as the HTML triage report
(slurmguard.report.svg): one charting stack for the project, with no plotting
library to install (the report must render on a controller host with the node
install only, and a grid of coloured cells needs nothing more).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slurmguard.errors import InputError
from slurmguard.report.svg import matrix_heatmap


def write_heatmap(worker_slowdown: np.ndarray, path: str | Path, title: str = "") -> Path:
    """Write an SVG of a (pp, dp) slowdown matrix; returns the path.

    Colours run from 1.0 (no slowdown, white) to the largest S_w.
    """
    p = Path(path)
    svg = matrix_heatmap(
        np.asarray(worker_slowdown, dtype=float).tolist(),
        x_label="DP rank",
        y_label="PP rank (stage)",
        value_label="worker slowdown S_w",
        title=title,
    )
    try:
        p.write_text(svg)
    except OSError as exc:
        raise InputError(f"{p}: cannot write heatmap: {exc}") from None
    return p
