"""The fake follows the real backend's ownership rules (the cluster tests pin the real ones)."""

import pytest

from slurmguard.slurm.errors import NotOurs, SlurmUnavailable, UnknownNode
from slurmguard.slurm.fake import FakeSlurm


def test_fake_ownership_rules_match_real_backend():
    s = FakeSlurm()
    s.admin_drain("node3", "RMA 42")
    with pytest.raises(NotOurs):
        s.resume("node3")
    with pytest.raises(NotOurs):
        s.drain("node3", "ours")
    assert s.drain("node1", "slow") == "slurmguard: slow"
    s.resume("node1")
    assert not s.node("node1").drained
    with pytest.raises(UnknownNode):
        s.node("nope")


def test_fake_jobs_requeue_and_unavailable():
    s = FakeSlurm()
    jid = s.start_job(["node1", "node2"])
    assert s.node("node1").jobs == (jid,) and s.node("node1").state == "ALLOCATED"
    s.requeue(jid)
    assert s.job(jid).state == "PENDING" and s.job(jid).restarts == 1
    assert s.node("node1").idle
    s.available = False
    with pytest.raises(SlurmUnavailable):
        s.nodes()


def test_a_job_in_a_final_state_has_ended():
    """JobInfo.ended: the final states (FINAL_JOB_STATES, shared by the sweep
    scheduler and the controller's incident closing), as squeue spells them."""
    from slurmguard.slurm.models import JobInfo

    def job(state: str) -> JobInfo:
        return JobInfo(job_id=1, name="j", user="u", state=state, partition="p")

    assert job("COMPLETED").ended and job("CANCELLED by 0").ended and job("out_of_memory").ended
    assert not job("RUNNING").ended and not job("PENDING").ended and not job("").ended
    # the state without Slurm's suffix, as the sweep scheduler labels it; blank: none
    assert job("CANCELLED by 0").base_state == "CANCELLED" and job("  ").base_state == ""
    assert not job("  ").ended
