"""Validation of values before they reach a Slurm command line.

shell=False already prevents shell injection; these checks keep scontrol's own
key=value parser from seeing a second assignment or a hostlist where we mean
one node, and keep reasons readable in `sinfo -R`.
"""

from __future__ import annotations

import re

from slurmguard import REASON_PREFIX
from slurmguard.names import NODE_NAME_RULE, is_node_name
from slurmguard.slurm.errors import InvalidArgument

_RESV = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z0-9]{1,10}$|^\d{1,2}$")
MAX_REASON = 240


def node_name(name: str) -> str:
    if not is_node_name(name):
        raise InvalidArgument(f"invalid node name {name!r}: {NODE_NAME_RULE}")
    return name


def reservation_name(name: str) -> str:
    if not isinstance(name, str) or not _RESV.match(name):
        raise InvalidArgument(f"invalid reservation name {name!r}")
    return name


def job_id(value: int | str) -> int:
    try:
        jid = int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"invalid job id {value!r}") from None
    if jid <= 0:
        raise InvalidArgument(f"invalid job id {value!r}")
    return jid


def signal_name(sig: str) -> str:
    if not isinstance(sig, str) or not _SIGNAL.match(sig):
        raise InvalidArgument(f"invalid signal {sig!r}")
    return sig


def reason(text: str) -> str:
    """Return the reason with the slurmguard prefix; reject unsafe text."""
    if not isinstance(text, str):
        raise InvalidArgument("a reason must be text")
    body = text.strip()
    if body.startswith(REASON_PREFIX):
        body = body[len(REASON_PREFIX) :].strip()
    if not body:
        raise InvalidArgument("a reason must say why")
    if any(ord(c) < 32 or ord(c) == 127 for c in body):
        raise InvalidArgument(f"reason contains control characters: {text!r}")
    full = f"{REASON_PREFIX} {body}"
    if len(full) > MAX_REASON:
        raise InvalidArgument(f"reason longer than {MAX_REASON} characters: {full[:60]}...")
    return full
