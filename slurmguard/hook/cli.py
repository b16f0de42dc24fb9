"""`slurmguard ring ...`: inspect and control per-rank rings (debugging)."""

from __future__ import annotations

import json
import os

import click

from slurmguard.errors import InputError
from slurmguard.hook import ring as ringfmt


def _open(path: str) -> ringfmt.RingReader:
    try:
        return ringfmt.RingReader(path)
    except ringfmt.RingError as exc:
        raise InputError(f"ring {exc.path}: {exc.problem}") from None


@click.group()
def ring() -> None:
    """Inspect per-rank collective rings (format: spank_plugin/sg_ring.h)."""


@ring.command("dump")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--header-only", is_flag=True, help="Print only the header line.")
def dump(path: str, header_only: bool) -> None:
    """Print PATH's header, then one JSON object per record (oldest first).

    The first line is {"header": {...}}; every other line is one record with
    the field names of sg_ring.h and op/datatype/redop/flags by name. A
    closing {"summary": ...} line counts records lost to overwrite and
    records skipped as corrupt.
    """
    with _open(path) as r:
        click.echo(json.dumps({"header": r.refresh_header().to_json()}))
        if header_only:
            return
        batch = r.read()
        for rec in batch.records:
            click.echo(json.dumps(rec.to_json()))
        click.echo(
            json.dumps(
                {
                    "summary": {
                        "records": len(batch.records),
                        "overwritten": r.header.overwritten,
                        "lost": batch.lost,
                        "corrupt": batch.corrupt,
                        "abandoned": batch.abandoned,
                    }
                }
            )
        )


@ring.command("ls")
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.pass_context
def ls(ctx: click.Context, directory: str | None) -> None:
    """List the rings below DIRECTORY (default: the policy's agent.ring_root).

    One line per ring: job, step, rank/world, node, source, records written,
    records lost, path. Damaged files are listed with their problem.
    """
    if directory is None:
        from slurmguard.config import load_policy

        directory = load_policy((ctx.obj or {}).get("policy_path")).agent.ring_root
    if not os.path.isdir(directory):
        raise InputError(f"{directory}: not a directory")
    for item in ringfmt.scan(directory):
        if isinstance(item, ringfmt.RingProblem):
            click.echo(f"BAD  {item.path}: {item.problem}")
            continue
        h = item
        click.echo(
            f"job {h.job_id} step {h.step} rank {h.global_rank}/{h.world_size} "
            f"node {h.node_name} {h.source_name} written {h.write_counter} "
            f"lost {h.overwritten} {h.path}"
        )


@ring.command("hold")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option(
    "--timeout-ms",
    type=click.IntRange(0, 3_600_000),
    default=0,
    show_default=True,
    help="The rank resumes by itself after this long (0: the hook's default, 60000).",
)
def hold(path: str, timeout_ms: int) -> None:
    """Hold PATH's rank at its next collective (Greyhound 4.3 validation)."""
    c = _control(path)
    c.hold(timeout_ms)
    click.echo(json.dumps(c.state()))


@ring.command("release")
@click.argument("path", type=click.Path(dir_okay=False))
def release(path: str) -> None:
    """Release a held rank."""
    c = _control(path)
    c.release()
    click.echo(json.dumps(c.state()))


def _control(path: str) -> ringfmt.RingControl:
    try:
        return ringfmt.RingControl(path)
    except ringfmt.RingError as exc:
        raise InputError(f"ring {exc.path}: {exc.problem}") from None
    except OSError as exc:
        raise InputError(f"ring {path}: {exc.strerror}") from None
