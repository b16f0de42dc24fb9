"""The Slurm Epilog: archive the job's rings, remove the ring directory, prune.

    python -m slurmguard.nodecheck.epilog [--policy FILE] [--job-id N] [--node NAME]

slurmd runs it as root on every node of the job when the job ends, with
SLURM_JOB_ID, SLURMD_NODENAME, SLURM_NODELIST and SLURM_JOB_RESTART_COUNT in
its environment (checked on Slurm 22.05). It moves this node's rings from
<agent.ring_root>/<job_id>/ to <prolog.trace_store>/<job_id>/<node>/ with a
manifest.json (see slurmguard.nodecheck.archive), removes the ring directory
(where nodes share one ring root, once no other node of the job still needs
it), and prunes archives older than
prolog.trace_retention_days.

Exit codes (a non-zero epilog makes Slurm drain the node, "Epilog error"):
0 in every case but one: archive problems (trace store full or unwritable, a
bad file in the ring directory, a broken policy file) are logged to stderr and
the epilog passes, since none of them says the node is unfit for the next
job. The exception: this node's rings could not be removed from the ring root
(tmpfs pages are RAM, so the node would lose memory with every job) and
`prolog.epilog_fail_on_cleanup_error` is true: exit 1, the node is drained for
an admin to look at.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TextIO

from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy
from slurmguard.errors import ConfigError
from slurmguard.nodecheck.archive import ArchiveResult, archive_job, prune
from slurmguard.nodecheck.common import SYSTEM_POLICY, guarded_exit, load, node_name
from slurmguard.slurm.hostlist import expand

PROG = "slurmguard-epilog"


def _job_nodes(env: Mapping[str, str]) -> list[str] | None:
    expr = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not expr:
        return None
    try:
        return expand(expr)
    except ValueError:
        return None


def run_epilog(
    policy: Policy,
    job_id: int,
    node: str,
    env: Mapping[str, str],
    *,
    out: TextIO,
    err: TextIO,
    clock: Clock | None = None,
) -> tuple[int, ArchiveResult]:
    clock = clock or SystemClock()
    p = policy.prolog
    try:
        restart = int(env.get("SLURM_JOB_RESTART_COUNT", "0") or 0)
    except ValueError:
        restart = 0
    res = archive_job(
        job_id,
        node,
        ring_root=policy.agent.ring_root,
        policy=p,
        job_nodes=_job_nodes(env),
        restart_count=restart,
        clock=clock,
    )
    err.writelines(f"{PROG}: job {job_id} on {node}: {e}\n" for e in res.errors)
    if res.files or res.skipped or res.unread or res.ring_dir_removed:
        left = ", ".join(f"{n}: {c}" for n, c in sorted(res.left_for.items()))
        out.write(
            f"{PROG}: job {job_id} on {node}: archived {len(res.files)} ring(s), "
            f"{res.archived_bytes} bytes, to {res.archive_dir or '(nothing)'}; "
            f"skipped {len(res.skipped)}; "
            + (f"{res.unread} removed unread (over prolog.max_ring_entries); " if res.unread else "")
            + f"ring dir {'removed' if res.ring_dir_removed else 'kept'}"
            + (f" (rings left for {left})" if left else "")
            + "\n"
        )
    try:
        gone = prune(p.trace_store, p.trace_retention_days, clock=clock)
        if gone:
            out.write(
                f"{PROG}: pruned {len(gone)} job archive(s) older than {p.trace_retention_days:g} days\n"
            )
    except OSError as exc:
        err.write(f"{PROG}: prune {p.trace_store}: {exc}\n")
    code = 1 if res.cleanup_failed and p.epilog_fail_on_cleanup_error else 0
    return code, res


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    ap = argparse.ArgumentParser(prog=PROG, description="slurmguard job trace archive (Slurm Epilog).")
    ap.add_argument("--policy", help=f"policy file (default: $SLURMGUARD_POLICY, {SYSTEM_POLICY}, built-in)")
    ap.add_argument("--job-id", help="job id (default: $SLURM_JOB_ID)")
    ap.add_argument("--node", help="node name (default: $SLURMD_NODENAME, the host name)")
    args = ap.parse_args(argv)
    node = node_name(args.node, env)
    raw = args.job_id or env.get("SLURM_JOB_ID", "")
    if not raw.isdigit():
        sys.stderr.write(f"{PROG}: no job id (SLURM_JOB_ID={raw!r}); nothing to archive\n")
        return 0
    try:
        policy = load(args.policy, env)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: job {raw} on {node}: {exc}; rings left in place\n")
        return 0
    code, _ = run_epilog(policy, int(raw), node, env, out=sys.stdout, err=sys.stderr)
    return code


def entry() -> None:
    guarded_exit(PROG, main)


if __name__ == "__main__":
    entry()
