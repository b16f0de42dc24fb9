"""Job layout: which node and GPU each rank runs on (detect.records).

(The Mycroft, cross-group and old-findings localisers that lived beside it were
reached only by tests and are gone: localisation is controller.assess.localise,
emitting typed findings, issue 14.2.)"""

from __future__ import annotations

import pytest

from slurmguard.detect.records import JobLayout, parse_tasks_per_node
from slurmguard.errors import InputError
from slurmguard.slurm.hostlist import expand as expand_hostlist


def test_layout_from_slurm_and_headers():
    assert expand_hostlist("gpu[01-03,10],login1") == ["gpu01", "gpu02", "gpu03", "gpu10", "login1"]
    assert parse_tasks_per_node("4(x2),2") == [4, 4, 2]
    lay = JobLayout.from_slurm("77", "gpu[1-3]", "4(x2),2")
    assert lay.node_of(5) == "gpu2" and lay.gpu_of(5) == 1 and lay.node_of(9) == "gpu3"
    cyc = JobLayout.from_slurm("77", "a,b", "2(x2)", distribution="cyclic")
    assert [cyc.node_of(r) for r in range(4)] == ["a", "b", "a", "b"]
    hdr = JobLayout.from_headers("78", [(0, "n1", 0), (1, "n1", 1), (2, "n2", 0)])
    assert hdr.ranks_on("n1") == [0, 1]
    with pytest.raises(InputError, match="describes 3 nodes"):
        JobLayout.from_slurm("77", "gpu[1-2]", "4(x3)")
    with pytest.raises(InputError, match="unbalanced"):
        expand_hostlist("gpu[1-3")
    with pytest.raises(InputError, match="job 77: rank 19 is not in the job layout"):
        lay.node_of(19)
