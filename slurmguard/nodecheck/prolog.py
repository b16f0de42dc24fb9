"""The Slurm Prolog: fast local node checks, reported by exit code only.

    python -m slurmguard.nodecheck.prolog [--policy FILE] [--node NAME] [--verbose]

slurmd runs it as root before the job's first step on the node (or at
allocation with PrologFlags=Alloc). It runs the checks named in
`prolog.checks` concurrently within `prolog.timeout_s`, prints one line per
problem to stderr (slurmd 22.05 logs it: "error: prolog failed: rc:1
output:..."), and exits 1 when a check fails: Slurm then drains the node with
reason "Prolog error" and requeues the batch job (held). It never calls
scontrol and never uses the network.

Exit codes: 0 healthy; 1 a check failed; 2 an internal error (bug, bad
policy file, unknown expected GPU count) with `prolog.fail_on_internal_error`
true. With it false (the default) internal errors are logged and the prolog
passes: a typo in policies.yaml must not drain every node of the cluster.

Policy file: --policy, $SLURMGUARD_POLICY (set by the prolog_epilog wrapper
from /etc/default/slurmguard), /etc/slurmguard/policies.yaml, else the
built-in defaults. Unlike the CLI, ./policies.yaml is never read: slurmd runs
the prolog in the job's working directory, which the job's user controls.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TextIO

from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy, PrologPolicy
from slurmguard.errors import ConfigError
from slurmguard.nodecheck.checks import Check, CheckResult, run_checks
from slurmguard.nodecheck.common import SYSTEM_POLICY, guarded_exit, load, node_name
from slurmguard.nodecheck.gpu import GpuCountCheck, GpuHealthCheck, NvmlLoader
from slurmguard.nodecheck.nic import NicLinkCheck
from slurmguard.nodecheck.slurmconf import expected_gpus
from slurmguard.telemetry.nvml import load_pynvml

PROG = "slurmguard-prolog"
DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"


class _Skipped:
    """Stands in for a check that cannot be built: reports why as an internal error."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self.why = why

    def run(self, progress: object) -> list[str]:
        raise ConfigError(self.why)


def build_checks(
    p: PrologPolicy, node: str, env: Mapping[str, str], loader: NvmlLoader = load_pynvml
) -> list[Check]:
    """The enabled checks, configured from the prolog policy."""
    # NvmlSource's per-call limit sits below the check's, so a hung GPU is named
    call_timeout = max(0.1, min(p.check_timeout_s, p.timeout_s) / 2)
    checks: list[Check] = []
    gpu_wanted = [c for c in p.checks if c in ("gpu_count", "gpu_health")]
    expected: int | None = p.expected_gpus
    if gpu_wanted and p.nvml and expected is None:
        conf = env.get("SLURM_CONF") or DEFAULT_SLURM_CONF
        try:
            expected = expected_gpus(conf, node)
        except ConfigError as exc:
            checks.extend(_Skipped(name, f"expected GPU count unknown: {exc}") for name in gpu_wanted)
    for name in p.checks:
        if name in gpu_wanted and (not p.nvml or expected is None):
            continue  # nvml off: nothing to ask; unknown count: reported by _Skipped above
        # (both GPU checks are in gpu_wanted: expected is known past the line above)
        if name == "gpu_count" and expected is not None:
            checks.append(GpuCountCheck(expected, loader))
        elif name == "gpu_health" and expected is not None:
            checks.append(
                GpuHealthCheck(
                    node,
                    expected=expected,
                    max_ecc_dbe=p.max_ecc_dbe,
                    call_timeout_s=call_timeout,
                    loader=loader,
                )
            )
        elif name == "nic_link":
            checks.append(
                NicLinkCheck(
                    node,
                    p.ib_sysfs_root,
                    ports=p.ib_ports,
                    min_ports=p.min_ib_ports,
                    min_rate_gbps=p.min_ib_rate_gbps,
                    call_timeout_s=call_timeout,
                )
            )
    return checks


def report(
    results: list[CheckResult], node: str, p: PrologPolicy, err: TextIO, out: TextIO | None = None
) -> int:
    """Print failures (stderr) and, with `out`, every result; return the exit code."""
    failed = internal = False
    for r in results:
        if out is not None:
            status = "ok" if r.ok else ("FAIL" if r.failures else "ERROR")
            out.write(f"{PROG}: {node}: {r.name}: {status} ({r.duration_s * 1000:.0f} ms)\n")
        for line in r.failures:
            failed = True
            err.write(f"{PROG}: {node}: {r.name}: {line}\n")
        if r.internal_error is not None:
            internal = True
            what = "failing" if p.fail_on_internal_error else "ignored"
            err.write(
                f"{PROG}: {node}: {r.name}: internal error ({what}, "
                f"prolog.fail_on_internal_error={str(p.fail_on_internal_error).lower()}): "
                f"{r.internal_error}\n"
            )
    if failed:
        return 1
    if internal and p.fail_on_internal_error:
        return 2
    return 0


def run_prolog(
    policy: Policy,
    node: str,
    env: Mapping[str, str],
    *,
    err: TextIO,
    out: TextIO | None = None,
    loader: NvmlLoader = load_pynvml,
    clock: Clock | None = None,
) -> int:
    p = policy.prolog
    checks = build_checks(p, node, env, loader)
    results = run_checks(
        checks, budget_s=p.timeout_s, check_timeout_s=p.check_timeout_s, clock=clock or SystemClock()
    )
    return report(results, node, p, err, out)


def main(
    argv: list[str] | None = None, env: Mapping[str, str] | None = None, loader: NvmlLoader = load_pynvml
) -> int:
    env = os.environ if env is None else env
    ap = argparse.ArgumentParser(prog=PROG, description="slurmguard node checks (Slurm Prolog).")
    ap.add_argument("--policy", help=f"policy file (default: $SLURMGUARD_POLICY, {SYSTEM_POLICY}, built-in)")
    ap.add_argument("--node", help="node name (default: $SLURMD_NODENAME, the host name)")
    ap.add_argument(
        "--verbose", "-v", action="store_true", help="also print every check's result and duration to stdout"
    )
    args = ap.parse_args(argv)
    node = node_name(args.node, env)
    try:
        policy = load(args.policy, env)
    except ConfigError as exc:
        # fail_on_internal_error cannot be read from a broken file: its default (pass) holds
        sys.stderr.write(f"{PROG}: {node}: internal error (ignored, checks skipped): {exc}\n")
        return 0
    return run_prolog(
        policy, node, env, err=sys.stderr, out=sys.stdout if args.verbose else None, loader=loader
    )


def entry() -> None:
    guarded_exit(PROG, main)


if __name__ == "__main__":
    entry()
