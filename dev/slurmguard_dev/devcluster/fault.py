"""Fail-slow faults from outside the job: a CPU cap on one dev-cluster node.

`apply_cpu_cap(cluster, node, percent)` moves the node's slurmd and every
process of its running job steps (each slurmstepd and its descendants) into a
cgroup whose CPU bandwidth is PERCENT of one CPU (cgroup v1
`cpu.cfs_quota_us`/`cpu.cfs_period_us`, v2 `cpu.max`). Steps started later
inherit the cap: slurmd forks their slurmstepd, and a child starts in its
parent's cgroup. The job is not told; its ranks on that node simply get less
CPU, like a node throttled by a thermal or power limit. (A CPU hog does not
slow a job here: with sched autogroup the job's session keeps its share.)

`clear_fault(cluster, node)` moves the processes back to the cgroup slurmd
came from and removes the cgroup; `DevCluster.down()` clears every fault of
its cluster. Several dev clusters with the same node names may run on one
host at once (tests of different areas), so each cgroup is named after the
cluster's state directory: `slurmguard-devcluster/<tag>-<node>`.

Finding a node's processes: slurmd's pid comes from the cluster's state
(checked against /proc); a slurmstepd detaches from slurmd (double fork, its
parent is init), so the steps are found the way Slurm itself finds them: each
slurmstepd listens on `<SlurmdSpoolDir>/<node>_<job>.<step>`, and the socket
inode in /proc/net/unix leads to the process that holds it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from slurmguard_dev.devcluster.cluster import DevCluster, DevClusterError

#: CFS period written with every cap (us); the kernel default.
PERIOD_US = 100_000
#: the smallest quota the kernel accepts (us), i.e. 1% of one CPU at PERIOD_US
MIN_QUOTA_US = 1_000
PARENT = "slurmguard-devcluster"
_FAULTS_FILE = "faults.json"


class FaultError(DevClusterError):
    """A fault could not be applied or cleared (no cgroup cpu controller, node not up...)."""


@dataclass(frozen=True)
class CgroupCpu:
    """Where the cpu controller lives: a v1 hierarchy or a v2 tree with cpu enabled."""

    root: Path
    version: int  # 1 or 2

    def procs_file(self, group: Path) -> Path:
        return group / "cgroup.procs"

    def cap(self, group: Path, percent: float) -> None:
        quota = max(MIN_QUOTA_US, int(round(PERIOD_US * percent / 100.0)))
        if self.version == 1:
            # the period first: a quota is checked against the current period
            _write(group / "cpu.cfs_period_us", str(PERIOD_US))
            _write(group / "cpu.cfs_quota_us", str(quota))
        else:
            _write(group / "cpu.max", f"{quota} {PERIOD_US}")

    def prepare_parent(self) -> Path:
        parent = self.root / PARENT
        if self.version == 2:
            # v2: a controller reaches a child only if every ancestor enables it
            # for its subtree (the parent holds no processes, as v2 requires)
            _enable_cpu(self.root)
            parent.mkdir(exist_ok=True)
            _enable_cpu(parent)
        else:
            parent.mkdir(exist_ok=True)
        return parent

    def group_of(self, pid: int) -> Path | None:
        """The cgroup directory of pid in this hierarchy (None: pid gone)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            hid, controllers, path = line.split(":", 2)
            if self.version == 2 and hid == "0":
                return self.root / path.lstrip("/")
            if self.version == 1 and "cpu" in controllers.split(","):
                return self.root / path.lstrip("/")
        return None


def _enable_cpu(group: Path) -> None:
    ctl = group / "cgroup.subtree_control"
    if "cpu" not in ctl.read_text().split():
        _write(ctl, "+cpu")


