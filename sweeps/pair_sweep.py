#!/usr/bin/env python3
"""2-node (and multi-node) sweep (Guard 5.3): cross-node all-reduce bus bandwidth and
per-GPU-pair send/recv between the node under test and a reference node, in both
directions, at each message size, repeated. With more than two nodes it runs the O(1)
ring and tree pass schedules of Greyhound Fig. 10 so every used link is measured in a
constant number of rounds.

Launched by srun with one task per node (sweeps/templates/pair_sweep.sbatch):

    srun python sweeps/pair_sweep.py --out result.json --node-under-test n2 --reference n1

Rank and size come from SLURM_PROCID / SLURM_NTASKS, the rendezvous through
slurmguard.rendezvous at MASTER_ADDR (MASTER_PORT, when set, is where rank 0's beacon is
looked for first). Each task starts one worker per local GPU (global rank = node rank * GPUs +
GPU index; NCCL); on CPU one worker per --cpu-devices (gloo over TCP). Node rank 0 writes
the result (kind "pair" for 2 nodes, "multi" above). Exit status as node_sweep.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sweeplib as sl  # noqa: E402

from slurmguard import rendezvous  # noqa: E402
from slurmguard.config import load_policy  # noqa: E402
from slurmguard.errors import SlurmguardError  # noqa: E402
from slurmguard.sweeps import tools  # noqa: E402
from slurmguard.sweeps.schedule import ring_passes, tree_passes  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sl.add_common_args(p)
    p.add_argument("--node-under-test", default=None)
    p.add_argument("--reference", default=None, help="known-good partner (2-node sweeps)")
    return p.parse_args(argv)


def _env_int(name: str) -> int:
    v = os.environ.get(name)
    if v is None or not v.isdigit():
        raise SlurmguardError(f"${name} is not set to a non-negative integer (run under srun)")
    return int(v)


def schedules_for(nnodes: int) -> tuple[tuple[str, Any], ...]:
    """2 nodes: the 2-rank ring (both directions). More: ring and tree passes, as NCCL may
    pick either topology at run time (Greyhound 4.3)."""
    if nnodes == 2:
        return (("ring", ring_passes(2)),)
    return (("ring", ring_passes(nnodes)), ("tree", tree_passes(nnodes)))


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = sl.settings_from(args)
    node_rank, nnodes = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    if nnodes < 2 or node_rank >= nnodes:
        raise SlurmguardError(f"a pair sweep needs 2+ tasks, got rank {node_rank} of {nnodes}")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    node = sl.node_name(args.node)
    if args.threads:
        sl.torch.set_num_threads(args.threads)
    device = sl.pick_device(settings.device)
    device_name, count = sl.device_inventory(device, args.cpu_devices)
    started = sl.now()
    # one store for the whole sweep, hosted by node rank 0 on a port it binds as it
    # starts (MASTER_PORT: where its beacon is looked for first): first the node
    # inventory, then (under a prefix) the process group, finally errors and a done
    # handshake
    rdzv = rendezvous.connect(node_rank, addr=addr, timeout_s=settings.comm_timeout_s)
    store = rdzv.store
    store.set(
        f"node/{node_rank}",
        json.dumps({"name": node, "devices": count, "device_name": device_name}),
    )
    infos = [json.loads(store.get(f"node/{r}")) for r in range(nnodes)]
    rdzv.close()  # every node has joined
    names = tuple(i["name"] for i in infos)
    errors: list[dict[str, str]] = []
    data: dict[str, Any] = {"transfers": [], "allreduce": []}
    counts = {i["devices"] for i in infos}
    if len(set(names)) != len(names):
        errors.append({"where": "rendezvous", "message": f"duplicate node names {list(names)}"})
    elif len(counts) != 1:
        errors.append(
            {
                "where": "rendezvous",
                "message": "devices per node differ: "
                + ", ".join(f"{i['name']}={i['devices']}" for i in infos),
            }
        )
    else:
        base = dict(
            backend="nccl" if device == "cuda" else "gloo",
            store_host=addr,
            store_port=store.port,
            world=nnodes * count,
            device=device,
            node_rank=node_rank,
            gpus_per_node=count,
            settings=settings,
            node_names=names,
            schedules=schedules_for(nnodes),
            task="passes",
        )
        specs = [sl.WorkerSpec(rank=node_rank * count + g, local_index=g, **base) for g in range(count)]
        if count == 1:
            if device == "cpu" and not args.threads:
                sl.torch.set_num_threads(1)
            results = [sl.run_worker(specs[0], store)]
        else:
            results = sl.run_local_workers(specs, timeout_s=settings.comm_timeout_s * 4 + 60)
        for r in results:
            errors.extend(r["errors"])
        if node_rank == 0 and results[0]["data"]:
            data = results[0]["data"]
    stages = ib_stage(store, node_rank, nnodes, names, args)
    store.set(f"errors/{node_rank}", json.dumps(errors))
    store.set(f"done/{node_rank}", "1")
    if node_rank != 0:
        return 0 if not errors else 1
    for r in range(1, nnodes):
        try:
            errors.extend(e for e in json.loads(store.get(f"errors/{r}")) if e not in errors)
            store.get(f"done/{r}")
        except Exception as exc:
            errors.append(sl.err(f"collect node rank {r}", exc))
    nut = args.node_under_test or names[0]
    ref = args.reference
    if nnodes == 2 and ref is None:
        ref = names[1] if nut == names[0] else names[0]
    for label, n in (("--node-under-test", nut), ("--reference", ref)):
        if n is not None and n not in names:
            errors.append({"where": "arguments", "message": f"{label} {n} is not in the sweep {list(names)}"})
            nut, ref = names[0], (names[1] if nnodes == 2 else None)
    doc = sl.build_result(
        kind="pair" if nnodes == 2 else "multi",
        nodes=list(names),
        node_under_test=nut,
        reference=ref if nnodes == 2 else None,
        hw_class=args.hw_class or sl.default_hw_class(device_name, count),
        device=device,
        device_name=device_name,
        devices_per_node=count,
        started=started,
        finished=sl.now(),
        job_id=os.environ.get("SLURM_JOB_ID"),
        settings=settings.to_schema(),
        devices=[],
        p2p=[],
        allreduce=data["allreduce"],
        transfers=data["transfers"],
        errors=errors,
        stages=stages,
    )
    valid = sl.write_result(args.out, doc)
    # keep the store up briefly: peers may still be reading their last keys
    time.sleep(0.2)
    return 0 if valid and not errors else 1


def ib_stage(
    store: Any, node_rank: int, nnodes: int, names: tuple[str, ...], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """perftest ib_write_bw per HCA pair between the two nodes (2-node sweeps only).

    The reference runs the server of each HCA in turn, the node under test the client
    (its writes go node under test -> reference); they meet through the sweep's store. An
    HCA present on one side only is not measured. Returns the stage record on node rank 0,
    which writes the result (an empty list elsewhere).
    """
    cfg = load_policy(args.policy).sweeps.stages
    stage = cfg.ib_write_bw
    if nnodes != 2:
        return (
            [tools.StageOutcome("ib_write_bw", "skipped", "not applicable: more than two nodes").to_dict()]
            if node_rank == 0
            else []
        )
    nut = args.node_under_test if args.node_under_test in names else names[0]
    client = names.index(nut)
    hcas = tools.ib_hcas(cfg) if stage.run != "never" else []
    exe = tools.resolve(stage.command)
    store.set(f"ib/hcas/{node_rank}", json.dumps(hcas if exe else []))
    store.set(f"ib/host/{node_rank}", socket.gethostname())
    theirs = json.loads(store.get(f"ib/hcas/{1 - node_rank}"))
    common = [
        h for h in json.loads(store.get(f"ib/hcas/{client}")) if h in theirs and h in (hcas if exe else [])
    ]
    parts: list[tuple[str, tools.StageOutcome]] = []
    for i, hca in enumerate(common):
        port = str(cfg.ib_port_base + i)
        base = ["-d", hca, "-p", port, "--report_gbits", "-F"]
        assert exe is not None, "common is empty without ib_write_bw"
        if node_rank != client:
            try:
                server = subprocess.Popen(
                    [exe, *base, *stage.args],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                store.set(f"ib/ready/{hca}", f"error: {exc}")
                continue
            time.sleep(1.0)  # listening before the client connects
            store.set(f"ib/ready/{hca}", "ok")
            try:
                server.wait(timeout=stage.timeout_s)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            continue
        ready = store.get(f"ib/ready/{hca}").decode()
        if ready != "ok":
            parts.append(
                (hca, tools.StageOutcome("ib_write_bw", "error", f"server on the reference: {ready}"))
            )
            continue
        host = store.get(f"ib/host/{1 - client}").decode()
        parts.append(
            (
                hca,
                tools.run_stage(
                    "ib_write_bw", stage, [*base, host], tools.parse_ib_write_bw, min_key=r"avg_gbps"
                ),
            )
        )
    if node_rank == client:
        if stage.run == "never":
            out = tools.StageOutcome("ib_write_bw", "skipped", "switched off in the policy")
        elif exe is None:
            out = tools.StageOutcome(
                "ib_write_bw",
                "error" if stage.run == "required" else "skipped",
                f"{stage.command}: not installed on {nut}",
            )
        elif not common:
            out = tools.StageOutcome(
                "ib_write_bw",
                "skipped",
                "not applicable: no InfiniBand device with ib_write_bw on both nodes",
            )
        else:
            out = tools.merge_outcomes("ib_write_bw", parts)
        store.set("ib/stage", json.dumps(out.to_dict()))
    return [json.loads(store.get("ib/stage"))] if node_rank == 0 else []


def main(argv: list[str] | None = None) -> int:
    return sl.main_guard(run, argv)


if __name__ == "__main__":
    # gloo's threads can race interpreter finalisation: end the way every project job ends
    from slurmguard.teardown import finish

    finish(main(), barrier=False)
