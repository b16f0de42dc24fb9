"""Slurm hostlist expressions (node[1-3,7],gpu-a[01-02]) without calling scontrol.

The one hostlist parser of slurmguard (Slurm's output, SLURM_JOB_NODELIST, slurm.conf
NodeName lines, --node options). Zero padding follows the range's lower bound, as
`scontrol show hostnames` does: gpu[01-10] -> gpu01..gpu10, gpu[1-10] -> gpu1..gpu10.
"""

from __future__ import annotations

import re

from slurmguard.errors import InputError


class HostlistError(InputError, ValueError):
    """A malformed hostlist; the message quotes the expression. A ValueError too, for
    callers that treat any unparsable value alike."""


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(expr: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist '{expr}'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist '{expr}'")
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_one(item: str, expr: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out: list[str] = []
    for rng in m.group(1).split(","):
        r = _RANGE.match(rng.strip())
        if r is None:
            raise HostlistError(f"bad range '{rng}' in hostlist '{expr}'")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        width = len(lo) if lo.startswith("0") else 0
        if int(hi) < int(lo):
            raise HostlistError(f"descending range '{rng}' in hostlist '{expr}'")
        for i in range(int(lo), int(hi) + 1):
            out.extend(_expand_one(f"{head}{str(i).zfill(width)}{tail}", expr))
    return out


def expand(expr: str | None) -> list[str]:
    """node[1-3],x -> ['node1', 'node2', 'node3', 'x']; '' / None / '(null)' -> [].

    Raises HostlistError for unbalanced brackets and bad or descending ranges.
    """
    if not expr or expr in ("(null)", "None", "N/A"):
        return []
    names: list[str] = []
    for item in _split_top(expr.strip()):
        names.extend(_expand_one(item.strip(), expr))
    return names
