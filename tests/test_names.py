"""One node-name rule (slurmguard/names.py): every entry point accepts and refuses the same names."""

from __future__ import annotations

import pytest

from slurmguard.errors import SlurmguardError
from slurmguard.names import MAX_NODE_NAME, is_node_name
from slurmguard.slurm import validate
from slurmguard.wire import NODE_NAME
from slurmguard_dev.sweepfaults import parse_faults

LONGEST = "n" * MAX_NODE_NAME
GOOD = ["gpu001", "a", "gpu-a01.rack_3", LONGEST]
BAD = ["n" * (MAX_NODE_NAME + 1), "", "-gpu1", "gpu[1-2]", "gpu1,gpu2", "gpu 1", "gpu1=x", "gpü1"]


def test_slurms_limit_is_63_characters():
    assert MAX_NODE_NAME == 63


@pytest.mark.parametrize("name", GOOD)
def test_good_names_pass_everywhere(name, sqlite_store):
    assert is_node_name(name) and NODE_NAME.match(name)
    assert validate.node_name(name) == name
    assert sqlite_store.get_or_create_node(name).name == name
    assert set(parse_faults({name: {}}, "faults.json")) == {name}


@pytest.mark.parametrize("name", BAD)
def test_bad_names_fail_everywhere(name, sqlite_store):
    assert not is_node_name(name) and not NODE_NAME.match(name)
    with pytest.raises(SlurmguardError, match="invalid node name"):
        validate.node_name(name)
    with pytest.raises(SlurmguardError, match="invalid node name"):
        sqlite_store.get_or_create_node(name)
    with pytest.raises(SlurmguardError, match="invalid node name"):
        parse_faults({name: {}}, "faults.json")
