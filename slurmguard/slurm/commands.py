"""The default SlurmClient backend: Slurm's own commands, run with shell=False.

Reads use `sinfo --json`/`squeue --json` where the installed Slurm has them and
`scontrol show ... -o` otherwise; writes use `scontrol update/create/delete/
requeue/reboot`, `scancel` and `sbatch --parsable`. Every call has a timeout;
failures become typed errors carrying the command line and stderr.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from slurmguard.runner import CommandError, CommandNotFound, CommandRunner, SubprocessRunner
from slurmguard.slurm import parse, validate
from slurmguard.slurm.errors import (
    NotOurs,
    SlurmCommandError,
    SlurmError,
    SlurmUnavailable,
    UnknownJob,
    UnknownNode,
)
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo, is_ours

# Messages Slurm prints when slurmctld cannot be reached (22.05 - 25.x).
_UNREACHABLE = re.compile(
    r"Unable to contact slurm controller|Connection refused|Zero Bytes were transmitted|"
    r"Socket timed out|Communication connection failure|Could not establish a configuration source",
    re.IGNORECASE,
)
_UNKNOWN_NODE = re.compile(r"Invalid node name|Node name .* not found|Invalid hostlist", re.I)
_UNKNOWN_JOB = re.compile(r"Invalid job id|Job has already finished|Invalid job id specified", re.I)


#: seconds after the hold is lifted that a requeued job may start (see release_requeue_hold)
REQUEUE_RESTART_DELAY_S = 2


class CommandSlurmClient:
    """SlurmClient on top of the Slurm CLI.

    timeout_s: per command, seconds (default 15). bin_dir: directory of the
    Slurm commands (None = PATH). use_json: None = use JSON output where the
    Slurm version supports it (>= 21.08), True/False to force.
    """

    def __init__(
        self,
        runner: CommandRunner | None = None,
        *,
        timeout_s: float = 15.0,
        bin_dir: str | None = None,
        use_json: bool | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.runner = runner or SubprocessRunner()
        self.timeout_s = timeout_s
        self.bin_dir = bin_dir
        self._use_json = use_json
        self._version: tuple[int, int, int] | None = None
        self._env = env

    # ------------------------------------------------------------------ plumbing
    def _cmd(self, name: str) -> str:
        return os.path.join(self.bin_dir, name) if self.bin_dir else name

    def _run(
        self,
        argv: Sequence[str],
        *,
        node: str | None = None,
        job: int | None = None,
        input: str | None = None,
    ) -> str:
        argv = [self._cmd(argv[0]), *argv[1:]]
        try:
            res = self.runner.run(argv, timeout=self.timeout_s, env=self._env, input=input)
        except CommandNotFound as exc:
            raise SlurmUnavailable(f"{exc} (is slurm-client installed?)", argv) from None
        except CommandError as exc:
            err = exc.stderr or str(exc)
            if exc.timed_out:
                raise SlurmUnavailable(
                    f"{os.path.basename(argv[0])} timed out after {self.timeout_s:g}s "
                    f"(slurmctld not answering?): {' '.join(argv)}",
                    argv,
                    err,
                ) from None
            if _UNREACHABLE.search(err):
                raise SlurmUnavailable(
                    f"slurmctld unreachable: {' '.join(argv)}: {_last_line(err)}", argv, err
                ) from None
            if node is not None and _UNKNOWN_NODE.search(err):
                raise UnknownNode(f"unknown node '{node}': {_last_line(err)}", argv, err) from None
            if job is not None and _UNKNOWN_JOB.search(err):
                raise UnknownJob(f"unknown job {job}: {_last_line(err)}", argv, err) from None
            raise SlurmCommandError(f"{' '.join(argv)}: {_last_line(err)}", argv, err) from None
        return res.stdout

    def version(self) -> tuple[int, int, int]:
        if self._version is None:
            out = self._run(["sinfo", "--version"])
            self._version = parse.parse_version(out)
        return self._version

    def _json_ok(self) -> bool:
        if self._use_json is None:
            self._use_json = self.version() >= (21, 8, 0)
        return self._use_json

    def _load_json(self, argv: Sequence[str]) -> dict[str, Any] | None:
        """Run a --json query; None if this Slurm lacks the JSON plugin."""
        try:
            out = self._run(argv)
        except SlurmCommandError as exc:
            if re.search(r"json|serializ|data_parser|plugin", exc.stderr, re.I):
                self._use_json = False
                return None
            raise
        try:
            doc: dict[str, Any] = json.loads(out)
            return doc
        except json.JSONDecodeError:
            self._use_json = False
            return None

    # ------------------------------------------------------------------ reads
    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        wanted = [validate.node_name(n) for n in names] if names is not None else None
        nodes: list[NodeInfo] | None = None
        if self._json_ok():
            doc = self._load_json(["sinfo", "--json"])
            if doc is not None:
                nodes = parse.nodes_from_json(doc)
        if nodes is None:
            nodes = parse.nodes_from_scontrol(self._run(["scontrol", "show", "node", "-o"]))
        return fleet_view(nodes, self.jobs(), wanted)

    def fleet(self) -> tuple[list[NodeInfo], list[JobInfo]]:
        """Every node (with its running jobs) and every queued job: one node read, one job read."""
        jobs = self.jobs()
        if self._json_ok():
            doc = self._load_json(["sinfo", "--json"])
            if doc is not None:
                return fleet_view(parse.nodes_from_json(doc), jobs, None), jobs
        text = self._run(["scontrol", "show", "node", "-o"])
        return fleet_view(parse.nodes_from_scontrol(text), jobs, None), jobs

    def node(self, name: str) -> NodeInfo:
        return self.nodes([name])[0]

    def jobs(self, job_ids: Iterable[int] | None = None) -> list[JobInfo]:
        ids = {validate.job_id(j) for j in job_ids} if job_ids is not None else None
        jobs: list[JobInfo] | None = None
        if self._json_ok():
            doc = self._load_json(["squeue", "--json"])
            if doc is not None:
                jobs = parse.jobs_from_json(doc)
        if jobs is None:
            jobs = parse.jobs_from_scontrol(self._run(["scontrol", "show", "job", "-o"]))
        if ids is not None:
            jobs = [j for j in jobs if j.job_id in ids]
        return jobs

    def job(self, job_id: int) -> JobInfo:
        jid = validate.job_id(job_id)
        out = self._run(["scontrol", "show", "job", "-o", str(jid)], job=jid)
        found = parse.jobs_from_scontrol(out)
        if not found:
            raise UnknownJob(f"unknown job {jid}")
        return found[0]

    def reservations(self) -> list[ReservationInfo]:
        out = self._run(["scontrol", "show", "reservation", "-o"])
        return parse.reservations_from_scontrol(out)

    # ------------------------------------------------------------------ writes
    def _update_node(self, node: str, *assignments: str) -> None:
        self._run(["scontrol", "update", f"NodeName={node}", *assignments], node=node)

    def set_comment(self, node: str, text: str) -> str:
        validate.node_name(node)
        comment = validate.reason(text)
        current = self.node(node)
        if current.comment and not is_ours(current.comment):
            raise NotOurs(
                f"node {node} has a comment slurmguard did not write ({current.comment!r}); leaving it alone"
            )
        self._update_node(node, f"Comment={comment}")
        return comment

    def clear_comment(self, node: str) -> None:
        validate.node_name(node)
        current = self.node(node)
        if not current.comment:
            return
        if not is_ours(current.comment):
            raise NotOurs(
                f"node {node} has a comment slurmguard did not write ({current.comment!r}); not clearing it"
            )
        self._update_node(node, "Comment=")

    def drain(self, node: str, reason: str) -> str:
        validate.node_name(node)
        full = validate.reason(reason)
        current = self.node(node)
        if current.drained_by_others:
            raise NotOurs(
                f"node {node} is already {current.state_text} by someone else "
                f"(reason {current.reason!r}); slurmguard does not re-reason it"
            )
        self._update_node(node, "State=DRAIN", f"Reason={full}")
        return full

    def resume(self, node: str) -> None:
        validate.node_name(node)
        current = self.node(node)
        if not (current.drained or current.down):
            return
        if not is_ours(current.reason):
            raise NotOurs(
                f"node {node} was taken out by someone else "
                f"(reason {current.reason!r}); slurmguard will not resume it"
            )
        self._update_node(node, "State=RESUME")

    def create_reservation(
        self, name: str, nodes: Sequence[str], *, duration_min: int, users: Sequence[str] = ("root",)
    ) -> None:
        validate.reservation_name(name)
        if not nodes:
            raise SlurmError("a reservation needs at least one node")
        for n in nodes:
            validate.node_name(n)
        for u in users:
            if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$", u):
                raise SlurmError(f"invalid user name {u!r}")
        if duration_min <= 0:
            raise SlurmError("reservation duration must be positive (minutes)")
        self._run(
            [
                "scontrol",
                "create",
                "reservation",
                f"ReservationName={name}",
                f"Nodes={','.join(nodes)}",
                "StartTime=now",
                f"Duration={int(duration_min)}",
                f"Users={','.join(users)}",
                "Flags=MAINT,IGNORE_JOBS",
            ],
            node=nodes[0],
        )

    def delete_reservation(self, name: str) -> None:
        validate.reservation_name(name)
        self._run(["scontrol", "delete", f"ReservationName={name}"])

    def submit(
        self,
        script: str | Path,
        *,
        job_name: str | None = None,
        nodelist: Sequence[str] = (),
        reservation: str | None = None,
        time_limit_min: int | None = None,
        partition: str | None = None,
        output: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> int:
        argv = ["sbatch", "--parsable"]
        if job_name:
            if not re.match(r"^[A-Za-z0-9_.:-]{1,64}$", job_name):
                raise SlurmError(f"invalid job name {job_name!r}")
            argv.append(f"--job-name={job_name}")
        if nodelist:
            argv.append(f"--nodelist={','.join(validate.node_name(n) for n in nodelist)}")
        if reservation:
            argv.append(f"--reservation={validate.reservation_name(reservation)}")
        if time_limit_min is not None:
            if time_limit_min <= 0:
                raise SlurmError("time limit must be positive (minutes)")
            argv.append(f"--time={int(time_limit_min)}")
        if partition:
            argv.append(f"--partition={validate.node_name(partition)}")
        if output:
            argv.append(f"--output={output}")
        argv.extend(extra_args)
        stdin = None
        if isinstance(script, Path) or not str(script).startswith("#!"):
            path = Path(script)
            if not path.is_file():
                raise SlurmError(f"batch script not found: {path}")
            argv.append(str(path))
        else:
            stdin = str(script)
        if env:
            argv.insert(2, "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items()))
        out = self._run(argv, input=stdin).strip()
        m = re.match(r"^(\d+)", out)
        if m is None:
            raise SlurmCommandError(f"sbatch printed no job id: {out!r}", argv)
        return int(m.group(1))

    def requeue(self, job_id: int, *, restart_now: bool = True, settle_s: float = 10.0) -> None:
        """Requeue a job. restart_now lifts Slurm's post-requeue hold for up to
        settle_s seconds (the hold appears only after the old run finished
        completing); callers that must not block can call release_requeue_hold
        on later cycles instead."""
        jid = validate.job_id(job_id)
        self._run(["scontrol", "requeue", str(jid)], job=jid)
        if not restart_now:
            return
        deadline = time.monotonic() + min(settle_s, self.timeout_s)
        while time.monotonic() < deadline:
            if self.release_requeue_hold(jid) == "RUNNING":
                return
            time.sleep(0.3)

    def release_requeue_hold(self, job_id: int) -> str:
        """If a requeued job waits for a future begin time, make it eligible now.

        Slurm delays the restart of a requeued batch job; slurmguard requeues
        to restart on healthy nodes at once. Returns the job state seen.
        """
        jid = validate.job_id(job_id)
        j = self.job(jid)
        if (
            j.state == "PENDING"
            and j.restarts > 0
            and j.eligible_time is not None
            and j.eligible_time > time.time() + REQUEUE_RESTART_DELAY_S + 1
        ):
            # not "now": slurmd compares a launch credential's creation with the old
            # run's revocation in whole seconds, and a restart on one of its nodes
            # within that second is refused ("Job credential revoked") and the job
            # killed, not restarted (seen on the dev cluster, Slurm 22.05)
            self._run(
                ["scontrol", "update", f"JobId={jid}", f"StartTime=now+{REQUEUE_RESTART_DELAY_S}"], job=jid
            )
        return j.state

    def signal(self, job_id: int, signal: str, *, batch_only: bool = True) -> None:
        jid = validate.job_id(job_id)
        sig = validate.signal_name(signal)
        argv = ["scancel", f"--signal={sig}"]
        if batch_only:
            argv.append("--batch")
        self._run([*argv, str(jid)], job=jid)

    def cancel(self, job_id: int) -> None:
        jid = validate.job_id(job_id)
        self._run(["scancel", str(jid)], job=jid)

    def reboot(self, node: str, reason: str, *, next_state: str = "resume", asap: bool = True) -> str:
        validate.node_name(node)
        full = validate.reason(reason)
        if next_state not in ("resume", "drain", "down"):
            raise SlurmError(f"invalid next state {next_state!r}: resume, drain or down")
        current = self.node(node)
        if current.drained_by_others:
            raise NotOurs(
                f"node {node} was taken out by someone else "
                f"(reason {current.reason!r}); slurmguard will not reboot it"
            )
        argv = ["scontrol", "reboot"]
        if asap:
            argv.append("ASAP")
        argv += [f"nextstate={next_state.upper()}", f"reason={full}", node]
        self._run(argv, node=node)
        return full


def fleet_view(nodes: list[NodeInfo], jobs: list[JobInfo], wanted: list[str] | None) -> list[NodeInfo]:
    """Nodes (all, or the `wanted` ones: UnknownNode if any is missing) with the
    ids of the jobs running on each, in natural name order. Shared by the backends."""
    # sinfo --json lists a node once per partition on some versions
    unique: dict[str, NodeInfo] = {}
    for n in nodes:
        unique.setdefault(n.name, n)
    running: dict[str, list[int]] = {}
    for job in jobs:
        if job.state in ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING"):
            for node in job.nodes:
                running.setdefault(node, []).append(job.job_id)
    result = []
    for name, n in unique.items():
        if wanted is not None and name not in wanted:
            continue
        result.append(_with_jobs(n, tuple(sorted(running.get(name, ())))))
    if wanted is not None:
        missing = sorted(set(wanted) - {n.name for n in result})
        if missing:
            raise UnknownNode(f"unknown node(s): {', '.join(missing)}")
    return sorted(result, key=lambda n: _natural(n.name))


def _with_jobs(n: NodeInfo, jobs: tuple[int, ...]) -> NodeInfo:
    from dataclasses import replace

    return replace(n, jobs=jobs)


def _natural(name: str) -> tuple[int | str, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"
