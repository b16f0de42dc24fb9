"""A fail-slow scenario on a guarded development cluster, shared by the demo
and `slurmguard bench loop`: a guarded 2-node DDP job, a slowdown injected on
one node's rank (plus the matching sim thermal fault), then what slurmguard
did, with timings taken from the job's own iteration log."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmguard.devcluster.guard import Guard
from slurmguard.slurm.hostlist import expand
from slurmguard.slurm.parse import nodes_from_scontrol


@dataclass
class ScenarioResult:
    job: int
    slow_node: str = ""
    healthy_step_s: float = 0.0
    slow_step_s: float = 0.0
    t_inject: float = 0.0
    t_drain: float | None = None
    drain_reason: str = ""
    iterations_to_drain: int | None = None
    t_requeue: float | None = None
    final_state: str = ""
    final_nodes: list[str] = field(default_factory=list)
    step_series: list[float] = field(default_factory=list)
    inject_index: int = 0

    @property
    def detection_delay_s(self) -> float | None:
        return None if self.t_drain is None else self.t_drain - self.t_inject


class Scenario:
    def __init__(self, guard: Guard, say: Callable[[str], None] = print) -> None:
        self.guard = guard
        self.cluster = guard.cluster
        self.say = say

    def submit(self, iters: int, compute_ms: float = 80.0, *, guarded: bool = True,
               nodes: str | None = None) -> int:
        """The DDP training job on 2 exclusive nodes (GPU training jobs do not share nodes)."""
        st = self.cluster.state_dir
        script = (
            "#!/bin/bash\n"
            "export MASTER_PORT=$((21000 + SLURM_JOB_ID % 20000))\n"
            f"srun {sys.executable} -m slurmguard.devcluster.train --iters {iters} "
            f"--compute-ms {compute_ms} --ckpt {st}/ckpt-$SLURM_JOB_ID "
            f"--inject-dir {self.guard.inject_dir} --log {st}/train-$SLURM_JOB_ID.jsonl\n")
        # train.py checkpoints on SIGUSR1: it asks for slurmguard's checkpoint signal
        args = ["-N2", "--ntasks-per-node=1", "--exclusive", "-J", "ddp-train", "-o", f"{st}/job-%j.out",
                "--comment=slurmguard:signal=USR1"]
        if guarded:
            args.append("--straggler-guard")
        if nodes:
            args += ["-w", nodes]
        return self.cluster.sbatch(script, *args)

    def log(self, job: int) -> list[dict]:
        p = Path(self.cluster.state_dir) / f"train-{job}.jsonl"
        if not p.exists():
            return []
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

    def job_field(self, job: int, key: str) -> str:
        out = self.cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
        for tok in out.split():
            if tok.startswith(f"{key}="):
                return tok.split("=", 1)[1]
        return ""

    def node(self, name: str):
        (n,) = nodes_from_scontrol(self.cluster.run(["scontrol", "show", "node", "-o", name]).stdout)
        return n

    def wait(self, pred, timeout: float, what: str, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = pred()
            if v:
                return v
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")

    def run(self, factor: float = 1.3, iters: int = 500, baseline_iters: int = 60,
            wait_completion: bool = True) -> ScenarioResult:
        job = self.submit(iters)
        self.say(f"submitted guarded 2-node DDP job {job} (sbatch --straggler-guard, gloo)")
        self.wait(lambda: len(self.log(job)) >= baseline_iters, 120, "the job's warm-up and baseline")
        nodes = sorted(expand(self.job_field(job, "NodeList")))
        res = ScenarioResult(job=job, slow_node=nodes[-1])
        steps = [r["step_s"] for r in self.log(job)]
        res.healthy_step_s = sorted(steps[10:])[len(steps[10:]) // 2]
        self.say(f"job {job} runs on {', '.join(nodes)}: {len(steps)} iterations, "
                 f"healthy step {res.healthy_step_s * 1000:.0f} ms")
        res.inject_index = len(self.log(job))
        res.t_inject = time.time()
        self.guard.inject(res.slow_node, factor)
        self.guard.set_sim_profiles({res.slow_node: "thermal_throttle"})
        self.say(f"injected a fail-slow on {res.slow_node}: its rank computes {factor:g}x slower; "
                 f"sim telemetry: thermal throttling (hot GPU, low SM clock)")
        n = self.wait(lambda: (x := self.node(res.slow_node)).drained and x, 120,
                      f"{res.slow_node} to be drained")
        res.t_drain = time.time()
        res.drain_reason = n.reason or ""
        entries = self.log(job)
        res.iterations_to_drain = max(0, len(entries) - res.inject_index)
        self.say(f"detected and drained {res.slow_node} after {res.detection_delay_s:.1f}s "
                 f"({res.iterations_to_drain} iterations): Reason={res.drain_reason}")
        slow = [r["step_s"] for r in entries[res.inject_index:]]
        if slow:
            res.slow_step_s = sorted(slow)[len(slow) // 2]
        restarts = self.wait(lambda: int(self.job_field(job, "Restarts") or 0) >= 1 or None, 90,
                             "the requeue")
        res.t_requeue = time.time()
        self.say(f"requeued job {job} (restarts={restarts and self.job_field(job, 'Restarts')}); "
                 f"it restarts from its checkpoint on nodes without {res.slow_node}")
        self.guard.inject(res.slow_node, None)
        res.step_series = [r["step_s"] for r in entries]
        if wait_completion:
            res.final_state = self.cluster.wait_job(job, timeout=300)
            res.final_nodes = sorted(expand(self.job_field(job, "NodeList")))
            self.say(f"job {job} {res.final_state} on {', '.join(res.final_nodes)}")
        return res
