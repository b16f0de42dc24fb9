"""The SMon worker heatmap (paper 004 section 8, Fig. 14).

One cell per worker: x = DP rank, y = PP rank, colour depth = the worker's
slowdown S_w. The patterns read at a glance: a single dark cell (a problematic
worker), a dark row at the top (the last stage), or everything tinted
(sequence-length imbalance and other widespread causes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slurmguard.errors import InputError


def write_heatmap(worker_slowdown: np.ndarray, path: str | Path, title: str = "") -> Path:
    """Write a PNG of a (pp, dp) slowdown matrix; returns the path.

    Colours run from 1.0 (no slowdown, white) to the largest S_w.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(path)
    pp, dp = worker_slowdown.shape
    vmax = max(float(worker_slowdown.max()), 1.0 + 1e-3)
    fig_w = min(16.0, 3.0 + 0.35 * dp)
    fig_h = min(10.0, 2.0 + 0.45 * pp)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=100)
    im = ax.imshow(
        worker_slowdown,
        origin="lower",
        cmap="Reds",
        vmin=1.0,
        vmax=vmax,
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_xlabel("DP rank")
    ax.set_ylabel("PP rank (stage)")
    if dp <= 32:
        ax.set_xticks(range(dp))
    if pp <= 32:
        ax.set_yticks(range(pp))
    if dp * pp <= 64:
        for s in range(pp):
            for d in range(dp):
                v = worker_slowdown[s, d]
                ax.text(
                    d,
                    s,
                    f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if v > 1.0 + 0.6 * (vmax - 1.0) else "black",
                )
    fig.colorbar(im, ax=ax, label="worker slowdown S_w")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(p, format="png")
    except OSError as exc:
        raise InputError(f"{p}: cannot write heatmap: {exc}") from None
    finally:
        plt.close(fig)
    return p
