"""Parsers for Slurm command output, tolerant across Slurm 22.05 - 25.x.

`sinfo --json`/`squeue --json` changed shape between openapi v0.0.38 (22.05:
plain numbers, `state` string + `state_flags`) and data_parser v0.0.40+ (23.11+:
`{"set":..,"number":..}` numbers, `state` a list). `scontrol show -o` is the
fallback where JSON is not available.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from slurmguard.slurm.hostlist import expand
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo

_BASE_STATES = {
    "IDLE",
    "ALLOCATED",
    "MIXED",
    "DOWN",
    "ERROR",
    "FUTURE",
    "UNKNOWN",
    "COMPLETING",
    "DRAINED",
    "DRAINING",
    "ALLOC",
    "MIX",
}


def _num(v: Any) -> float | None:
    """A JSON number across versions: 5, {"set": true, "number": 5}, {"infinite":..}."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite"):
            return None
        v = v.get("number")
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _text(v: Any) -> str | None:
    if v is None:
        return None
    s = str(v)
    return None if s in ("", "(null)", "N/A", "None") else s


def _list(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return tuple(p for p in v.split(",") if p and p != "(null)")
    return tuple(str(p) for p in v)


def _split_state(tokens: Iterable[str]) -> tuple[str, frozenset[str]]:
    toks = [t.upper().rstrip("*~#!%$@^-") for t in tokens if t]
    base = next((t for t in toks if t in _BASE_STATES), toks[0] if toks else "UNKNOWN")
    base = {"ALLOC": "ALLOCATED", "MIX": "MIXED"}.get(base, base)
    return base, frozenset(t for t in toks if t and t != base)


def nodes_from_json(doc: dict[str, Any]) -> list[NodeInfo]:
    out = []
    for n in doc.get("nodes", []):
        state = n.get("state")
        tokens = list(state) if isinstance(state, list) else str(state or "UNKNOWN").split("+")
        tokens += list(n.get("state_flags") or [])
        base, flags = _split_state(tokens)
        reason_time = _num(n.get("reason_changed_at"))
        out.append(
            NodeInfo(
                name=n["name"],
                state=base,
                flags=flags,
                reason=_text(n.get("reason")),
                reason_user=_text(n.get("reason_set_by_user")),
                reason_time=reason_time or None,
                comment=_text(n.get("comment")),
                partitions=_list(n.get("partitions")),
                features=_list(n.get("active_features") or n.get("features")),
                gres=_text(n.get("gres")),
                cpus=int(_num(n.get("cpus")) or 0),
                boot_time=_num(n.get("boot_time")),
            )
        )
    return out


def jobs_from_json(doc: dict[str, Any]) -> list[JobInfo]:
    out = []
    for j in doc.get("jobs", []):
        state = j.get("job_state")
        state = state[0] if isinstance(state, list) and state else state
        tl = _num(j.get("time_limit"))
        out.append(
            JobInfo(
                job_id=int(_num(j.get("job_id")) or 0),
                name=str(j.get("name") or ""),
                user=str(j.get("user_name") or ""),
                state=str(state or "UNKNOWN").upper(),
                partition=str(j.get("partition") or ""),
                nodes=tuple(expand(_text(j.get("nodes")))),
                num_nodes=int(_num(j.get("node_count")) or 0),
                start_time=_num(j.get("start_time")),
                time_limit_min=int(tl) if tl is not None else None,
                reservation=_text(j.get("resv_name") or j.get("reservation")),
                comment=_text(j.get("comment")),
                restarts=int(_num(j.get("restart_cnt")) or 0),
                batch_host=_text(j.get("batch_host")),
                eligible_time=_num(j.get("eligible_time")),
                resumed_at=_resumed(state, _num(j.get("suspend_time"))),
            )
        )
    return out


def reservations_from_json(doc: dict[str, Any]) -> list[ReservationInfo]:
    """slurmrestd `GET /reservations` (v0.0.38: node_list, flags list, users text)."""
    out = []
    for r in doc.get("reservations", []):
        out.append(
            ReservationInfo(
                name=str(r["name"]),
                nodes=tuple(expand(_text(r.get("node_list")))),
                flags=frozenset(f.upper() for f in _list(r.get("flags"))),
                users=_list(_text(r.get("users")) if isinstance(r.get("users"), str) else r.get("users")),
                start_time=_num(r.get("start_time")),
                end_time=_num(r.get("end_time")),
            )
        )
    return out


# ------------------------------------------------------------------ scontrol -o
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")


def parse_kv_line(line: str, trailing: str | None = None) -> dict[str, str]:
    """Split one `scontrol show ... -o` line into key -> value.

    Values can contain spaces (Comment, Reason, OS), so a value runs until the
    next ` Key=`. `trailing` names a key printed last whose value is free text
    (node lines end with Reason=...): everything after it belongs to it.
    """
    line = line.strip()
    out: dict[str, str] = {}
    cut = re.search(rf"(?:^|\s){trailing}=", line) if trailing else None
    tail = None
    if cut is not None:
        tail = line[cut.end() :]
        line = line[: cut.start()]
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    if tail is not None and trailing:
        out[trailing] = tail.strip()
    return out


def _resumed(state: Any, suspend_time: float | None) -> float | None:
    """Slurm's suspend_time is when the job was last suspended *or resumed*, 0 or
    None when never: for a running job it is the resume."""
    if not suspend_time or str(state or "").upper() != "RUNNING":
        return None
    return suspend_time


def _ts(value: str | None) -> float | None:
    if not value or value in ("None", "Unknown", "N/A", "(null)"):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def nodes_from_scontrol(text: str) -> list[NodeInfo]:
    out = []
    for line in text.splitlines():
        if not line.strip().startswith("NodeName="):
            continue
        kv = parse_kv_line(line, trailing="Reason")
        base, flags = _split_state(kv.get("State", "UNKNOWN").split("+"))
        reason, user, rtime = kv.get("Reason"), None, None
        if reason:
            m = re.match(r"^(.*?)\s*\[([^@\]]+)@([^\]]+)\]$", reason)
            if m:
                reason, user, rtime = m.group(1), m.group(2), _ts(m.group(3))
        out.append(
            NodeInfo(
                name=kv["NodeName"],
                state=base,
                flags=flags,
                reason=_text(reason),
                reason_user=user,
                reason_time=rtime,
                comment=_text(kv.get("Comment")),
                partitions=_list(kv.get("Partitions")),
                features=_list(kv.get("ActiveFeatures") or kv.get("AvailableFeatures")),
                gres=_text(kv.get("Gres")),
                cpus=int(kv.get("CPUTot", "0") or 0),
                boot_time=_ts(kv.get("BootTime")),
            )
        )
    return out


def jobs_from_scontrol(text: str) -> list[JobInfo]:
    out = []
    for line in text.splitlines():
        if not line.strip().startswith("JobId="):
            continue
        kv = parse_kv_line(line)
        user = kv.get("UserId", "").split("(")[0]
        tl = kv.get("TimeLimit")
        out.append(
            JobInfo(
                job_id=int(kv["JobId"]),
                name=kv.get("JobName", ""),
                user=user,
                state=kv.get("JobState", "UNKNOWN").upper(),
                partition=kv.get("Partition", ""),
                nodes=tuple(expand(_text(kv.get("NodeList")))),
                num_nodes=int(kv.get("NumNodes", "0").split("-")[0] or 0),
                start_time=_ts(kv.get("StartTime")),
                time_limit_min=_minutes(tl),
                reservation=_text(kv.get("Reservation")),
                comment=_text(kv.get("Comment")),
                restarts=int(kv.get("Restarts", "0") or 0),
                batch_host=_text(kv.get("BatchHost")),
                eligible_time=_ts(kv.get("EligibleTime")),
                resumed_at=_resumed(kv.get("JobState"), _ts(kv.get("SuspendTime"))),
            )
        )
    return out


def _minutes(tl: str | None) -> int | None:
    """Slurm time limit 'D-HH:MM:SS' / 'HH:MM:SS' / 'MM:SS' / 'UNLIMITED' -> minutes."""
    if not tl or tl in ("UNLIMITED", "Partition_Limit", "NONE"):
        return None
    days = 0
    if "-" in tl:
        d, tl = tl.split("-", 1)
        days = int(d)
    parts = [int(p) for p in tl.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return days * 1440 + h * 60 + m + (1 if s else 0)


def reservations_from_scontrol(text: str) -> list[ReservationInfo]:
    out = []
    for line in text.splitlines():
        if not line.strip().startswith("ReservationName="):
            continue
        kv = parse_kv_line(line)
        out.append(
            ReservationInfo(
                name=kv["ReservationName"],
                nodes=tuple(expand(_text(kv.get("Nodes")))),
                flags=frozenset(_list(kv.get("Flags"))),
                users=_list(_text(kv.get("Users"))),
                start_time=_ts(kv.get("StartTime")),
                end_time=_ts(kv.get("EndTime")),
            )
        )
    return out


def parse_version(text: str) -> tuple[int, int, int]:
    """'slurm 22.05.8' / 'slurm-wlm 23.11.4' -> (22, 5, 8)."""
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a Slurm version from {text.strip()!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))
