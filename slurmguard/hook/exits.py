"""How guarded jobs end: the scenario job, its expected outcome, and the
guarded-versus-unguarded comparison of how often jobs abort.

One job script (:data:`JOB`) serves the local exit tests, the cluster
stress test and `slurmguard bench hook --exit-runs`: a 2-rank gloo job of a
couple of seconds in one of two real shapes, ending in one of the ways a
job ends (:data:`ENDINGS`). Every rank prints ``RESULT <rank> <digest of its
parameters>``, then ends as its ending says; the hook must leave its exit
status, output and results as they are without the hook, and its ring must
hold every collective the rank completed.

Shapes (STEPS training steps each):

- ``ddp``: DistributedDataParallel over a small MLP; one gradient-bucket
  all-reduce per step (async work with a future, written by the hook's
  completion callback);
- ``pipe``: a 2-stage pipeline; per step rank 0 sends activations to
  rank 1 and receives their gradient back (gloo p2p, written when the call
  returns).

The upstream race (pytorch/pytorch issue 190489): a gloo job that reaches
interpreter finalisation can abort (SIGABRT, ``terminate called without an
active exception``) after its work is done, with or without the hook.
:func:`fisher_greater` is the one-sided test that a guarded sample does not
abort more often than an unguarded one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

STEPS = 6
#: elements of the ddp shape's one gradient bucket (Linear(32,32)+Linear(32,4))
DDP_COUNT = 32 * 32 + 32 + 4 * 32 + 4
#: elements of the pipe shape's activation (and gradient) per step
PIPE_COUNT = 8 * 32
SHAPES = ("ddp", "pipe")

#: ending -> what rank 1 does after training (rank 0 always destroys the
#: group and exits normally, except where the ending concerns all ranks)
ENDINGS: dict[str, str] = {
    "destroy": "destroy_process_group, then normal exit (all ranks)",
    "no-destroy": "normal exit without destroy_process_group (all ranks)",
    "finish": "slurmguard.teardown.finish(0): barrier, destroy, os._exit (all ranks)",
    "sys-exit": "rank 1: sys.exit(3)",
    "raise": "rank 1: uncaught RuntimeError",
    "sigterm": "rank 1: SIGTERM, default disposition",
    "sigterm-handler": "rank 1: SIGTERM to the job's own handler, which exits 7",
    "sigusr1": "rank 1: SIGUSR1, default disposition",
    "sigkill": "rank 1: SIGKILL",
    "os-exit": "rank 1: os._exit(5) without destroy_process_group",
    "loader-fork": "DataLoader with 2 forked workers feeds training; destroy, exit",
    "loader-spawn": "DataLoader with 2 spawned workers feeds training; destroy, exit",
    "no-collective": "init_process_group, no collective, destroy, exit (all ranks)",
    "startup": "sys.exit(4) right after importing torch.distributed (all ranks)",
}

#: endings Slurm sends mid-training (the job trains until they come; only
#: on a cluster: the stress test's batch script sends them once both ranks
#: have printed ``STEP <rank> SIGNAL_AFTER``). Every task of the job step
#: gets the signal.
SLURM_ENDINGS: dict[str, str] = {
    "slurm-term": "scancel --signal=TERM mid-training (all ranks), default disposition",
    "slurm-usr1": "scancel --signal=USR1 mid-training (all ranks), default disposition",
    "slurm-kill": "job cancel (scancel) mid-training: SIGTERM, which the job's own handler "
    "notes and trains on (a checkpoint outlasting KillWait), then SIGKILL",
}
#: the signal that ends each Slurm-sent ending's ranks
SLURM_SIGNALS = {"slurm-term": signal.SIGTERM, "slurm-usr1": signal.SIGUSR1, "slurm-kill": signal.SIGKILL}
#: the Slurm-sent endings' signal comes once both ranks printed this step
SIGNAL_AFTER = 3
#: a Slurm-sent ending's job stops training here when no signal came
LONG_STEPS = 1500

# exit status of rank 1 per ending (rank 0: 0, except where the ending
# concerns all ranks); negative: killed by that signal
_RANK1_STATUS = {
    "sys-exit": 3,
    "raise": 1,
    "sigterm": -signal.SIGTERM,
    "sigterm-handler": 7,
    "sigusr1": -signal.SIGUSR1,
    "sigkill": -signal.SIGKILL,
    "os-exit": 5,
}
_ALL_STATUS = {"startup": 4}
#: endings where no rank reaches interpreter finalisation with gloo started,
#: so the upstream race cannot strike (in all others rank 0 at least exits
#: normally after destroy_process_group)
RACE_FREE = frozenset({"finish", "startup", *SLURM_ENDINGS})
ABORT_MESSAGE = "terminate called without an active exception"

JOB = textwrap.dedent("""
    # slurmguard exit scenario: python JOB SHAPE ENDING
    import hashlib, os, signal, sys, time


    def main(shape, ending):
        env = os.environ
        rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
        world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
        import torch, torch.distributed as dist
        if ending == "startup":
            sys.exit(4)
        torch.set_num_threads(1)
        from slurmguard.rendezvous import init_process_group
        init_process_group("gloo", rank, world)
        if ending == "sigterm-handler" and rank == 1:
            def on_term(signum, frame):
                print("TERM", rank, flush=True)
                sys.exit(7)
            signal.signal(signal.SIGTERM, on_term)
        if ending == "slurm-kill":
            signal.signal(signal.SIGTERM, lambda signum, frame: print("TERM", rank, flush=True))
        torch.manual_seed(0)
        if ending == "no-collective":
            model = torch.nn.Linear(32, 4)
        elif shape == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(
                torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
        else:  # pipe: rank 0 holds stage 0, rank 1 stage 1
            model = torch.nn.Linear(32, 32) if rank == 0 else torch.nn.Linear(32, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(11 + rank)
        data = [torch.randn(8, 32, generator=gen) for _ in range({steps})]
        if ending.startswith("slurm-"):
            # train until Slurm's signal ends the job; a step line once the
            # step's collectives are done (and their records written)
            def paced():
                for i in range({long_steps}):
                    yield torch.randn(8, 32, generator=gen)
                    time.sleep(0.02)
                    # one write: a print of several items is several writes
                    # when unbuffered, and a TERM between them leaves half a line
                    sys.stdout.write(f"STEP {{rank}} {{i}}\\n")
                    sys.stdout.flush()
            batches = paced()
        elif ending.startswith("loader-"):
            from torch.utils.data import DataLoader
            batches = DataLoader(data, batch_size=None, num_workers=2,
                                 multiprocessing_context=ending.split("-")[1])
        else:
            batches = data
        if ending != "no-collective":
            for x in batches:
                opt.zero_grad()
                if shape == "ddp":
                    model(x).pow(2).mean().backward()
                elif rank == 0:
                    act = model(x)
                    dist.send(act.detach(), 1)
                    grad = torch.empty_like(act)
                    dist.recv(grad, 1)
                    act.backward(grad)
                else:
                    act = torch.empty(8, 32)
                    dist.recv(act, 0)
                    act.requires_grad_(True)
                    model(act).pow(2).mean().backward()
                    dist.send(act.grad, 0)
                opt.step()
        params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        print("RESULT", rank, hashlib.sha256(params).hexdigest()[:16], flush=True)
        if ending == "finish":
            from slurmguard.teardown import finish
            finish(0)
        if rank == 1:
            if ending == "sys-exit":
                sys.exit(3)
            if ending == "raise":
                raise RuntimeError("rank 1 gives up")
            if ending in ("sigterm", "sigterm-handler"):
                os.kill(os.getpid(), signal.SIGTERM)
            if ending == "sigusr1":
                os.kill(os.getpid(), signal.SIGUSR1)
            if ending == "sigkill":
                # nothing runs on SIGKILL: a record whose completion callback
                # has not run yet dies with the process. Slurm's SIGKILL comes
                # KillWait seconds after SIGTERM, not microseconds after a
                # collective; model that with a pause
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
            if ending == "os-exit":
                os._exit(5)
        if ending != "no-destroy":
            dist.destroy_process_group()


    if __name__ == "__main__":  # spawned DataLoader workers import this file
        main(sys.argv[1], sys.argv[2])
""").format(steps=STEPS, long_steps=LONG_STEPS)


def write_job(directory: Path) -> Path:
    path = Path(directory) / "sg_exit_job.py"
    path.write_text(JOB)
    os.chmod(path, 0o644)
    return path


def expected_status(ending: str, rank: int) -> int:
    """Exit status of `rank` (negative: the signal that killed it)."""
    if ending in _ALL_STATUS:
        return _ALL_STATUS[ending]
    if ending in SLURM_SIGNALS:
        return -SLURM_SIGNALS[ending]
    return _RANK1_STATUS.get(ending, 0) if rank == 1 else 0


def ops_per_step(shape: str) -> int:
    """Training records one step adds to a rank's ring."""
    return 1 if shape == "ddp" else 2


def trained(ending: str) -> bool:
    return ending not in ("startup", "no-collective")


def expected_counts(shape: str, ending: str, rank: int) -> dict[str, int]:
    """Training records `rank`'s ring must hold: op name -> how many
    records of the shape's payload (DDP_COUNT all-reduces, PIPE_COUNT
    send/recv). Empty: no training collective. The Slurm-sent endings stop
    training at a step the job prints (see the stress test)."""
    if ending in SLURM_ENDINGS:
        raise ValueError(f"{ending}: the count depends on when the signal came")
    if not trained(ending):
        return {}
    if shape == "ddp":
        return {"allreduce": STEPS}
    return {"send": STEPS, "recv": STEPS}


def training_records(records: list, shape: str) -> dict[str, int]:
    """Count the records of the shape's training payload in one ring."""
    size = DDP_COUNT if shape == "ddp" else PIPE_COUNT
    out: dict[str, int] = {}
    for r in records:
        if r.count == size and r.op_name in ("allreduce", "send", "recv"):
            out[r.op_name] = out.get(r.op_name, 0) + 1
    return out


def aborted(status: int, stderr: str) -> bool:
    """The upstream finalisation race's signature."""
    return status == -signal.SIGABRT and ABORT_MESSAGE in stderr


@dataclass
class RankOutcome:
    rank: int
    status: int
    stdout: str
    stderr: str


@dataclass
class RunOutcome:
    """One local 2-rank run: per-rank outcomes and ring findings."""

    shape: str
    ending: str
    guarded: bool
    ranks: list[RankOutcome] = field(default_factory=list)
    counts: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> op -> records
    lost: dict[int, int] = field(default_factory=dict)  # rank -> header lost count
    rings: list[str] = field(default_factory=list)

    @property
    def aborted(self) -> bool:
        return any(aborted(r.status, r.stderr) for r in self.ranks)

    def problems(self) -> list[str]:
        """How this run differs from what the ending must give (the
        upstream abort excepted: it is counted, not judged, per run)."""
        out = []
        for r in self.ranks:
            want = expected_status(self.ending, r.rank)
            if r.status != want and not aborted(r.status, r.stderr):
                out.append(f"rank {r.rank}: exit status {r.status}, expected {want}: {r.stderr[-600:]}")
            if "slurmguard" in r.stderr:
                out.append(f"rank {r.rank}: the hook wrote to stderr: {r.stderr[-600:]}")
            if self.ending != "startup" and f"RESULT {r.rank} " not in r.stdout:
                out.append(f"rank {r.rank}: no RESULT line: {r.stdout[-300:]} {r.stderr[-600:]}")
        if self.guarded:
            for rank in range(len(self.ranks)):
                counts = expected_counts(self.shape, self.ending, rank)
                if counts and self.counts.get(rank) != counts:
                    out.append(f"rank {rank}: ring holds {self.counts.get(rank)}, expected {counts}")
                if self.lost.get(rank, 0):
                    out.append(f"rank {rank}: ring header counts {self.lost[rank]} lost")
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMGUARD_")}
    env.update(extra)
    return env


def ring_env(ring_dir: str | os.PathLike, job_id: int, records: int) -> dict[str, str]:
    """The environment the SPANK plugin gives a guarded job's task for the torch
    hook: its ring directory, job and step id (step 0), ring size in records."""
    return {
        "SLURMGUARD_RING_DIR": str(ring_dir),
        "SLURMGUARD_JOB_ID": str(job_id),
        "SLURMGUARD_STEP_ID": "0",
        "SLURMGUARD_RING_RECORDS": str(records),
    }


def start_local(
    job: Path, shape: str, ending: str, ring_dir: Path | None, site: Path, world: int = 2
) -> list[subprocess.Popen]:
    """Start the ranks of one run on 127.0.0.1; guarded when ring_dir is
    given (the SPANK plugin's environment: site dir on PYTHONPATH, ring
    dir, job and step id)."""
    port = free_port()
    procs = []
    for rank in range(world):
        extra = {
            "PYTHONPATH": str(site),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
        }
        if ring_dir is not None:
            extra.update(ring_env(ring_dir, 1, 1024))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(job), shape, ending],
                env=clean_env(extra),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=str(job.parent),
            )
        )
    return procs


