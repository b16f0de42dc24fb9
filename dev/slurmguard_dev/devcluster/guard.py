"""`devcluster up --guard`: the development cluster with slurmguard watching it.

Adds to a running DevCluster: the SPANK plugin in plugstack.conf (so
`--straggler-guard` works), the prolog/epilog when present, a master secret
and each node's report key derived from it (keys/<node>.key),
a policy file for this cluster (SQLite database in the state directory,
private ring root, demo-friendly windows unless overridden), the controller
and one agent per node (sim telemetry by default). Everything is started as
a cluster service, so `devcluster down` stops it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from slurmguard import datafiles
from slurmguard_dev.devcluster.cluster import DevCluster, DevClusterError, _free_ports, secure_dir

REPO = datafiles.checkout_root()
BUILD = REPO / "spank_plugin" / "build"

#: Windows and prices for a cluster where a job has 2 ranks and iterations of
#: a fraction of a second; production defaults assume thousands of GPUs.
GUARD_DEFAULTS: dict[str, Any] = {
    "response": {
        "tiers": {"sustained_s": 10.0, "stall_s": 60.0},
        "escalation": {"drain_checkpoint_gpu_s": 0.3, "requeue_gpu_s": 0.6},
    },
    "safety": {"breaker": {"max_nodes": 2, "max_partition_percent": 50.0}},
    "agent": {"sample_interval_s": 1.0, "report_interval_s": 1.0, "warmup_steps": 5, "baseline_steps": 20},
    "controller": {"cycle_interval_s": 1.0, "report_stale_s": 30.0},
    "detection": {"peers": {"window_s": 3.0, "consecutive_windows": 2}},
    # CPU sweeps of a few seconds (the workloads have the same code path on GPUs)
    "sweeps": {
        "device": "cpu",
        "gemm_duration_s": 1.0,
        "gemm_dtypes": ["float32"],
        "gemm_size": 256,
        "membw_bytes": 16 << 20,
        "message_sizes_mb": [1, 2],
        "repeats": 2,
        "time_limit_min": 5,
        "bootstrap_min_nodes": 1,
        "quarantine_reservation_min": 60,
        "master_addr": "127.0.0.1",
        # timing on a shared 2-core machine varies 2-3x: only gross faults count
        "pass_tolerance": 0.85,
    },
}


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def build_plugin() -> Path:
    """Build the SPANK plugin and hooks if needed; return the build directory."""
    if not (BUILD / "slurmguard_spank.so").exists() or not (BUILD / "libslurmguard_nccl.so").exists():
        src = datafiles.checkout_path("spank_plugin", "Makefile", what="building the SPANK plugin").parent
        res = subprocess.run(["make", "-s", "-C", str(src)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise DevClusterError(f"building spank_plugin failed: {res.stderr.strip()[-400:]}")
    return BUILD


class Guard:
    """The slurmguard services of one development cluster."""

    def __init__(
        self,
        cluster: DevCluster,
        *,
        overrides: Mapping[str, Any] | None = None,
        sim_profiles: Mapping[str, Any] | None = None,
        telemetry: str = "sim",
        database_url: str | None = None,
        controllers: int = 1,
        controller_database_urls: Sequence[str] | None = None,
    ) -> None:
        """database_url: the store (None: SQLite in the state directory);
        controllers: controller daemons to run (more than one: a PostgreSQL
        database_url; one holds the lease and acts, the others stand by and every
        agent reports to each); controller_database_urls: the URL each controller
        uses instead (its $SLURMGUARD_DB), one per controller: the same database
        reached another way (a relay a test can cut)."""
        if controllers > 1 and not (database_url or "").startswith("postgresql"):
            raise DevClusterError("several controllers need a PostgreSQL database_url")
        self.cluster = cluster
        self.database_url = database_url
        self.controllers = controllers
        if controller_database_urls is not None and len(controller_database_urls) != controllers:
            raise DevClusterError(f"controller_database_urls: one URL per controller ({controllers})")
        self.controller_database_urls = list(controller_database_urls or ())
        self.state = cluster.state_dir
        self.overrides = overrides or {}
        self.telemetry = telemetry
        self.sim_profiles_path = self.state / "sim_profiles.json"
        self.secret_path = self.state / "secret"
        self.keys_dir = self.state / "keys"
        self.policy_path = self.state / "policies.yaml"
        self.db_path = self.state / "slurmguard.db"
        # a private ring root: several dev clusters can share this host
        digest = hashlib.sha1(str(self.state).encode()).hexdigest()[:10]
        self.ring_root = f"/dev/shm/slurmguard-{digest}"
        self.port = 0
        self.ports: list[int] = []
        if sim_profiles is not None:
            self.set_sim_profiles(sim_profiles)

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{self.db_path}"

    @property
    def controller_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def controller_urls(self) -> list[str]:
        """Every controller's URL, the first one's (controller_url) first."""
        return [self.controller_url] + [f"http://127.0.0.1:{p}" for p in self.ports[1:]]

    @staticmethod
    def controller_service(index: int = 0) -> str:
        """The cluster service name of controller `index` (0: sg-controller)."""
        return "sg-controller" if index == 0 else f"sg-controller-{index + 1}"

    def write_policy(self) -> dict:
        self.port = self.port or _free_ports(1)[0]
        if len(self.ports) != self.controllers:
            self.ports = [self.port, *_free_ports(self.controllers - 1)]
        data = _merge(
            GUARD_DEFAULTS,
            {
                "database": {"url": self.db_url},
                "agent": {
                    "ring_root": self.ring_root,
                    "controller_url": self.controller_url,
                    "also_report_to": self.controller_urls[1:],
                    "secret_file": str(self.keys_dir / "{node}.key"),
                    "telemetry_source": self.telemetry,
                },
                "controller": {
                    "listen_host": "127.0.0.1",
                    "listen_port": self.port,
                    "secret_file": str(self.secret_path),
                },
                # every slurmd of the dev cluster shares this host's /dev/shm
                "prolog": {"trace_store": str(self.state / "traces"), "ring_root_shared": True},
                "sweeps": {"result_dir": str(self.state / "sweeps")},
            },
        )
        data = _merge(data, self.overrides)
        self.policy_path.write_text(yaml.safe_dump(data, sort_keys=False))
        return data

    def set_sim_profiles(self, profiles: Mapping[str, Any]) -> None:
        """Fault profiles for the sim telemetry; agents pick up changes within a sample."""
        tmp = self.sim_profiles_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(profiles)))
        tmp.replace(self.sim_profiles_path)

    def start(self, fresh: bool = False) -> Guard:
        """Plugin, keys, policy, prolog/epilog, controller and agents up.
        fresh: start clean, as the demo does: an empty database (sweep
        baselines a previous run measured at another machine load are no
        reference) and no simulated telemetry faults a previous run left in the
        state directory."""
        from slurmguard.store import db

        build = build_plugin()
        self.write_keys()
        self.write_policy()
        if fresh:
            self._clear_simulated_faults()
        elif not self.sim_profiles_path.exists():
            self.set_sim_profiles({})
        # /dev/shm is world-writable: a user who made this name first must not own it
        secure_dir(Path(self.ring_root), 0o755)
        self.cluster.set_plugstack(
            f"required {build}/slurmguard_spank.so nccl_hook={build}/libslurmguard_nccl.so "
            f"torch_hook={datafiles.torch_hook_site()} ring_root={self.ring_root} default=off\n"
        )
        # slurmd runs the prolog/epilog with an empty environment: a wrapper
        # points them at this cluster's policy (ring root, trace store)
        env_file = self.state / "slurmguard.env"
        env_file.write_text(f"SLURMGUARD_POLICY={self.policy_path}\nSLURMGUARD_PYTHON={sys.executable}\n")
        for slot, name in (("prolog", "slurmguard-prolog"), ("epilog", "slurmguard-epilog")):
            script = datafiles.prolog_epilog_dir() / name
            if script.exists():
                wrapper = self.state / f"{name}.sh"
                wrapper.write_text(f'#!/bin/sh\nSLURMGUARD_ENV_FILE={env_file} exec {script} "$@"\n')
                wrapper.chmod(0o755)
                getattr(self.cluster, f"set_{slot}")(wrapper)
        if fresh and self.database_url is None:
            self.db_path.unlink(missing_ok=True)
        db.upgrade(self.db_url)
        for i in range(self.controllers):
            self.start_controller(index=i)
        for node in self.cluster.node_names:
            self.start_agent(node)
        return self

    def node_key_path(self, node: str) -> Path:
        """Where the agent of `node` finds its key (agent.secret_file = keys/{node}.key)."""
        return self.keys_dir / f"{node}.key"

    def write_keys(self) -> None:
        """The master secret (once) and every node's key, as an admin would install them."""
        from slurmguard.wire import node_key

        for path, data in [(self.secret_path, None)] + [
            (self.node_key_path(n), n) for n in self.cluster.node_names
        ]:
            if data is None and path.exists():
                continue
            path.parent.mkdir(mode=0o700, exist_ok=True)
            content = (
                secrets.token_hex(32).encode()
                if data is None
                else node_key(self.secret_path.read_bytes().strip(), data)
            )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, content + b"\n")
            finally:
                os.close(fd)

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "slurmguard.cli", "--policy", str(self.policy_path), *args]

    def _env(self) -> dict[str, str]:
        return {
            "SLURMGUARD_SIM_PROFILES": f"@{self.sim_profiles_path}",
            "SLURMGUARD_POLICY": str(self.policy_path),
            "PYTHONUNBUFFERED": "1",
            # a daemon that crashes in C code says where
            "PYTHONFAULTHANDLER": "1",
        }

    def start_controller(self, wait_s: float = 30.0, index: int = 0) -> None:
        """Start controller `index` and wait until its /healthz answers (a standby
        answers too). One that ends before it answers having written nothing (a
        signal or crash at start-up, seen once in CI) is started once more, said
        on stdout with its exit status; a second such end, or one that wrote
        why, is an error quoting its output."""
        name = self.controller_service(index)
        argv = self._cli("controller", "-v")
        if index:
            argv += ["--listen", f"127.0.0.1:{self.ports[index]}"]
        env = self._env()
        if self.controller_database_urls:
            env["SLURMGUARD_DB"] = self.controller_database_urls[index]
        url = self.controller_urls[index]
        for attempt in (1, 2):
            self.cluster.spawn_service(name, argv, env)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
                if self.cluster.service_pid(name) is None:
                    break
                time.sleep(0.3)
            said = [line for line in self.cluster.service_output(name) if line.strip()]
            status = self.cluster.service_exit(name)
            if attempt == 1 and not said and status is not None:
                print(
                    f"devcluster: {name} ended at start-up with status {status} and no output; starting it again"
                )
                continue
            raise DevClusterError(
                f"controller did not come up (exit status {status}): {' | '.join(said[-3:]) or 'no output'}"
            )

    def restart_controller(self, overrides: Mapping[str, Any] | None = None) -> None:
        """Rewrite the policy (with new overrides) and restart the controller(s)."""
        for i in range(self.controllers):
            self.cluster.stop_service(self.controller_service(i))
        if overrides is not None:
            self.overrides = overrides
        self.write_policy()
        for i in range(self.controllers):
            self.start_controller(index=i)

    def bootstrap_sweeps(self, timeout_s: float = 240.0) -> list[str]:
        """Seed the sweep baselines of a fresh cluster: rolling sweeps of unsuspected
        nodes until a 1-node and a 2-node sweep have passed, then rolling off again."""
        from slurmguard.store import Store

        before = dict(self.overrides)
        self.restart_controller(
            _merge(before, {"sweeps": {"rolling_enabled": True, "rolling_nodes_per_hour": 3600.0}})
        )
        deadline = time.monotonic() + timeout_s
        kinds: set[str] = set()
        try:
            while time.monotonic() < deadline:
                with Store.open(self.db_url) as store:
                    passed = store.sweeps(verdict="pass")
                    kinds = {str(sw.kind) for sw in passed}
                    healthy = {str(n.state) for n in store.list_nodes()} == {"healthy"}
                if {"1node", "2node"} <= kinds and healthy:
                    return sorted({sw.node for sw in passed})
                time.sleep(1.0)
            raise DevClusterError(
                f"bootstrap sweeps did not pass within {timeout_s:g}s (passed: {sorted(kinds)})"
            )
        finally:
            self.restart_controller(before)
            self.cluster.wait_nodes_idle(timeout=60)

    def reset(self) -> None:
        """Back to a clean cluster between runs: controller stopped first (its sweep
        scheduler would resubmit what is cancelled), jobs cancelled, reservations
        deleted, faults cleared (CPU caps, sim profiles), nodes
        resumed and uncommented, all idle."""
        from slurmguard_dev.devcluster.fault import clear_all

        c = self.cluster
        for i in range(self.controllers):
            c.stop_service(self.controller_service(i))
        c.run(["scancel", "--partition", c.partition])
        res = c.run(["scontrol", "show", "reservation", "-o"])
        for line in res.stdout.splitlines():
            for tok in line.split():
                if tok.startswith("ReservationName="):
                    c.run(["scontrol", "delete", tok])
        clear_all(c)
        self._clear_simulated_faults()
        for node in c.node_names:
            c.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
            c.run(["scontrol", "update", f"NodeName={node}", "Comment="])
        c.wait_nodes_idle(timeout=60)

    def _clear_simulated_faults(self) -> None:
        """No simulated telemetry faults."""
        self.set_sim_profiles({})

    def configure(self, overrides: Mapping[str, Any] | None = None) -> None:
        """A fresh database (SQLite; a PostgreSQL database_url is the caller's to
        renew) and the controller(s) on the policy with these overrides."""
        from slurmguard.store import db

        for i in range(self.controllers):
            self.cluster.stop_service(self.controller_service(i))
        self.cluster.wait_nodes_idle(timeout=60)
        self.overrides = dict(overrides or {})
        self.write_policy()
        if self.database_url is None:
            self.db_path.unlink(missing_ok=True)
        db.upgrade(self.db_url)
        for i in range(self.controllers):
            self.start_controller(index=i)

    def start_agent(self, node: str) -> None:
        self.cluster.spawn_service(f"sg-agent-{node}", self._cli("agent", "--node", node, "-v"), self._env())
