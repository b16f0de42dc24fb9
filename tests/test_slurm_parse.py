"""Parsers and validation, on recorded command output (no cluster needed)."""

import re

import pytest

from slurmguard.slurm import hostlist, parse, validate
from slurmguard.slurm.errors import InvalidArgument

SCONTROL_NODE = (
    "NodeName=gpu-a01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUTot=2 "
    "AvailableFeatures=h100,ib ActiveFeatures=h100,ib Gres=gpu:8 NodeAddr=10.0.0.1 "
    "OS=Linux 6.1.0 #1 SMP  RealMemory=2000 State=IDLE+DRAIN Partitions=gpu,debug  "
    "BootTime=2026-11-22T15:33:12 Comment=slurmguard: pending verification: gpu3 temp +12C "
    "Reason=slurmguard: step +23% since 14:02, gpu3 sm_clock 1.38GHz vs peers 1.93GHz "
    "[root@2026-11-22T15:40:29]"
)


def test_scontrol_node_line_keeps_spaces_in_comment_and_reason():
    (n,) = parse.nodes_from_scontrol(SCONTROL_NODE)
    assert n.name == "gpu-a01"
    assert n.state == "IDLE" and n.flags == {"DRAIN"}
    assert n.comment == "slurmguard: pending verification: gpu3 temp +12C"
    assert n.reason == "slurmguard: step +23% since 14:02, gpu3 sm_clock 1.38GHz vs peers 1.93GHz"
    assert n.reason_user == "root" and n.reason_time is not None
    assert n.partitions == ("gpu", "debug") and n.features == ("h100", "ib")
    assert n.drained_by_us and not n.drained_by_others


def test_json_shapes_of_old_and_new_slurm():
    old = {
        "nodes": [
            {
                "name": "n1",
                "state": "idle",
                "state_flags": ["DRAIN"],
                "reason": "bad fan",
                "partitions": ["p"],
                "cpus": 4,
                "reason_changed_at": 1700000000,
            }
        ]
    }
    new = {
        "nodes": [
            {
                "name": "n1",
                "state": ["IDLE", "DRAIN"],
                "reason": "bad fan",
                "partitions": ["p"],
                "cpus": 4,
                "reason_changed_at": {"set": True, "infinite": False, "number": 1700000000},
            }
        ]
    }
    a, b = parse.nodes_from_json(old)[0], parse.nodes_from_json(new)[0]
    assert a == b
    assert a.drained_by_others and a.reason_time == 1700000000


def test_job_json_new_shape_and_time_limit():
    doc = {
        "jobs": [
            {
                "job_id": 7,
                "name": "train",
                "user_name": "alice",
                "job_state": ["RUNNING"],
                "partition": "gpu",
                "nodes": "gpu-a[01-03]",
                "node_count": {"set": True, "number": 3},
                "time_limit": {"set": True, "infinite": False, "number": 60},
            }
        ]
    }
    (j,) = parse.jobs_from_json(doc)
    assert j.nodes == ("gpu-a01", "gpu-a02", "gpu-a03") and j.state == "RUNNING"
    assert j.time_limit_min == 60 and j.num_nodes == 3


def test_a_resumed_job_says_when_it_was_resumed():
    """Slurm's suspend_time (SuspendTime) is the last suspend *or* resume, 0/None
    when never (as recorded from Slurm 22.05's squeue --json and scontrol show
    job -o after `scontrol suspend` then `scontrol resume`)."""

    def one(state, suspend_time):
        doc = {"jobs": [{"job_id": 8, "job_state": [state], "nodes": "n1", "suspend_time": suspend_time}]}
        return parse.jobs_from_json(doc)[0].resumed_at

    assert one("RUNNING", 1795881631) == 1795881631
    assert one("RUNNING", {"set": True, "number": 1795881631}) == 1795881631
    assert one("SUSPENDED", 1795881628) is None
    assert one("RUNNING", 0) is None and one("RUNNING", None) is None
    line = "JobId=8 JobName=wrap UserId=root(0) JobState={} NodeList=node1 SuspendTime={} SecsPreSuspend=2"
    (resumed,) = parse.jobs_from_scontrol(line.format("RUNNING", "2026-11-28T16:00:31"))
    (never,) = parse.jobs_from_scontrol(line.format("RUNNING", "None"))
    (stopped,) = parse.jobs_from_scontrol(line.format("SUSPENDED", "2026-11-28T16:00:28"))
    assert resumed.resumed_at is not None and never.resumed_at is None and stopped.resumed_at is None


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu-a[01-02,10],login", ["gpu-a01", "gpu-a02", "gpu-a10", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("", []),
        ("(null)", []),
    ],
)
def test_hostlist_expand(expr, expected):
    assert hostlist.expand(expr) == expected


def test_hostlist_rejects_garbage():
    with pytest.raises(ValueError, match="unbalanced"):
        hostlist.expand("node[1-3")


@pytest.mark.parametrize(
    "expr,why",
    [
        ("node[1-3", "unbalanced '\\['"),
        ("node1]", "unbalanced '\\]'"),
        ("gpu[3-1]", "descending range '3-1'"),
        ("gpu[a-b]", "bad range 'a-b'"),
    ],
)
def test_hostlist_errors_are_user_errors_naming_the_expression(expr, why):
    from slurmguard.errors import InputError

    with pytest.raises(InputError, match=f"{why} in hostlist '{re.escape(expr)}'"):
        hostlist.expand(expr)


def test_time_limit_minutes():
    assert parse._minutes("1-02:03:00") == 1440 + 123
    assert parse._minutes("00:30:00") == 30
    assert parse._minutes("UNLIMITED") is None


@pytest.mark.parametrize("bad", ["", "node1 node2", "node1,node2", "n[1-2]", "-x", "a;b", "a" * 80])
def test_node_name_validation(bad):
    with pytest.raises(InvalidArgument):
        validate.node_name(bad)


def test_reason_is_prefixed_once_and_checked():
    assert validate.reason("bad gpu") == "slurmguard: bad gpu"
    assert validate.reason("slurmguard: bad gpu") == "slurmguard: bad gpu"
    for bad in ["", "   ", "slurmguard:", "two\nlines", "x" * 300]:
        with pytest.raises(InvalidArgument):
            validate.reason(bad)
