"""Stress: many short guarded 2-node jobs on the real local cluster, ending
in every way a job ends (slurmguard.hook.exits.ENDINGS), in two real shapes
(DDP all-reduce with futures; a 2-stage pipeline's send/recv), against an
unguarded control of the same jobs.

Asserted exactly, job by job: every task's exit status is the one its
ending gives (or gloo's upstream finalisation abort, pytorch issue 190489,
which strikes guarded and unguarded jobs alike), its printed results equal
the control's, the hook prints nothing, and each guarded rank's ring holds
every training collective the rank completed with nothing counted lost.
Asserted statistically: guarded jobs do not abort more often than the
control (Fisher's exact test, one-sided), so the upstream race alone cannot
fail the test while a hook that provoked it would.

All jobs are submitted at once; the 4-node cluster runs 4 of them side by
side (one CPU per task). The 75 jobs cost about 550 CPU seconds (each task
starts Python and imports torch): 5 to 8 minutes on the 2-core development
machine when it is otherwise idle.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from slurmguard.hook import exits, ring
from tests.test_hook_cluster import guard  # noqa: F401  (fixture)

# Opt-in for now (issue 19 stays open): in a run on the merged tree one job's rank 0
# failed its rendezvous (init_process_group: the port taken between submission and
# start) and, without --kill-on-bad-exit, its peer waited forever, hanging the test.
# SLURMGUARD_HOOK_STRESS=1 runs it.
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("SLURMGUARD_HOOK_STRESS"),
                                 reason="issue 19: stress harness can hang on a failed "
                                        "rendezvous; SLURMGUARD_HOOK_STRESS=1 runs it")]

#: (shape, ending) pairs: every ending for DDP; the pipeline skips the ones
#: that do not depend on the shape and the costly spawned DataLoader
CASES = [("ddp", e) for e in exits.ENDINGS] + [
    ("pipe", e) for e in exits.ENDINGS if e not in ("startup", "no-collective", "loader-spawn")]
GUARDED_REPEATS = 2
#: the test fails when guarded jobs abort more often than the control at
#: this significance (one-sided Fisher's exact test)
ALPHA = 0.01


def batch_script(python: str, job: Path, shape: str, ending: str) -> str:
    # each task reports its own exit status (signals as 128 + n, as bash
    # gives them) and keeps it, so the job's state is the tasks' as well
    task = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS {python} {job} {shape} {ending}; "
            "s=$?; echo \"EXIT $SLURM_PROCID $s\"; exit $s")
    # the port is picked when the job starts, not at submission: with all jobs
    # queued at once, a port free then may be taken by the time a job runs
    port = f"{python} -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); " \
           "print(s.getsockname()[1])'"
    return ("#!/bin/bash\n"
            f"export MASTER_ADDR=127.0.0.1 MASTER_PORT=$({port})\n"
            f"srun --label bash -c '{task}'\n")


def expected_exit(ending: str, rank: int) -> int:
    status = exits.expected_status(ending, rank)
    return 128 - status if status < 0 else status


def parse(text: str) -> dict[int, dict]:
    """Per task: exit status, RESULT line, all its lines (srun --label)."""
    tasks: dict[int, dict] = {r: {"exit": None, "result": None, "lines": []} for r in (0, 1)}
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+): (.*)$", line)
        if not m:
            continue
        rank, body = int(m.group(1)), m.group(2)
        if rank not in tasks:
            continue
        tasks[rank]["lines"].append(body)
        if body.startswith("EXIT "):
            tasks[rank]["exit"] = int(body.split()[2])
        elif body.startswith("RESULT "):
            tasks[rank]["result"] = body
    return tasks


def raced(task: dict) -> bool:
    return task["exit"] == 128 + 6 and any(exits.ABORT_MESSAGE in x for x in task["lines"])


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def wait_all(cluster, job_ids: list[int], timeout: float) -> dict[int, str]:
    """Final state of every job, noted as it ends (slurmctld forgets ended
    jobs after MinJobAge, 300 s on the dev cluster)."""
    deadline = time.monotonic() + timeout
    states: dict[int, str] = {}
    while time.monotonic() < deadline:
        res = cluster.run(["squeue", "-h", "-t", "all", "-j", ",".join(map(str, job_ids)),
                           "-o", "%i %T"], timeout=30)
        for line in res.stdout.splitlines() if res.returncode == 0 else ():
            jid, _, state = line.strip().partition(" ")
            if state in FINAL:
                states[int(jid)] = state
        if len(states) == len(job_ids):
            return states
        time.sleep(2)
    cluster.run(["scancel", *map(str, job_ids)])
    pytest.fail(f"stress jobs still running after {timeout:g} s: "
                f"{sorted(set(job_ids) - set(states))[:10]}")


# the suite's 600 s per-test guard is for hangs; this test's 75 jobs need
# about 550 CPU seconds, more than 600 s of wall time on a busy 2-core box
@pytest.mark.timeout(1800)
def test_guarded_jobs_end_as_unguarded_ones_with_every_record(devcluster, guard, tmp_path):
    work = Path(tmp_path)
    work.chmod(0o755)
    job = exits.write_job(work)
    runs = []  # (guarded, shape, ending, job id, output file)
    for rep in range(GUARDED_REPEATS + 1):
        guarded = rep < GUARDED_REPEATS
        for shape, ending in CASES:
            out = work / f"{shape}-{ending}-{rep}.out"
            args = ["-N2", "-n2", "-o", str(out), "-J", f"sg-stress-{ending}"]
            if guarded:
                args.append("--straggler-guard")
            jid = devcluster.sbatch(batch_script(sys.executable, job, shape, ending), *args)
            runs.append((guarded, shape, ending, jid, out))
    t0 = time.monotonic()
    states = wait_all(devcluster, [r[3] for r in runs], timeout=1700)
    elapsed = time.monotonic() - t0

    problems: list[str] = []
    aborts: Counter = Counter()
    jobs: Counter = Counter()
    control: dict[tuple, dict] = {}
    parsed = []
    for guarded, shape, ending, jid, out in runs:
        text = out.read_text() if out.exists() else ""
        tasks = parse(text)
        parsed.append((guarded, shape, ending, jid, text, tasks))
        if not guarded:
            control[(shape, ending)] = tasks
    for guarded, shape, ending, jid, text, tasks in parsed:
        side = "guarded" if guarded else "unguarded"
        where = f"{side} job {jid} ({shape}, {ending})"
        jobs[side] += 1
        aborts[side] += any(raced(t) for t in tasks.values())
        for rank, t in tasks.items():
            if raced(t):
                if ending in exits.RACE_FREE:
                    problems.append(f"{where}: rank {rank} aborted in a race-free ending")
            elif t["exit"] != expected_exit(ending, rank):
                problems.append(f"{where}: rank {rank} exit {t['exit']}, expected "
                                f"{expected_exit(ending, rank)}: {text[-800:]}")
            if t["result"] != control[(shape, ending)][rank]["result"]:
                problems.append(f"{where}: rank {rank} printed {t['result']!r}, the control "
                                f"{control[(shape, ending)][rank]['result']!r}")
        if "slurmguard" in text:
            problems.append(f"{where}: the hook printed: {text[-800:]}")
        if not any(raced(t) for t in tasks.values()):
            want_state = "COMPLETED" if all(expected_exit(ending, r) == 0 for r in (0, 1)) \
                else "FAILED"
            if states[jid] != want_state:
                problems.append(f"{where}: state {states[jid]}, expected {want_state}")
        job_dir = guard["root"] / str(jid)
        if not guarded:
            if job_dir.exists():
                problems.append(f"{where}: has a ring directory")
            continue
        for rank in (0, 1):
            want = exits.expected_counts(shape, ending, rank)
            path = job_dir / f"rank-{rank}.step-0.torch.ring"
            if not want:
                continue
            if not path.exists():
                problems.append(f"{where}: rank {rank} has no ring")
                continue
            with ring.RingReader(str(path)) as r:
                h = r.refresh_header()
                got = exits.training_records(r.read().records, shape)
            if got != want or h.overwritten:
                problems.append(f"{where}: rank {rank} ring holds {got}, expected {want}, "
                                f"{h.overwritten} counted lost")
    p = exits.fisher_greater(aborts["guarded"], jobs["guarded"], aborts["unguarded"],
                             jobs["unguarded"])
    print(f"\nstress: {jobs['guarded']} guarded, {jobs['unguarded']} unguarded jobs in "
          f"{elapsed:.0f} s; aborted by the upstream race: guarded {aborts['guarded']}, "
          f"unguarded {aborts['unguarded']}; Fisher one-sided p = {p:.3f}")
    assert jobs["guarded"] >= 50
    assert not problems, "\n".join(problems[:10])
    assert p >= ALPHA, (f"guarded jobs aborted {aborts['guarded']}/{jobs['guarded']}, unguarded "
                        f"{aborts['unguarded']}/{jobs['unguarded']} (p = {p:.4f})")
