"""The online loop on real training jobs (slurmguard.workloads) with real faults
from outside the job (a cgroup CPU cap on one node), on the guarded local cluster.

Per workload (ddp, fsdp, pp, tp, 2d), one job: a healthy start and a restart
after a requeue that is not slurmguard's, and nothing may happen (no drain,
comment, incident or signal); then a severe fault on one of its nodes: that
node, and only that node, is drained with a slurmguard reason, and the job is
requeued and resumes on other nodes from its checkpoint. For ddp and pp also
the moderate tier (drain and the checkpoint signal, no requeue). A pipeline
whose capped stage all but stops it is drained too, and a node under two
guarded jobs is drained once.

Time on the quiet 2-core development machine: 40-70 s per severe test (more
with the restart), the whole file about 14 minutes (the moderate and stalled-pipeline tests 50-70 s each).
"""

from __future__ import annotations

import time

import pytest

from slurmguard_dev.devcluster import fault
from slurmguard_dev.devcluster.scenario import SEVERE, Scenario
from tests.fixtures.guard import nothing_happened, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BASELINE = 40  # steps: the agents' warm-up (5) and baseline (20) with margin
HEALTHY = 30  # further healthy steps judged before the fault
DRAIN_S = 120  # a severe fault is drained well within this (bench loop: 5-20 s)
MODERATE_TOP = 1.3  # the moderate tier's top (issue 12: about 1.15-1.3x; see the moderate test)
#: a pipeline stage at 1.3x is named within localise's two windows, whose noise and
#: 50% attribution it clears in some cycles and not in others (session 13: 11, 17
#: and 101 s; a CI run at a calibrated 1.16x: not in 150 s); a DDP rank at 1.19x
#: was not named in 150 s in one full-suite run (session 14). bench loop's figure is
#: the 60 s target, this the bound past which the test calls it missed
MODERATE_TOP_S = 240


def _drained_after(run, sc: Scenario, node: str, t_inject: float, within: float = DRAIN_S):
    try:
        drain = wait_for(lambda: sc.drain(node), within, f"{node} drained")
    except AssertionError as exc:
        # what the controller made of it: its incidents say why no node was named
        with run.store() as s:
            why = [
                (
                    str(i.tier.value),
                    str(i.status.value),
                    i.nodes,
                    i.outcome,
                    i.evidence.get("localisation") or i.evidence.get("note"),
                )
                for i in s.incidents()
            ]
        acts = [(e.action, e.node, e.outcome, e.reason) for e in run.audit()]
        # and what its log says of actions held back or failed
        lines = run.cluster.service_output(run.guard.controller_service(0))
        # and, every 10 s while it lasts, why the slow job still had no node named
        # (the incident keeps only what was seen at its first detection)
        words = ("held back", "error", "failed", "Traceback", "no node named")
        said = [ln for ln in lines if any(w in ln for w in words)]
        raise AssertionError(f"{exc}; incidents: {why}; audit: {acts}; controller log: {said[-8:]}") from None
    t_drain = sc.epoch(drain.at)
    assert t_drain >= t_inject - 1.0, "drained before the fault was on"
    assert drain.reason.startswith("slurmguard: ")
    return t_drain


def _requeued(run, sc: Scenario, job: int, within: float = 60) -> None:
    try:
        wait_for(lambda: run.audit("requeue"), within, "requeue")
    except AssertionError as exc:
        # what the controller did instead, and what Slurm says of the job
        acts = [(e.action, e.node, e.job_id, e.reason) for e in run.audit()]
        with run.store() as s:
            tiers = [(str(i.tier.value), str(i.status.value), i.slowdown, i.outcome) for i in s.incidents()]
        state = run.cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout[:400]
        raise AssertionError(f"{exc}; audit: {acts}; incidents: {tiers}; job: {state}") from None


@pytest.mark.parametrize("workload", ["ddp", "fsdp", "pp", "2d"])
def test_healthy_run_untouched_then_capped_node_drained_and_job_moved(guarded, workload):
    _capped_node_drained(guarded, workload)