def finish_local(
    procs: list[subprocess.Popen], shape: str, ending: str, ring_dir: Path | None, timeout: float = 180
) -> RunOutcome:
    from slurmguard.hook import ring

    out = RunOutcome(shape=shape, ending=ending, guarded=ring_dir is not None)
    for rank, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            so, se = p.communicate()
            se += f"\n(killed after {timeout:g} s)"
        out.ranks.append(RankOutcome(rank, p.returncode, so, se))
    if ring_dir is not None:
        for path in sorted(Path(ring_dir).glob("*.ring")):
            out.rings.append(path.name)
            with ring.RingReader(str(path)) as r:
                h = r.refresh_header()
                recs = r.read().records
            out.counts[h.global_rank] = training_records(recs, shape)
            out.lost[h.global_rank] = h.overwritten
    return out


def run_local(
    job: Path, shape: str, ending: str, ring_dir: Path | None, site: Path, timeout: float = 180
) -> RunOutcome:
    return finish_local(start_local(job, shape, ending, ring_dir, site), shape, ending, ring_dir, timeout)


def fisher_greater(guarded_aborts: int, guarded_runs: int, plain_aborts: int, plain_runs: int) -> float:
    """One-sided p-value of Fisher's exact test that guarded runs abort
    MORE often than unguarded ones (small: the hook raises the rate)."""
    from scipy.stats import fisher_exact

    table = [[guarded_aborts, guarded_runs - guarded_aborts], [plain_aborts, plain_runs - plain_aborts]]
    return float(fisher_exact(table, alternative="greater")[1])


