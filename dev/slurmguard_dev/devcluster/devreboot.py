"""RebootProgram of the development cluster: "reboot" one node by restarting its slurmd.

All slurmd of the development cluster share one host, so a real reboot is impossible (and
would take everyone's cluster down). Slurm 22.05 decides a reboot has completed when the
node registers with a boot time newer than the request; the host's boot time never
changes, so without help the request stays REBOOT_ISSUED until ResumeTimeout, after which
slurmctld returns the still-answering node to service with its old boot time (observed:
`node_did_resp: node nodeN returned to service`, ~150 s with ResumeTimeout=120). The
triage ladder treats that honestly as a failed reboot rung.

This program makes the reboot real at the level Slurm can see: slurmd runs it (with no
arguments, through system()) on REQUEST_REBOOT; it finds its slurmd ancestor, detaches,
stops that slurmd and starts it again with `-b` ("report node reboot now"), so the node
registers with a new boot time and Slurm completes the reboot (clearing REBOOT_ISSUED,
applying nextstate). The restarted slurmd is recorded in the cluster's state.json (and
`adopt_restarted` updates a live DevCluster object) so `down` stops it.

Never install this on a real cluster: `install(cluster)` only accepts a DevCluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        text = fh.read()
    return int(text[text.rindex(")") + 2 :].split()[1])


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]


def find_slurmd(start: int) -> tuple[int, list[str]] | None:
    """The nearest slurmd ancestor of `start` and its command line."""
    pid = start
    for _ in range(16):
        try:
            pid = _ppid(pid)
            argv = _argv(pid)
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
        if argv and os.path.basename(argv[0]) == "slurmd":
            return pid, argv
    return None


def _opt(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def restart(pid: int, argv: list[str], log: Any, wait_s: float = 30.0) -> int:
    """Stop slurmd `pid`, start it again with -b; returns the new pid."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    new = [argv[0], "-b", *[a for a in argv[1:] if a != "-b"]]
    proc = subprocess.Popen(
        new, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
    )
    return proc.pid


def record(state_dir: Path, node: str, pid: int) -> None:
    """Put the new slurmd pid where the DevCluster looks for its daemons."""
    path = state_dir / "state.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    data.setdefault("pids", {})[f"slurmd:{node}"] = pid
    tmp = state_dir / f"state.json.devreboot.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def main() -> int:
    found = find_slurmd(os.getpid())
    if found is None:
        print("devreboot: no slurmd ancestor; not run by slurmd", file=sys.stderr)
        return 1
    pid, argv = found
    node, conf = _opt(argv, "-N"), _opt(argv, "-f")
    if not node or not conf:
        print(f"devreboot: slurmd {pid} has no -N/-f ({argv})", file=sys.stderr)
        return 1
    state_dir = Path(conf).resolve().parent.parent
    # slurmd waits for this program (system()); it must return before slurmd can stop
    if os.fork() != 0:
        return 0
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    with open(state_dir / "log" / "devreboot.log", "a") as log:
        print(f"{time.strftime('%FT%T')} reboot {node}: restarting slurmd {pid}", file=log, flush=True)
        new = restart(pid, argv, log)
        record(state_dir, node, new)
        print(f"{time.strftime('%FT%T')} reboot {node}: slurmd {new} started with -b", file=log, flush=True)
    os._exit(0)


def install(cluster: Any) -> Path:
    """Make this the RebootProgram of a DevCluster; returns the wrapper's path."""
    from slurmguard_dev.devcluster import DevCluster

    if not isinstance(cluster, DevCluster):
        raise TypeError("devreboot is for the development cluster only")
    d = Path(cluster.state_dir) / "devreboot"
    d.mkdir(exist_ok=True)
    path = d / "reboot.sh"
    path.write_text(
        f"#!/bin/sh\n# slurmguard devcluster reboot: restart this node's slurmd\n"
        f"exec {sys.executable} -m slurmguard_dev.devcluster.devreboot\n"
    )
    path.chmod(0o755)
    cluster.set_reboot_program(path)
    return path


def adopt_restarted(cluster: Any) -> dict[str, int]:
    """Copy slurmd pids rewritten by reboots from state.json into a live DevCluster object,
    so its `down` stops the restarted daemons. Returns the adopted node -> pid."""
    path = Path(cluster.state_dir) / "state.json"
    try:
        pids = json.loads(path.read_text()).get("pids", {})
    except (OSError, ValueError):
        return {}
    st = getattr(cluster, "_state", None)
    if st is None:
        return {}
    out = {}
    for name, pid in pids.items():
        if name.startswith("slurmd:") and st.pids.get(name) != pid:
            st.pids[name] = pid
            out[name.split(":", 1)[1]] = pid
    return out


if __name__ == "__main__":
    sys.exit(main())