def _capped_node_drained(run, workload: str, ckpt_every: int = 25) -> None:
    sc = Scenario(run.guard, say=print, workload=workload)
    job = sc.submit(steps=100000, ckpt_every=ckpt_every)
    healthy = sc.wait_steps(job, BASELINE + HEALTHY, timeout=240)
    restart = 0
    if ckpt_every:
        # a restart that is not slurmguard's (preemption, an admin): resumes from
        # the checkpoint, and its start-up is not a slowdown
        sc.requeue(job)
        restart = 1
        healthy = sc.wait_steps(job, BASELINE, restart=1, timeout=240)
        assert healthy[0]["iter"] >= ckpt_every and healthy[0]["iter"] % ckpt_every == 0
    time.sleep(3)  # the last reports of the healthy run reach the controller
    nothing_happened(run)

    slow = sc.job_nodes(job)[-1]
    use, cap = sc.inject(slow, SEVERE)  # measures the node's CPU use for 3 s first
    t_inject = time.time()
    n_before = len(sc.log(job))
    t_drain = _drained_after(run, sc, slow, t_inject)
    _requeued(run, sc, job)
    sc.clear(slow)
    assert [e.node for e in run.audit("drain")] == [slow]
    assert not any(run.node(n)["drained"] for n in run.cluster.node_names if n != slow)
    # resumed elsewhere, from its checkpoint
    sc.wait_steps(job, 3, restart=restart + 1, timeout=180)
    assert slow not in sc.job_nodes(job)
    run.cluster.run(["scancel", str(job)])
    after = [e["step_s"] for e in sc.log(job)[n_before:] if e["t"] <= t_drain]
    ms = sorted(e["step_s"] for e in healthy[10:])[len(healthy[10:]) // 2] * 1e3
    slowed = sorted(after)[len(after) // 2] * 1e3 if after else float("nan")
    print(
        f"\n{workload}: healthy step {ms:.0f} ms; {slow} capped at {cap:.0f}% "
        f"(used {use:.2f} CPUs) -> {slowed:.0f} ms; drained {t_drain - t_inject:.1f}s / "
        f"{len(after)} steps after injection"
    )


def test_tensor_parallel_capped_node_drained_and_job_moved(guarded):
    """DTensor TP over the job's 2 nodes: its forward and backward all-reduces
    are functional collectives, which the torch hook records (as the c10d
    all-reduces they issue, ended when their work completes), so the healthy
    rank is seen waiting inside them for the capped one and the capped rank
    computing longer: that node, and only it, is drained, and the job moves.
    With a checkpoint every 25 steps, like the other shapes: the agent keeps
    the 8-all-reduce iteration it learned its baseline under (the checkpoint
    cycle, 25 such steps, repeats too but is not an iteration)."""
    _capped_node_drained(guarded, "tp")


def test_pipeline_stalled_by_its_capped_stage_is_drained(guarded):
    """The last stage capped at 1% of a CPU: the pipeline all but stops (steps
    of seconds), and the stage that holds it up is the one drained. Its steps
    of seconds are judged over time (controller.assess.LOCALISE_SPAN_S), not
    9 + 9 iterations: drained 19.6-29.8 s after injection in 4 runs at load
    average 0.3-7 (61.4 s before; over 120 s in a CI run)."""
    run = guarded
    run.configure(response={"tiers": {"stall_s": 20.0}})
    sc = Scenario(run.guard, say=print, workload="pp")
    job = sc.submit(steps=100000, ckpt_every=0)
    sc.wait_steps(job, BASELINE + HEALTHY, timeout=240)
    nothing_happened(run)
    slow = sc.job_nodes(job)[-1]
    fault.apply_cpu_cap(run.cluster, slow, 1.0)
    t_inject = time.time()
    t_drain = _drained_after(run, sc, slow, t_inject)
    sc.clear(slow)
    assert [e.node for e in run.audit("drain")] == [slow]
    run.cluster.run(["scancel", str(job)])
    print(f"\npp stalled by {slow} at 1% of a CPU: drained {t_drain - t_inject:.1f}s after injection")


def test_node_under_two_guarded_jobs_is_drained_once(guarded):
    """Two DDP jobs share node2 (one task each on it): capping node2 slows
    both, both name it; it is drained once, and no other node is."""
    run = guarded
    a = Scenario(run.guard, say=print, workload="ddp")
    ja = a.submit(steps=100000, ckpt_every=0, exclusive=False, nodes="node1,node2")
    jb = a.submit(steps=100000, ckpt_every=0, exclusive=False, nodes="node2,node3")
    a.wait_steps(ja, BASELINE + HEALTHY, timeout=300)
    a.wait_steps(jb, BASELINE + HEALTHY, timeout=300)
    nothing_happened(run)
    a.inject("node2", SEVERE)
    t_inject = time.time()
    _drained_after(run, a, "node2", t_inject)
    time.sleep(8)  # both jobs' assessments have run several cycles since
    a.clear("node2")
    assert [e.node for e in run.audit("drain")] == ["node2"]
    assert not any(run.node(n)["drained"] for n in ("node1", "node3", "node4"))
    run.cluster.run(["scancel", str(ja), str(jb)])


@pytest.mark.parametrize("workload", ["ddp", "pp"])
def test_moderate_fault_drains_and_signals_without_requeue(guarded, workload):
    """A 1.15-1.3x cap: drained and signalled, not requeued. 5 runs each here
    (load average 0.6-7): ddp drained 9.0-42.6 s after injection, pp 1.4-38.8 s
    (81 s and 115 s before the compute baseline followed the step baseline).
    Session 7 (a DDP rank named from the iterations since the change, load
    average 3-6): ddp 5.2, 3.7, 6.1, 7.5, 86.2 s (5 runs, the last at a 65%
    cap; it was opt-in after one CI run left it unnamed for 150 s), pp 7.4 s
    and once not within 150 s (a stage keeps localise's two windows).
    Session 18: pp not named in 240 s in 2 of 3 runs at 1.41-1.43x (an expected
    failure then). Session 19 (a stage judged by its plain means): pp 15.3,
    198.0, 25.2, 12.8, 16.7, 13.5 s at caps of 49-54% (1.39x where printed); ddp
    6.7 s. Session 20 (stages also compared in seconds, a slight excess since a
    change waits 8 s): pp 43.8, 39.5 s; ddp 34.2 s."""
    run = guarded
    run.configure(
        response={
            "tiers": {"sustained_s": 6.0},
            "escalation": {"drain_checkpoint_gpu_s": 0.5, "requeue_gpu_s": 1000.0},
        }
    )
    sc = Scenario(run.guard, say=print, workload=workload)
    job = sc.submit(steps=100000, signal=True, ckpt_every=0)
    sc.wait_steps(job, BASELINE)
    nodes = sc.job_nodes(job)
    slow = nodes[-1]
    # calibrated on the job's own steps: the cap from CPU use alone slowed a
    # pipeline 1.12x, below the tier (Scenario.inject). A pipeline stage is capped
    # at the tier's top (1.3x): it has no same-role peer, and at 1.19x its compute
    # grew 1.18x while the other stage's grew with it, within the noise of the
    # 10% it must exceed (a full-suite run: nothing named in 150 s; README, #12
    # gaps). A CI run whose calibration stopped at 1.16x (two proportional steps
    # on a flat response) left the stage's extra compute at 47% of the step
    # growth, under the 50% it must explain: the calibration now steps along the
    # measured response (scenario._next_cap). A DDP rank too: a full-suite run
    # calibrated at 1.19x (caps 63%, 80%, 76%) left the capped rank computing
    # within 10% of its peer (gloo's all-reduce on the capped node is throttled
    # as well, and counts as communication on both) for 150 s
    use, cap = sc.inject(slow, MODERATE_TOP, job=job)
    t_inject = sc.capped_at[slow]
    t_drain = _drained_after(run, sc, slow, t_inject, MODERATE_TOP_S)
    print(
        f"\n{workload} moderate: {slow} capped at {cap:.0f}% (used {use:.2f} CPUs); "
        f"drained {t_drain - t_inject:.1f}s after injection"
    )
    wait_for(lambda: run.audit("signal"), 60, "checkpoint signal")
    # the job checkpoints on the signal (ckpt_every=0: no periodic ones)
    wait_for(lambda: any(e["ckpt_s"] > 0 for e in sc.log(job)), 60, "the checkpoint on SIGUSR1")
    time.sleep(5)
    assert run.audit("requeue") == []
    assert run.cluster.job_state(job) == "RUNNING"
    assert sc.job_nodes(job) == nodes  # running work continues on the drained node
    assert [e.node for e in run.audit("drain")] == [slow]
    sc.clear(slow)
    run.cluster.run(["scancel", str(job)])