# Runs of one ending, each rank a child forked from a parent that imported
# torch once: a run costs its own work, not two interpreter starts and
# torch imports, so a few hundred runs fit in minutes on a small machine.
# Each child leaves through sys.exit and interpreter finalisation, as a
# job script does; the parent moves a guarded run's rings aside.
FORKED_RUNS = textwrap.dedent("""
    import json, os, runpy, signal, socket, sys, time
    job, shape, ending, runs, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    hang_s = float(sys.argv[6])
    # what the job imports, before forking, so the children start warm
    import torch, torch.distributed, torch.nn.parallel, torch._dynamo, torch.utils.data
    main = runpy.run_path(job, run_name="sg_exit_job")["main"]
    ring_dir = os.environ.get("SLURMGUARD_RING_DIR")
    for i in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                fd = os.open(os.path.join(out, f"{i}-{rank}.log"),
                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
                main(shape, ending)
                sys.exit(0)
            pids.append(pid)
        status = []
        for rank, p in enumerate(pids):
            # a rank that hangs in gloo's teardown (seen without the hook
            # too) is killed after hang_s and reported, not waited for
            deadline = time.monotonic() + hang_s
            while True:
                done, st = os.waitpid(p, os.WNOHANG)
                if done:
                    status.append(os.waitstatus_to_exitcode(st))
                    break
                if time.monotonic() > deadline:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    with open(os.path.join(out, f"{i}-{rank}.log"), "a") as f:
                        f.write(f"\\n(hung: killed after {hang_s:g} s)\\n")
                    status.append(-signal.SIGKILL)
                    break
                time.sleep(0.05)
        if ring_dir:
            keep = os.path.join(out, f"rings-{i}")
            os.mkdir(keep)
            for f in os.listdir(ring_dir):
                os.rename(os.path.join(ring_dir, f), os.path.join(keep, f))
        print(json.dumps({"run": i, "status": status}), flush=True)
""")


