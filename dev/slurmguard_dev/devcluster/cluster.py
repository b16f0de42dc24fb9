"""Start, inspect and stop the development cluster.

Everything lives under one state directory (conf, munge key and socket,
spools, logs, `state.json` with the pids and ports). `down` stops only the
processes recorded there (checked against /proc so a recycled pid is never
hit) plus job processes that carry this cluster's SLURM_CONF.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slurmguard.errors import SlurmguardError
from slurmguard_dev.devcluster.conf import ConfPaths, render_slurm_conf

#: program -> Debian package that provides it
REQUIRED_PROGRAMS = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "slurmstepd": "slurmd",
    "sinfo": "slurm-client",
    "squeue": "slurm-client",
    "scontrol": "slurm-client",
    "sbatch": "slurm-client",
    "srun": "slurm-client",
}

DEFAULT_STATE_DIR = Path(os.environ.get("SLURMGUARD_DEVCLUSTER_DIR", "/var/tmp/slurmguard-devcluster"))

# Slot scripts: slurm.conf always names them; they exec the file a test or the
# demo installs as the target, so prolog/epilog/reboot can change without a
# reconfigure. Without a target they succeed and do nothing.
_SLOT_SCRIPT = """#!/bin/sh
# slurmguard devcluster slot: runs {target} when it exists.
if [ -x "{target}" ]; then exec "{target}" "$@"; fi
exit 0
"""


class DevClusterError(SlurmguardError):
    """The development cluster could not be started, reached or stopped."""


class MissingSoftware(DevClusterError):
    pass


@dataclass
class ClusterSpec:
    """Shape of the development cluster.

    nodes: number of slurmd (named node1..nodeN). cpus_per_node and memory_mb
    are what each slurmd advertises (MB). start_timeout_s bounds `up` (s).
    """

    state_dir: Path = DEFAULT_STATE_DIR
    nodes: int = 4
    partition: str = "debug"
    cluster_name: str = "sgdev"
    cpus_per_node: int = 2
    memory_mb: int = 2000
    start_timeout_s: float = 90.0
    plugstack: str = ""
    restd: bool = False
    """Also enable JWT authentication and run slurmrestd on a loopback port
    (DevCluster.restd_url; the key is DevCluster.jwt_key_path)."""

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]


@dataclass
class _State:
    conf_path: str
    ctld_port: int
    node_ports: dict[str, int]
    pids: dict[str, int] = field(default_factory=dict)
    partition: str = "debug"
    restd_port: int | None = None


def check_software(search_path: str | None = None) -> None:
    """Raise MissingSoftware naming every missing program and its package."""
    missing = {
        prog: pkg
        for prog, pkg in REQUIRED_PROGRAMS.items()
        if shutil.which(prog, path=search_path or _sbin_path()) is None
    }
    if missing:
        pkgs = sorted(set(missing.values()))
        raise MissingSoftware(
            f"cannot start the development cluster: {', '.join(sorted(missing))} not found; "
            f"install with: apt-get install -y {' '.join(pkgs)}"
        )


def _sbin_path() -> str:
    extra = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
    parts = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(parts + [p for p in extra if p not in parts])


def _which(prog: str) -> str:
    path = shutil.which(prog, path=_sbin_path())
    if path is None:
        raise MissingSoftware(f"{prog} not found; install {REQUIRED_PROGRAMS.get(prog, prog)}")
    return path


def secure_dir(path: Path, mode: int = 0o755) -> Path:
    """Create `path` (with `mode`) as this process's own directory, or check that the
    one there is (its mode is left as it is).

    The dev cluster's state directory (/var/tmp) and ring root (/dev/shm) live in
    world-writable directories and are used as root: whoever creates the name first
    would choose where root writes the prolog, the policy and the munge key. So the
    last component must be a real directory (lstat: no symlink) owned by our euid and
    writable by nobody else; anything else is refused, never adopted or removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # private until checked, then opened up to `mode`
        created = True
    except FileExistsError:
        created = False
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise DevClusterError(
            f"{path} exists and is not a directory (a symlink or a file); "
            "refusing to use it: remove it or choose another directory"
        )
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise DevClusterError(
            f"{path} belongs to uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}; it must be ours (uid {os.geteuid()}) "
            "and writable by nobody else: refusing to use it"
        )
    if created:
        os.chmod(path, mode, follow_symlinks=False)
    return path


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


