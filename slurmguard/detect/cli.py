"""`slurmguard detect ...`: run the detectors on recorded data."""

from __future__ import annotations

import json

import click

from slurmguard.config import Policy, load_policy
from slurmguard.detect.stepfile import read_step_file


def _policy(ctx: click.Context) -> Policy:
    obj = ctx.find_root().obj or {}
    return load_policy(obj.get("policy_path"))


@click.group()
def detect() -> None:
    """Run the detectors on recorded data."""


@detect.command("steptimes")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--plain",
    is_flag=True,
    help="Plain BOCD baseline: every MAP run-length drop, no profile, no verification.",
)
@click.option(
    "--skip-invalid",
    is_flag=True,
    help="Treat rows that are not a positive number of seconds (NaN, 0, negative) as missing steps.",
)
@click.pass_context
def steptimes(ctx: click.Context, file: str, plain: bool, skip_invalid: bool) -> None:
    """Slowdown episodes and change points of a step-time CSV (one column, seconds), as JSON.

    The detector is the one the agent and the controller run (thresholds from
    the policy: detection.bocd, agent.warmup_steps/baseline_steps). Each
    episode: onset (first slow iteration, 0-based), detected_at (the iteration
    at which the detector knew), slowdown (deepest level vs. the baseline),
    level_s (the last verified level), recovery / recovered_at (null while
    still slow). Each change point: index, detected_at, direction, the levels
    before/after (seconds per step over one period of the step pattern) and the
    mean step times over the windows around it. profile: the step pattern
    found (period 1 = none), the baseline step and the noise (relative s.d.).
    """
    from slurmguard.detect.bocd import detect_changepoints
    from slurmguard.detect.steps import DetectorConfig, detect_steps

    pol = _policy(ctx)
    x, _, skipped = read_step_file(file, skip_invalid=skip_invalid)
    if plain:
        cps = detect_changepoints(x, pol.detection.bocd, verify=False)
        doc = {
            "file": file,
            "iterations": len(x),
            "detector": "plain BOCD (MAP drop, no verification)",
            "change_points": [c.to_dict() for c in cps],
        }
    else:
        det = detect_steps(x, DetectorConfig.from_policy(pol))
        doc = {"file": file, "iterations": len(x), **det.to_dict()}
        if det.note:
            click.echo(f"{file}: {det.note}", err=True)
    if skipped:
        doc["skipped_invalid_rows"] = skipped
    click.echo(json.dumps(doc, indent=2))