def _write(path: Path, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise FaultError(f"cannot write {text!r} to {path}: {exc.strerror or exc}") from exc


def find_cpu_cgroup(mounts: Path = Path("/proc/self/mounts")) -> CgroupCpu:
    """The writable cgroup hierarchy with the cpu controller: v1 if mounted, else v2."""
    v2: list[Path] = []
    try:
        lines = mounts.read_text().splitlines()
    except OSError as exc:
        raise FaultError(f"cannot read {mounts}: {exc}") from exc
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        where, fstype, opts = Path(parts[1].replace("\\040", " ")), parts[2], parts[3].split(",")
        if fstype == "cgroup" and "cpu" in opts and "rw" in opts:
            return CgroupCpu(where, 1)
        if fstype == "cgroup2" and "rw" in opts:
            v2.append(where)
    for where in v2:
        try:
            if "cpu" in (where / "cgroup.controllers").read_text().split():
                return CgroupCpu(where, 2)
        except OSError:
            continue
    raise FaultError(
        "no writable cgroup hierarchy with the cpu controller (cgroup v1 `cpu` or a "
        "cgroup2 mount listing `cpu` in cgroup.controllers); a CPU cap needs one"
    )


def cluster_tag(cluster: DevCluster) -> str:
    """A short name for this cluster, unique per state directory on the host."""
    return hashlib.sha1(str(cluster.state_dir).encode()).hexdigest()[:10]


def group_path(cg: CgroupCpu, cluster: DevCluster, node: str) -> Path:
    return cg.root / PARENT / f"{cluster_tag(cluster)}-{node}"


# ------------------------------------------------------------------ processes
def slurmd_pid(cluster: DevCluster, node: str) -> int:
    """The running slurmd of `node` (from the cluster's state, checked in /proc)."""
    if node not in cluster.node_names:
        raise FaultError(
            f"no node {node!r} in the development cluster in {cluster.state_dir} "
            f"(nodes: {', '.join(cluster.node_names)})"
        )
    pid = cluster.service_pid(f"slurmd:{node}")
    if pid is None:
        raise FaultError(f"slurmd of {node} is not running in {cluster.state_dir}")
    return pid


def _unix_listeners(under: Path) -> dict[int, str]:
    """socket inode -> path, for unix sockets bound below `under`."""
    prefix = str(under).rstrip("/") + "/"
    out: dict[int, str] = {}
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith(prefix):
            out[int(parts[6])] = parts[7]
    return out


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def step_pids(cluster: DevCluster, node: str) -> list[int]:
    """Every slurmstepd of `node` and all its descendants (tasks, their children)."""
    inodes = _unix_listeners(cluster.state_dir / "spool" / node)
    stepds: set[int] = set()
    if inodes:
        wanted = {f"socket:[{i}]" for i in inodes}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if not Path(f"/proc/{entry}/comm").read_text().startswith("slurmstepd"):
                    continue
                fds = os.listdir(f"/proc/{entry}/fd")
                if any(os.readlink(f"/proc/{entry}/fd/{fd}") in wanted for fd in fds):
                    stepds.add(int(entry))
            except OSError:
                continue
    kids = _children_map()
    out: list[int] = []
    todo = sorted(stepds)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def _move(cg: CgroupCpu, group: Path, pids: Iterable[int]) -> int:
    """Move each pid (all its threads) into group; pids that exited meanwhile are skipped."""
    moved = 0
    for pid in pids:
        try:
            with open(cg.procs_file(group), "w") as f:
                f.write(str(pid))
            moved += 1
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise FaultError(f"cannot move pid {pid} into {group}: {exc.strerror}") from exc
    return moved


def _members(cg: CgroupCpu, group: Path) -> list[int]:
    try:
        return [int(x) for x in cg.procs_file(group).read_text().split()]
    except OSError:
        return []


def _cpu_seconds(pid: int) -> float:
    """utime + stime of pid, all its threads (s); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_cpu_use(cluster: DevCluster, node: str, seconds: float = 3.0) -> float:
    """CPUs the node's job steps use right now: CPU time over `seconds` of wall time."""
    pids = step_pids(cluster, node)
    before = {p: _cpu_seconds(p) for p in pids}
    t0 = time.monotonic()
    time.sleep(seconds)
    used = sum(max(0.0, _cpu_seconds(p) - c) for p, c in before.items())
    return used / (time.monotonic() - t0)


def cap_for_slowdown(cpu_use: float, factor: float) -> float:
    """The cap (percent of one CPU) that makes work using `cpu_use` CPUs take
    `factor` times as long: a synchronous job's step on the capped node needs
    the same CPU time at the lower rate, and its peers wait for it."""
    if factor <= 1.0:
        raise FaultError(f"slowdown factor {factor:g}: must be above 1")
    return max(1.0, 100.0 * cpu_use / factor)


# ------------------------------------------------------------------ records
def _load(cluster: DevCluster) -> dict[str, dict]:
    p = cluster.state_dir / _FAULTS_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _save(cluster: DevCluster, faults: dict[str, dict]) -> None:
    tmp = cluster.state_dir / (_FAULTS_FILE + ".tmp")
    tmp.write_text(json.dumps(faults, indent=2))
    tmp.replace(cluster.state_dir / _FAULTS_FILE)


@dataclass
class CpuCap:
    """An applied cap: node, percent of one CPU, the cgroup, where slurmd came from,
    and how many processes were moved."""

    node: str
    percent: float
    cgroup: str
    origin: str
    version: int
    moved: int = 0


def active_faults(cluster: DevCluster) -> dict[str, CpuCap]:
    """The caps recorded for this cluster, by node."""
    return {n: CpuCap(**rec) for n, rec in _load(cluster).items()}


def apply_cpu_cap(cluster: DevCluster, node: str, percent: float, cgroup: CgroupCpu | None = None) -> CpuCap:
    """Cap `node` (its slurmd and all its job-step processes) at `percent` of one CPU.

    percent: 1 .. 100 x the host's CPU count. Re-applying changes the cap in place.
    """
    ncpu = os.cpu_count() or 1
    if not (1.0 <= percent <= 100.0 * ncpu):
        raise FaultError(
            f"--cpu {percent:g}: the cap is a percentage of one CPU, "
            f"from 1 to {100 * ncpu} on this {ncpu}-CPU host"
        )
    cg = cgroup or find_cpu_cgroup()
    daemon = slurmd_pid(cluster, node)
    group = group_path(cg, cluster, node)
    faults = _load(cluster)
    origin = faults.get(node, {}).get("origin")
    if origin is None:
        here = cg.group_of(daemon)
        origin = str(here if here is not None else cg.root)
    cg.prepare_parent()
    group.mkdir(exist_ok=True)
    cg.cap(group, percent)
    # slurmd first, so a step it forks from now on starts inside; then the steps
    # already running, twice, for one that was being forked during the first pass
    moved = _move(cg, group, [daemon])
    for _ in range(2):
        moved += _move(cg, group, [p for p in step_pids(cluster, node) if p not in set(_members(cg, group))])
    cap = CpuCap(
        node=node, percent=float(percent), cgroup=str(group), origin=origin, version=cg.version, moved=moved
    )
    faults[node] = asdict(cap)
    _save(cluster, faults)
    return cap


def clear_fault(
    cluster: DevCluster, node: str, cgroup: CgroupCpu | None = None, timeout_s: float = 5.0
) -> bool:
    """Undo `node`'s cap: processes back to slurmd's original cgroup, cgroup removed.

    Returns False if the node had no fault. Raises FaultError if the cgroup
    cannot be emptied within timeout_s (s).
    """
    faults = _load(cluster)
    rec = faults.get(node)
    cg = cgroup or (CgroupCpu(_root_of(rec), rec["version"]) if rec else find_cpu_cgroup())
    group = Path(rec["cgroup"]) if rec else group_path(cg, cluster, node)
    if rec is None and not group.exists():
        return False
    origin = Path(rec["origin"]) if rec else cg.root
    if not origin.is_dir():
        origin = cg.root
    deadline = time.monotonic() + timeout_s
    while group.exists():
        _move(cg, origin, _members(cg, group))
        try:
            group.rmdir()
        except FileNotFoundError:
            break
        except OSError as exc:
            # EBUSY: a process forked into it while we moved the others
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise FaultError(f"cannot remove {group}: {exc.strerror}") from exc
            time.sleep(0.05)
    faults.pop(node, None)
    _save(cluster, faults)
    _remove_parent_if_empty(cg)
    return rec is not None


def clear_all(cluster: DevCluster) -> list[str]:
    """Clear every fault recorded for this cluster; return the nodes cleared."""
    cleared = []
    for node in list(_load(cluster)):
        if clear_fault(cluster, node):
            cleared.append(node)
    return cleared


def _root_of(rec: dict) -> Path:
    group = Path(rec["cgroup"])
    return group.parent.parent  # <root>/slurmguard-devcluster/<tag>-<node>


def _remove_parent_if_empty(cg: CgroupCpu) -> None:
    parent = cg.root / PARENT
    try:
        parent.rmdir()  # only succeeds once no cluster on this host has a fault
    except OSError:
        pass