#: first word of the line _spawn writes to a service's log before each start
_START_MARK = "==== devcluster started"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class DevCluster:
    """A running (or startable) development cluster.

    Usable as a context manager: `with DevCluster(ClusterSpec(...)) as c: ...`.
    """

    def __init__(self, spec: ClusterSpec | None = None) -> None:
        self.spec = spec or ClusterSpec()
        # parents resolved (the admin's own links), the last component never followed
        given = Path(self.spec.state_dir)
        self.state_dir = given.parent.resolve() / given.name
        self._state: _State | None = None
        self._children: list[subprocess.Popen] = []

    # ------------------------------------------------------------ paths
    @property
    def conf_path(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def plugstack_path(self) -> Path:
        return self.state_dir / "etc" / "plugstack.conf"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def jwt_key_path(self) -> Path:
        return self.state_dir / "etc" / "jwt_hs256.key"

    @property
    def restd_url(self) -> str | None:
        """http://127.0.0.1:PORT of this cluster's slurmrestd; None without one."""
        st = self._load_state()
        return f"http://127.0.0.1:{st.restd_port}" if st and st.restd_port else None

    @property
    def munge_socket(self) -> Path:
        return self.state_dir / "munge" / "munge.socket.2"

    @property
    def node_names(self) -> list[str]:
        if self._state is not None:
            return list(self._state.node_ports)
        return self.spec.node_names

    @property
    def partition(self) -> str:
        return self._state.partition if self._state is not None else self.spec.partition

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF, for subprocesses that talk to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        env["PATH"] = _sbin_path()
        return env

    def _slot(self, name: str) -> Path:
        return self.state_dir / "slots" / name

    def _slot_target(self, name: str) -> Path:
        return self.state_dir / "slots" / f"{name}.target"

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> DevCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> DevCluster:
        """Start munged, slurmctld and the slurmd; wait until every node is idle."""
        check_software()
        if self.is_running():
            raise DevClusterError(
                f"a development cluster is already running in {self.state_dir}; "
                "run `slurmguard devcluster down` first"
            )
        spec = self.spec
        secure_dir(self.state_dir, 0o755)
        for sub in ("etc", "munge", "run", "log", "ctld-state", "spool", "slots"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        for node in spec.node_names:
            (self.state_dir / "spool" / node).mkdir(exist_ok=True)
        os.chmod(self.state_dir / "munge", 0o700)
        for slot in ("prolog", "epilog", "reboot"):
            self._slot(slot).write_text(_SLOT_SCRIPT.format(target=self._slot_target(slot)))
            os.chmod(self._slot(slot), 0o755)
        if not self.plugstack_path.exists() or spec.plugstack:
            self.plugstack_path.write_text(spec.plugstack)

        ports = _free_ports(2 + spec.nodes)
        node_ports = dict(zip(spec.node_names, ports[2:]))
        if spec.restd and not self.jwt_key_path.exists():
            # slurmctld requires the key readable by SlurmUser only
            fd = os.open(self.jwt_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32).hex().encode())
        self.conf_path.write_text(
            render_slurm_conf(
                cluster_name=spec.cluster_name,
                control_host=socket.gethostname().split(".")[0],
                ctld_port=ports[0],
                node_ports=node_ports,
                partition=spec.partition,
                cpus_per_node=spec.cpus_per_node,
                memory_mb=spec.memory_mb,
                paths=ConfPaths(
                    state_dir=self.state_dir,
                    munge_socket=self.munge_socket,
                    plugstack=self.plugstack_path,
                    prolog=self._slot("prolog"),
                    epilog=self._slot("epilog"),
                    reboot_program=self._slot("reboot"),
                    jwt_key=self.jwt_key_path if spec.restd else None,
                ),
            )
        )
        self._state = _State(
            conf_path=str(self.conf_path),
            ctld_port=ports[0],
            node_ports=node_ports,
            partition=spec.partition,
            restd_port=ports[1] if spec.restd else None,
        )
        deadline = time.monotonic() + spec.start_timeout_s
        try:
            self._start_munge(deadline)
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf_path)])
            self._wait(
                lambda: self._ctld_up(),
                deadline,
                "slurmctld did not answer `scontrol ping`",
                log=self.log_dir / "slurmctld.log",
            )
            for node in spec.node_names:
                self._spawn(f"slurmd:{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)])
            if spec.restd:
                self._start_restd(deadline)
            self.wait_nodes_idle(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.down()
            raise
        return self

    def _start_munge(self, deadline: float) -> None:
        key = self.state_dir / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, stat.S_IRUSR)
        mdir = self.state_dir / "munge"
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={mdir / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={mdir / 'munged.seed'}",
                "--num-threads=2",
            ],
        )
        self._wait(
            lambda: self.munge_socket.exists(),
            deadline,
            "munged did not create its socket",
            log=self.log_dir / "munged.log",
        )

    def _start_restd(self, deadline: float) -> None:
        """slurmrestd on 127.0.0.1 with JWT authentication only.

        slurmrestd refuses to run as root or SlurmUser (both root here); the
        dev cluster is single-user, so that check is disabled for it, as
        Slurm documents (SLURMRESTD_SECURITY=disable_user_check). SLURM_JWT=daemon
        makes slurmrestd talk to slurmctld with auth/jwt (the client's token).
        """
        assert self._state is not None and self._state.restd_port
        self._spawn(
            "slurmrestd",
            [
                _which("slurmrestd"),
                "-f",
                str(self.conf_path),
                "-a",
                "rest_auth/jwt",
                "-s",
                "openapi/v0.0.38",
                f"127.0.0.1:{self._state.restd_port}",
            ],
            env={"SLURMRESTD_SECURITY": "disable_user_check", "SLURM_JWT": "daemon"},
        )
        port = self._state.restd_port

        def listening() -> bool:
            with socket.socket() as sock:
                sock.settimeout(0.5)
                return sock.connect_ex(("127.0.0.1", port)) == 0

        self._wait(listening, deadline, "slurmrestd did not listen", log=self.service_log("slurmrestd"))

    def spawn_service(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
        """Start a slurmguard daemon (name 'sg-...') that `down` stops first; its
        command line must mention this cluster's state directory. Returns its pid."""
        if not name.startswith("sg-"):
            raise ValueError("service names start with 'sg-'")
        if self._load_state() is None:
            raise DevClusterError("the cluster is not up")
        self._spawn(name, argv, env)
        return self._state.pids[name]  # type: ignore[union-attr]

    def service_pid(self, name: str) -> int | None:
        st = self._load_state()
        pid = st.pids.get(name) if st else None
        return pid if pid is not None and self._ours(name, pid) else None

    def service_log(self, name: str) -> Path:
        """The file a service's stdout and stderr are appended to."""
        return self.log_dir / f"{name.replace(':', '-')}.stdout"

    def service_output(self, name: str) -> list[str]:
        """The lines a service wrote since it was last started (its log holds every
        start's)."""
        log = self.service_log(name)
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        starts = [i for i, line in enumerate(lines) if line.startswith(_START_MARK)]
        return lines[starts[-1] + 1 :] if starts else lines

    def service_exit(self, name: str) -> int | None:
        """The exit status of a service this process started and that has ended
        (negative: the signal that ended it); None while it runs or if unknown."""
        pid = self._state.pids.get(name) if self._state else None
        for proc in self._children:
            if proc.pid == pid:
                return proc.poll()
        return None

    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Signal one slurmguard service and wait (bounded) until it is gone."""
        pid = self.service_pid(name)
        if pid is None:
            return
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._ours(name, pid):
            for proc in self._children:
                if proc.pid == pid:
                    proc.poll()
            time.sleep(0.1)

    def _spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        assert self._state is not None
        full_env = self.env
        if env:
            full_env.update(env)
        # the child keeps its own copy of the descriptor; the log is appended to
        # across restarts, so each start is marked (service_output reads from it)
        with open(self.service_log(name), "ab") as out:
            out.write(f"{_START_MARK} {name} {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=full_env,
                close_fds=True,
            )
        self._children.append(proc)
        self._state.pids[name] = proc.pid
        self._save_state()

    def _save_state(self) -> None:
        assert self._state is not None
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self._state), indent=2))
        tmp.replace(self.state_dir / "state.json")

    def _wait(self, pred, deadline: float, what: str, log: Path | None = None) -> None:
        while time.monotonic() < deadline:
            if pred():
                return
            self._check_alive()
            time.sleep(0.2)
        tail = ""
        if log is not None and log.exists():
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise DevClusterError(
            f"{what} within {self.spec.start_timeout_s:g}s" + (f"; last log lines: {tail}" if tail else "")
        )

    def _check_alive(self) -> None:
        assert self._state is not None
        for name, pid in self._state.pids.items():
            if name.startswith("sg-"):
                continue  # slurmguard's own services may be stopped on purpose (tests)
            if not _pid_alive(pid):
                logname = (
                    "slurmctld.log"
                    if name == "slurmctld"
                    else (
                        f"slurmd-{name.split(':', 1)[1]}.log" if name.startswith("slurmd:") else "munged.log"
                    )
                )
                log = self.log_dir / logname
                tail = ""
                if log.exists():
                    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                stdout = self.service_log(name)
                if not tail and stdout.exists():
                    tail = " | ".join(stdout.read_text(errors="replace").strip().splitlines()[-3:])
                raise DevClusterError(f"{name} (pid {pid}) exited during start-up: {tail or 'no log'}")

    def _ctld_up(self) -> bool:
        res = self.run(["scontrol", "ping"], timeout=10)
        return res.returncode == 0 and "UP" in res.stdout

    @classmethod
    def attach(cls, state_dir: Path | str = DEFAULT_STATE_DIR) -> DevCluster:
        """The cluster recorded in state_dir (running or not)."""
        c = cls(ClusterSpec(state_dir=Path(state_dir)))
        path = c.state_dir / "state.json"
        if not path.exists():
            raise DevClusterError(f"no development cluster in {c.state_dir} (no state.json)")
        data = json.loads(path.read_text())
        c._state = _State(**data)
        c.spec.nodes = len(c._state.node_ports)
        c.spec.partition = c._state.partition
        return c

    def _load_state(self) -> _State | None:
        if self._state is None:
            path = self.state_dir / "state.json"
            if path.exists():
                self._state = _State(**json.loads(path.read_text()))
        return self._state

    def _ours(self, name: str, pid: int) -> bool:
        """True if pid still runs the daemon we started (not a recycled pid)."""
        if not _pid_alive(pid):
            return False
        argv = _cmdline(pid)
        if name.startswith("sg-"):
            return str(self.state_dir) in " ".join(argv)
        prog = name.split(":", 1)[0]
        return (
            bool(argv)
            and os.path.basename(argv[0]) == prog
            and (prog == "munged" or str(self.conf_path) in argv)
        )

    def is_running(self) -> bool:
        st = self._load_state()
        return st is not None and any(self._ours(n, p) for n, p in st.pids.items())

    def _adopt_pidfiles(self, st: _State) -> None:
        """slurmd restarted by the dev RebootProgram has a new pid: read it from
        its SlurmdPidFile (checked against /proc like every recorded pid)."""
        for node in st.node_ports:
            name = f"slurmd:{node}"
            try:
                pid = int((self.state_dir / "run" / f"slurmd-{node}.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid != st.pids.get(name) and self._ours(name, pid):
                st.pids[name] = pid

    def down(self, timeout: float = 20.0) -> None:
        """Stop jobs, then the daemons this cluster started, by pid."""
        st = self._load_state()
        if st is None:
            return
        self._adopt_pidfiles(st)
        from slurmguard_dev.devcluster.fault import clear_all

        clear_all(self)  # CPU caps first: a capped slurmd would slow its own shutdown
        if any(self._ours(n, p) for n, p in st.pids.items() if n == "slurmctld"):
            self.run(["scancel", "--partition", self.partition], timeout=10)
        services = [n for n in st.pids if n.startswith("sg-")]
        order = (
            services
            + [n for n in st.pids if n == "slurmrestd"]
            + [n for n in st.pids if n.startswith("slurmd:")]
            + ["slurmctld", "munged"]
        )
        for name in order:
            pid = st.pids.get(name)
            if pid is not None and self._ours(name, pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self._ours(n, p) for n, p in st.pids.items()):
            time.sleep(0.1)
        for name, pid in st.pids.items():
            if self._ours(name, pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._kill_job_processes()
        for proc in self._children:  # reap what this process started
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._children.clear()
        st.pids = {}
        self._save_state()

    def _kill_job_processes(self) -> None:
        """Kill leftover job tasks/stepds: processes whose env names our slurm.conf."""
        marker = f"SLURM_CONF={self.conf_path}".encode()
        me = os.getpid()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                argv = _cmdline(int(entry.name))
                # never kill the test runner or the CLI that set SLURM_CONF for itself
                if argv and ("slurmstepd" in argv[0] or b"SLURM_JOB_ID=" in environ):
                    try:
                        os.kill(int(entry.name), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    # ------------------------------------------------------------ helpers for tests/demo
    def run(
        self, argv: Sequence[str], timeout: float = 30.0, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster (no check, text output)."""
        full = [_which(argv[0]), *argv[1:]]
        try:
            return subprocess.run(
                full,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(full, 124, "", f"timed out after {timeout}s")

    def sbatch(self, script: str, *args: str, timeout: float = 30.0) -> int:
        """Submit a batch script (text); return the job id."""
        res = self.run(["sbatch", "--parsable", *args], timeout=timeout, input=script)
        if res.returncode != 0:
            raise DevClusterError(f"sbatch failed: {res.stderr.strip() or res.stdout.strip()}")
        return int(res.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str | None:
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15)
        if res.returncode != 0:
            return None
        for tok in res.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return None

    def wait_job(
        self,
        job_id: int,
        timeout: float = 120.0,
        states: Iterable[str] = (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "PREEMPTED",
            "BOOT_FAIL",
            "DEADLINE",
        ),
    ) -> str:
        """Wait until job_id reaches one of `states`; return that state."""
        final = set(states)
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in final:
                return state
            time.sleep(0.3)
        raise DevClusterError(f"job {job_id} still {state} after {timeout:g}s")

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
        out: dict[str, str] = {}
        if res.returncode == 0:
            for line in res.stdout.splitlines():
                parts = line.split()
                if len(parts) == 2:
                    out[parts[0]] = parts[1]
        return out

    def wait_nodes_idle(self, timeout: float = 60.0, nodes: Iterable[str] | None = None) -> None:
        want = list(nodes) if nodes is not None else self.node_names
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n, "").lower().rstrip("*") == "idle" for n in want):
                return
            if self._state is not None and self._state.pids:
                self._check_alive()
            time.sleep(0.3)
        raise DevClusterError(f"nodes not idle after {timeout:g}s: {states}")

    def set_plugstack(self, text: str) -> None:
        """Rewrite plugstack.conf; new jobs (and sbatch/srun --help) see it."""
        self.plugstack_path.write_text(text)

    def _set_slot(self, slot: str, target: Path | str | None) -> None:
        link = self._slot_target(slot)
        if link.is_symlink() or link.exists():
            link.unlink()
        if target is not None:
            link.symlink_to(Path(target).resolve())

    def set_prolog(self, path: Path | str | None) -> None:
        self._set_slot("prolog", path)

    def set_epilog(self, path: Path | str | None) -> None:
        self._set_slot("epilog", path)

    def set_reboot_program(self, path: Path | str | None) -> None:
        self._set_slot("reboot", path)

    def reconfigure(self) -> None:
        res = self.run(["scontrol", "reconfigure"], timeout=30)
        if res.returncode != 0:
            raise DevClusterError(f"scontrol reconfigure failed: {res.stderr.strip()}")

    def status(self) -> dict[str, Any]:
        st = self._load_state()
        if st is None:
            return {"state_dir": str(self.state_dir), "running": False}
        return {
            "state_dir": str(self.state_dir),
            "running": self.is_running(),
            "slurm_conf": str(self.conf_path),
            "partition": st.partition,
            "daemons": {n: {"pid": p, "alive": self._ours(n, p)} for n, p in st.pids.items()},
            "nodes": self.node_states() if self.is_running() else {},
        }

    def export_line(self) -> str:
        return f"export SLURM_CONF={self.conf_path}"

    def environment(self) -> Mapping[str, str]:
        return {"SLURM_CONF": str(self.conf_path)}
