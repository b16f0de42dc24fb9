"""The one rendezvous of slurmguard's jobs: rank 0's store on a port the
kernel gives it, published by a beacon the peers find even when MASTER_PORT
is taken, another job's beacon answers on a candidate port, or rank 0
starts late."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from slurmguard import rendezvous

RANK = textwrap.dedent("""
    import json, os, sys, time
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    time.sleep(float(sys.argv[3]))
    import torch, torch.distributed as dist
    from slurmguard.rendezvous import init_process_group
    init_process_group("gloo", rank, world, timeout_s=float(sys.argv[4]))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "sum": t.item()}), flush=True)
    from slurmguard.teardown import finish
    finish()  # gloo's exit race (README, "Exit race") is not this test's subject
""")


def run_ranks(tmp_path, env: dict[str, str], delays=(0.0, 0.0), timeout_s: float = 60):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_", "SLURMGUARD_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(len(delays)), str(delays[r]), str(timeout_s)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(len(delays))
    ]
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=timeout_s + 60)
        outs.append((p.returncode, so, se))
    return outs


def listener(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", port))
    s.listen(8)
    return s


def test_candidates_follow_master_port_then_the_id_below_the_ephemeral_range():
    ports = rendezvous.candidates("slurm-7.0.0", {"MASTER_PORT": "45000"})
    assert ports[0] == 45000 and len(set(ports)) == len(ports) == rendezvous.CANDIDATES
    assert all(rendezvous.PORT_LOW <= p < 32768 for p in ports[1:])
    assert rendezvous.candidates("slurm-7.0.0", {}) != rendezvous.candidates("slurm-7.0.1", {})
    assert (
        rendezvous.rdzv_id({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1"})
        == "slurm-7.2.1"
    )
    # the same job id on two clusters sharing a host (every dev cluster starts at 1)
    step = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_CLUSTER_NAME": "dev",
        "SLURM_SRUN_COMM_HOST": "127.0.0.1",
    }
    a, b = (rendezvous.rdzv_id({**step, "SLURM_SRUN_COMM_PORT": p}) for p in ("40001", "40002"))
    assert a == "slurm-1.0.0-dev@127.0.0.1:40001" and a != b


def test_ranks_meet_when_master_port_is_held_by_a_silent_listener_and_a_foreign_beacon(tmp_path):
    env = {"SLURM_JOB_ID": "424242", "SLURM_STEP_ID": "0", "MASTER_ADDR": "127.0.0.1"}
    ports = rendezvous.candidates(rendezvous.rdzv_id(env), {})
    held = listener(0)  # accepts connections, never answers: peers must time out and move on
    env["MASTER_PORT"] = str(held.getsockname()[1])
    # another job's beacon on the next candidate: a different id, never joined
    foreign = listener(ports[0])
    stop = threading.Event()

    def answer():
        foreign.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = foreign.accept()
            except OSError:
                continue
            c.sendall(b"slurmguard-rdzv slurm-1.0.0 1\n")
            c.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        # rank 0 starts late: the peer keeps looking
        outs = run_ranks(tmp_path, env, delays=(3.0, 0.0))
    finally:
        stop.set()
        t.join()
        foreign.close()
        held.close()
    for rc, so, se in outs:
        assert rc == 0, se[-2000:]
        assert json.loads(so.strip().splitlines()[-1])["sum"] == 3.0
        assert "Traceback" not in se


def test_a_peer_without_rank_0_fails_with_a_clear_error_in_time(tmp_path):
    env = {"SLURM_JOB_ID": "424243", "MASTER_ADDR": "127.0.0.1"}
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    t0 = time.monotonic()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_"))}
    p = subprocess.run(
        [sys.executable, str(script), "1", "2", "0", "3"],
        check=False,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "rank 1 found no beacon of rank 0" in p.stderr and "slurm-424243.0.0" in p.stderr
    assert time.monotonic() - t0 < 60


def test_rank_0_reports_when_every_candidate_is_taken(monkeypatch):
    held = [listener(p) for p in rendezvous.candidates("x", {})[:2]]
    monkeypatch.setattr(rendezvous, "CANDIDATES", 2)
    try:
        with pytest.raises(rendezvous.RendezvousError, match="no free beacon port"):
            rendezvous.connect(0, world=2, env={"SLURMGUARD_RDZV_ID": "x"}, timeout_s=5)
    finally:
        for s in held:
            s.close()
