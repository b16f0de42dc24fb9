"""The online loop on the real local cluster: guarded DDP jobs, agents, controller.

Each test runs a 2-node torch (gloo) job submitted with --straggler-guard,
injects a fail-slow on one node's rank (and, where relevant, the matching sim
telemetry fault) and checks what slurmguard did in Slurm and in its audit log.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.fixtures.guard import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BASELINE_ITERS = 60  # warm-up + baseline window of the agents, with margin


def start(run, iters: int) -> tuple[int, str, str]:
    """Submit an unpinned guarded job; return (job, healthy node, node to slow)."""
    job = run.submit(iters=iters)
    run.wait_iters(job, BASELINE_ITERS)
    first, second = sorted(job_nodes(run, job))
    return job, first, second


def job_nodes(run, job: int) -> set[str]:
    out = run.cluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
    for tok in out.split():
        if tok.startswith("NodeList="):
            from slurmguard.slurm.hostlist import expand

            return set(expand(tok.split("=", 1)[1]))
    return set()


def test_severe_slowdown_drains_only_that_node_and_requeues(guarded):
    run = guarded
    job, ok, slow = start(run, 450)
    t_inject = time.time()
    run.guard.inject(slow, 1.4)
    run.guard.set_sim_profiles({slow: "thermal_throttle"})
    wait_for(lambda: run.node(slow)["drained"], 60, f"{slow} drained")
    t_drain = time.time()
    assert run.node(slow)["reason"].startswith("slurmguard: step +")
    wait_for(lambda: run.audit("requeue"), 60, "requeue")
    assert [e.node for e in run.audit("drain")] == [slow]
    assert not any(run.node(n)["drained"] for n in run.cluster.node_names if n != slow)
    # the job restarts elsewhere and completes there
    assert run.cluster.wait_job(job, timeout=180) == "COMPLETED"
    assert slow not in job_nodes(run, job)
    assert (run.cluster.state_dir / f"ckpt-{job}" / "done").exists()
    print(f"\ndetection delay: injection -> drain {t_drain - t_inject:.1f}s")


def test_moderate_slowdown_drains_without_requeue_job_keeps_running(guarded):
    run = guarded
    run.configure(
        response={
            "tiers": {"sustained_s": 6.0},
            "escalation": {"drain_checkpoint_gpu_s": 0.5, "requeue_gpu_s": 1000.0},
        }
    )
    job, ok, slow = start(run, 450)
    run.guard.inject(slow, 1.13)
    wait_for(lambda: run.node(slow)["drained"], 90, f"{slow} drained")
    wait_for(lambda: run.audit("signal"), 30, "checkpoint signal")
    time.sleep(6)
    assert run.audit("requeue") == []
    state = run.cluster.job_state(job)
    assert state == "RUNNING", state
    assert job_nodes(run, job) == {ok, slow}  # running work continues on the drained node
    run.guard.inject(slow, None)
    assert run.cluster.wait_job(job, timeout=180) == "COMPLETED"
    assert run.audit("requeue") == []


def test_telemetry_fault_without_step_impact_only_comments(guarded):
    run = guarded
    job, ok, slow = start(run, 350)
    run.guard.set_sim_profiles({slow: "thermal_throttle"})
    wait_for(
        lambda: (run.node(slow)["comment"] or "").startswith("slurmguard: pending verification"),
        60,
        "pending-verification comment",
    )
    assert not run.node(slow)["drained"]
    assert run.audit("drain") == [] and run.audit("requeue") == []
    assert run.cluster.wait_job(job, timeout=120) == "COMPLETED"


def test_healthy_guarded_job_end_to_end_touches_nothing(guarded):
    run = guarded
    job = run.submit(iters=250)
    assert run.cluster.wait_job(job, timeout=120) == "COMPLETED"
    time.sleep(3)
    assert [e.action for e in run.audit()] == []
    for n in run.cluster.node_names:
        info = run.node(n)
        assert not info["drained"] and not info["comment"]
    with run.store() as s:
        # a job slowed by the other work on this shared machine (every rank
        # alike) may be recorded, at tier none, as a slowdown no node is to
        # blame for; nothing is done about it
        for inc in s.incidents():
            assert str(inc.tier.value) == "none" and not inc.evidence.get("culprits"), inc
            assert inc.evidence.get("localisation") or inc.evidence.get("note"), inc


def test_admin_drained_node_is_never_resumed_or_re_reasoned(guarded):
    run = guarded
    job, ok, slow = start(run, 400)
    run.cluster.run(["scontrol", "update", f"NodeName={slow}", "State=DRAIN", "Reason=admin: RMA 1234"])
    run.guard.inject(slow, 1.4)
    time.sleep(25)
    assert run.node(slow)["reason"] == "admin: RMA 1234"
    assert run.audit("drain") == [] and run.audit("resume") == [] and run.audit("requeue") == []
    run.cluster.run(["scancel", str(job)])


def test_breaker_at_one_node_holds_second_drain_and_alerts(guarded):
    run = guarded
    run.configure(safety={"breaker": {"max_nodes": 1, "max_partition_percent": 100.0}})
    j1, _, slow1 = start(run, 500)
    j2, _, slow2 = start(run, 500)
    run.guard.inject(slow1, 1.4)
    run.guard.inject(slow2, 1.4)
    wait_for(lambda: run.audit("alert"), 90, "breaker alert")
    drained = {e.node for e in run.audit("drain")}
    assert len(drained) == 1 and drained <= {slow1, slow2}
    other = ({slow1, slow2} - drained).pop()
    time.sleep(5)
    assert not run.node(other)["drained"]
    (alert, *_) = run.audit("alert")
    assert alert.reason.startswith("circuit breaker") and alert.node == other
    import urllib.request

    metrics = urllib.request.urlopen(run.guard.controller_url + "/metrics", timeout=5).read().decode()
    assert "slurmguard_breaker_open 1.0" in metrics


def test_controller_sigkilled_mid_incident_takes_no_duplicate_action(guarded):
    run = guarded
    # drain early, requeue only after the slowdown has cost more: a window to kill in
    run.configure(response={"escalation": {"drain_checkpoint_gpu_s": 0.5, "requeue_gpu_s": 6.0}})
    job, ok, slow = start(run, 600)
    run.guard.inject(slow, 1.4)
    wait_for(lambda: run.audit("drain"), 60, "drain")
    assert run.audit("requeue") == []
    run.cluster.stop_service("sg-controller", signal.SIGKILL)
    assert run.cluster.service_pid("sg-controller") is None
    run.guard.start_controller()
    wait_for(lambda: run.audit("requeue"), 90, "requeue after restart")
    time.sleep(6)
    assert len(run.audit("drain")) == 1
    assert len(run.audit("signal")) == 1
    assert len(run.audit("requeue")) == 1
    assert run.cluster.wait_job(job, timeout=180) == "COMPLETED"
