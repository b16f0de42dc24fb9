#!/usr/bin/env python3
"""1-node sweep (Guard 5.2): sustained per-GPU GEMM throughput per dtype (all GPUs at
once, one process each, products verified against a float64 reference), device memory
bandwidth, clocks/power/throttling sampled meanwhile, the pairwise GPU-to-GPU copy matrix,
the intra-node all-reduce bus bandwidth, then the standard tools where installed (policy
sweeps.stages). Writes one JSON result (slurmguard.sweeps.result, kind "node").

    python sweeps/node_sweep.py --out result.json [--device auto|cuda|cpu] [--duration S]

Settings come from the policy's `sweeps` section; the options override them (tests,
demos). Exit status: 0 = measured without errors, 1 = result written with errors,
2 = bad options/policy.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sweeplib as sl  # noqa: E402

from slurmguard.config import SweepPolicy, load_policy  # noqa: E402
from slurmguard.sweeps.tools import node_stages  # noqa: E402


def settings_policy(args: argparse.Namespace) -> SweepPolicy:
    """The node-side policy (tool stages are configured where the tools are installed)."""
    return load_policy(args.policy).sweeps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sl.add_common_args(p)
    return p.parse_args(argv)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = sl.settings_from(args)
    node = sl.node_name(args.node)
    if args.threads:
        sl.torch.set_num_threads(args.threads)
    device = sl.pick_device(settings.device)
    device_name, count = sl.device_inventory(device, args.cpu_devices)
    devs = sl.torch_devices(device, count)
    started = sl.now()
    errors: list[dict[str, str]] = []

    per_dev: list[dict[str, Any]] = [
        {
            "node": node,
            "index": i,
            "name": sl.torch.cuda.get_device_name(i) if device == "cuda" else device_name,
            "gemm": [],
            "membw_gbps": None,
        }
        for i in range(count)
    ]
    # the sustained phase: every GPU in its own process, all at once (CPU devices share the
    # cores: one after another, here); clocks/power/throttling sampled meanwhile
    telemetry = sl.RunTelemetry(device, node, count, settings.telemetry_interval_s).start()
    if device == "cuda":
        specs = [
            sl.WorkerSpec(
                task="device",
                backend="nccl",
                store_host="",
                store_port=0,
                rank=i,
                world=count,
                device=device,
                local_index=i,
                node_rank=0,
                gpus_per_node=count,
                settings=settings,
            )
            for i in range(count)
        ]
        limit = len(settings.gemm_dtypes) * (settings.gemm_duration_s + 120) + settings.comm_timeout_s
        results = sl.run_local_workers(specs, timeout_s=limit)
    else:
        results = []
        for i, dev in enumerate(devs):
            res = sl.device_phase(dev, i, settings)
            results.append({"data": res, "errors": res.pop("errors")})
    for i, r in enumerate(results):
        errors.extend(r["errors"])
        if r["data"]:
            per_dev[i]["gemm"] = r["data"]["gemm"]
            per_dev[i]["membw_gbps"] = r["data"]["membw_gbps"]
    for i, t in enumerate(telemetry.stop()):
        per_dev[i]["telemetry"] = t
    p2p: list[dict[str, Any]] = []
    allreduce: list[dict[str, Any]] = []
    if count >= 2:
        try:
            p2p = sl.p2p_matrix(devs, node, max(settings.message_sizes_mb) * sl.MIB, settings.repeats)
        except Exception as exc:
            errors.append(sl.err("p2p matrix", exc))
        if device == "cuda":
            sl.torch.cuda.empty_cache()
        allreduce, ar_errors = intra_allreduce(device, count, settings)
        errors.extend(ar_errors)

    # the field's standard tools, where installed (policy sweeps.stages)
    stages = [st.to_dict() for st in node_stages(settings_policy(args).stages, gpus=count, device=device)]

    doc = sl.build_result(
        kind="node",
        nodes=[node],
        node_under_test=node,
        reference=None,
        hw_class=args.hw_class or sl.default_hw_class(device_name, count),
        device=device,
        device_name=device_name,
        devices_per_node=count,
        started=started,
        finished=sl.now(),
        job_id=os.environ.get("SLURM_JOB_ID"),
        settings=settings.to_schema(),
        devices=per_dev,
        p2p=p2p,
        allreduce=allreduce,
        transfers=[],
        errors=errors,
        stages=stages,
    )
    valid = sl.write_result(args.out, doc)
    return 0 if valid and not errors else 1


def intra_allreduce(
    device: str, count: int, settings: sl.Settings
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """All-reduce over the node's devices, one spawned process per device."""
    import datetime

    timeout = datetime.timedelta(seconds=settings.comm_timeout_s)
    store = sl.dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    specs = [
        sl.WorkerSpec(
            task="allreduce_intra",
            backend="nccl" if device == "cuda" else "gloo",
            store_host="127.0.0.1",
            store_port=store.port,
            rank=i,
            world=count,
            device=device,
            local_index=i,
            node_rank=0,
            gpus_per_node=count,
            settings=settings,
        )
        for i in range(count)
    ]
    results = sl.run_local_workers(specs, timeout_s=settings.comm_timeout_s + 60)
    errors = [e for r in results for e in r["errors"]]
    data = results[0]["data"] or []
    del store
    return data, errors


def main(argv: list[str] | None = None) -> int:
    return sl.main_guard(run, argv)


if __name__ == "__main__":
    # gloo's threads can race interpreter finalisation: end the way every project job ends
    from slurmguard.teardown import finish

    finish(main(), barrier=False)
