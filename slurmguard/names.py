"""Slurm node names: the one rule every part of slurmguard checks a node name against.

A name starts with a letter or digit and goes on with letters, digits, '.', '_' and
'-' (no spaces, brackets or commas, so it is never read as a hostlist or as a second
key=value on a command line), and is at most 63 characters long. 63 is Slurm's own
bound: slurmctld and slurmd keep names in MAX_SLURM_NAME (64-byte, NUL-terminated)
buffers, a node's default NodeHostname is its name and a DNS label is at most 63
characters (RFC 1035), and Linux's HOST_NAME_MAX is 64. A longer name in a ring, a
sweep result or a CLI argument cannot be a node of the cluster. (The database column
is wider, 128, only so that the schema need not change if Slurm ever allows more.)

Standard library only: the prolog and the sweep workloads import it on nodes.
"""

from __future__ import annotations

import re

MAX_NODE_NAME = 63
NODE_NAME_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NODE_NAME - 1}}}$")
NODE_NAME_RULE = f"letters, digits, '.', '_', '-'; at most {MAX_NODE_NAME} characters"


def is_node_name(name: object) -> bool:
    """True if ``name`` is a string Slurm could use as a node name."""
    return isinstance(name, str) and NODE_NAME_RE.match(name) is not None