def forked_runs(
    directory: Path,
    shape: str,
    ending: str,
    runs: int,
    site: Path,
    timeout: float = 3600,
    hang_s: float = 300,
) -> dict[str, list[RunOutcome]]:
    """`runs` guarded and `runs` unguarded runs of (shape, ending), the two
    sides in two parent processes running at the same time; a rank still
    running hang_s seconds after its run began is killed (and reported)."""
    from slurmguard.hook import ring

    directory = Path(directory)
    job = write_job(directory)
    driver = directory / "sg_forked_runs.py"
    driver.write_text(FORKED_RUNS)
    procs = {}
    for side in ("guarded", "unguarded"):
        out = directory / side
        out.mkdir()
        extra = {"PYTHONPATH": str(site)}
        if side == "guarded":
            (out / "rings").mkdir()
            extra.update(ring_env(out / "rings", 1, 1024))
        procs[side] = subprocess.Popen(
            [sys.executable, str(driver), str(job), shape, ending, str(runs), str(out), str(hang_s)],
            env=clean_env(extra),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=str(directory),
        )
    results: dict[str, list[RunOutcome]] = {}
    for side, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{side} runs failed ({p.returncode}): {stderr[-1000:]}")
        out = directory / side
        outcomes = []
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            i = d["run"]
            o = RunOutcome(shape=shape, ending=ending, guarded=side == "guarded")
            for rank, status in enumerate(d["status"]):
                log = (out / f"{i}-{rank}.log").read_text(errors="replace")
                o.ranks.append(RankOutcome(rank, status, log, log))
            if o.guarded:
                for path in sorted((out / f"rings-{i}").glob("*.ring")):
                    o.rings.append(path.name)
                    with ring.RingReader(str(path)) as r:
                        h = r.refresh_header()
                        o.counts[h.global_rank] = training_records(r.read().records, shape)
                        o.lost[h.global_rank] = h.overwritten
            outcomes.append(o)
        results[side] = outcomes
    return results
