"""Simulated telemetry with per-node fault profiles, deterministic per seed and clock.

Profiles (assign per node, e.g. {"node2": "thermal_throttle"} or
{"node2": {"profile": "nic_down", "start_s": 60, "nic": "mlx5_3:1"}}):
- healthy: an 8x H100 node under a training load (about 60 C, 1980 MHz SM
  clock, 650 W, 100% utilisation; 4 NDR NICs at 400 Gb/s carrying ~180 Gb/s).
- thermal_throttle: Guard Table 2 - temperature up to ~77-80 C, SM clock down
  to ~1380 MHz (from 1930-1980), power down ~15%, utilisation unchanged,
  clocks-event reasons with the HW/SW thermal slowdown bits.
- low_power: power 10-15% below the fleet at normal utilisation and clocks
  (Guard 3.3: a power-delivery fault).
- nic_down: one NIC down (state DOWN, rate 0, no traffic) and its traffic
  rerouted to NIC 0, which carries double (Guard Table 1).
- link_flap: a NIC goes down for one sample in four; link_downed and
  link_error_recovery count each flap.
- error_burst: bursts of symbol/receive errors on a NIC and PCIe replays on a GPU.
- cpu_contention: host CPUs busy with other work; GPU utilisation and power
  sag as the GPUs starve.
Counters are cumulative like the real ones; rates come from CounterRates.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurmguard.clock import Clock, SystemClock
from slurmguard.errors import InputError
from slurmguard.telemetry.base import CounterRates, Reading, Signal, sample

PROFILES = (
    "healthy",
    "thermal_throttle",
    "low_power",
    "nic_down",
    "link_flap",
    "error_burst",
    "cpu_contention",
)


@dataclass(frozen=True)
class FaultSpec:
    profile: str = "healthy"
    start_s: float = 0.0  # seconds after the source starts
    gpus: tuple[int, ...] | None = None  # None = every GPU of the node
    nic: str | None = None  # None = the last NIC


def parse_profiles(cfg: dict[str, Any] | None) -> dict[str, FaultSpec]:
    """{"node2": "thermal_throttle"} or {"node2": {"profile": ..., "start_s": ..,
    "gpus": [..], "nic": ".."}} -> FaultSpec per node; errors name the node and key."""
    out: dict[str, FaultSpec] = {}
    for node, spec in (cfg or {}).items():
        if isinstance(spec, str):
            spec = {"profile": spec}
        if not isinstance(spec, dict):
            raise InputError(f"sim profile for node {node}: expected a name or a mapping, got {spec!r}")
        unknown = set(spec) - {"profile", "start_s", "gpus", "nic"}
        if unknown:
            raise InputError(f"sim profile for node {node}: unknown key(s) {', '.join(sorted(unknown))}")
        name = spec.get("profile", "healthy")
        if name not in PROFILES:
            raise InputError(
                f"sim profile for node {node}: unknown profile '{name}' (known: {', '.join(PROFILES)})"
            )
        try:
            start = float(spec.get("start_s", 0.0))
            gpus = spec.get("gpus")
            gpus = tuple(int(g) for g in gpus) if gpus is not None else None
        except (TypeError, ValueError):
            raise InputError(
                f"sim profile for node {node}: start_s must be a number and gpus a list of integers"
            ) from None
        out[str(node)] = FaultSpec(name, start, gpus, spec.get("nic"))
    return out


@dataclass
class _NodeState:
    tx: np.ndarray
    rx: np.ndarray
    errors: np.ndarray
    downed: np.ndarray
    congestion: np.ndarray
    pcie: np.ndarray
    last_ts: float | None = None
    flaps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class SimTelemetrySource:
    """Deterministic telemetry for `nodes`, faults from `profiles`."""

    name = "sim"

    def __init__(
        self,
        nodes: list[str],
        profiles: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        clock: Clock | None = None,
        gpus_per_node: int = 8,
        nics_per_node: int = 4,
    ) -> None:
        self.nodes = list(nodes)
        self.profiles = parse_profiles(profiles)
        for n in self.profiles:
            if n not in self.nodes:
                raise InputError(
                    f"sim profile for node {n}: not one of the simulated nodes ({', '.join(self.nodes)})"
                )
        self.seed = seed
        self.clock = clock or SystemClock()
        self.G = gpus_per_node
        self.nics = [f"mlx5_{i}:1" for i in range(nics_per_node)]
        self.t0 = self.clock.now()
        self.rates = CounterRates()
        self._n = 0
        k = nics_per_node
        self._state = {
            n: _NodeState(
                tx=np.zeros(k),
                rx=np.zeros(k),
                errors=np.zeros(k),
                downed=np.zeros(k),
                congestion=np.zeros(k),
                pcie=np.zeros(gpus_per_node),
            )
            for n in self.nodes
        }

    def close(self) -> None:
        pass

    def _rng(self, node: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(node.encode()), self._n])

    def active(self, node: str, ts: float) -> FaultSpec:
        spec = self.profiles.get(node)
        if spec is None or ts - self.t0 < spec.start_s:
            return FaultSpec()
        return spec

    def sample(self) -> Reading:
        ts = self.clock.now()
        out = Reading()
        for node in self.nodes:
            out.extend(self._node(node, ts))
        self._n += 1
        return out

    def _node(self, node: str, ts: float) -> Reading:
        rng = self._rng(node)
        spec = self.active(node, ts)
        prof = spec.profile
        st = self._state[node]
        dt = 0.0 if st.last_ts is None else max(ts - st.last_ts, 0.0)
        st.last_ts = ts
        G = self.G
        hit = np.zeros(G, bool)
        hit[list(spec.gpus) if spec.gpus is not None else slice(None)] = True
        temp = rng.normal(60.0, 1.5, G)
        clock = np.full(G, 1980.0) - np.abs(rng.normal(0, 6, G))
        power = rng.normal(650.0, 8.0, G)
        util = np.minimum(100.0, rng.normal(99.5, 0.4, G))
        reasons = np.zeros(G, np.int64)
        cpu = float(rng.normal(12.0, 2.0))
        if prof == "thermal_throttle":
            temp = np.where(hit, rng.normal(78.0, 1.0, G), temp)
            clock = np.where(hit, rng.normal(1380.0, 10.0, G), clock)
            power = np.where(hit, power * 0.85, power)
            reasons = np.where(hit, 0x40 | 0x20, reasons)
        elif prof == "low_power":
            power = np.where(hit, power * rng.uniform(0.85, 0.9), power)
        elif prof == "cpu_contention":
            cpu = float(rng.normal(92.0, 2.0))
            util = np.where(hit, rng.normal(72.0, 3.0, G), util)
            power = np.where(hit, power * 0.8, power)
        xfer = rng.normal(180.0, 4.0, len(self.nics))  # Gb/s per NIC
        up = np.ones(len(self.nics), bool)
        nic_i = self.nics.index(spec.nic) if spec.nic in self.nics else len(self.nics) - 1
        if prof == "nic_down":
            up[nic_i] = False
            xfer[0] += xfer[nic_i]  # NCCL falls back to NIC 0 (Guard Table 1)
            xfer[nic_i] = 0.0
        elif prof == "link_flap" and self._n % 4 == 3:
            up[nic_i] = False
            xfer[nic_i] = 0.0
            st.downed[nic_i] += 1
            st.errors[nic_i] += 1  # link_error_recovery
        if prof == "error_burst":
            st.errors[nic_i] += int(rng.integers(50, 500))
            st.pcie[0] += int(rng.integers(5, 50))
        st.tx += xfer * 1e9 / 8 * dt
        st.rx += xfer * 1e9 / 8 * dt
        st.congestion += np.where(up, rng.poisson(2000.0 * max(dt, 0.0), len(self.nics)), 0)
        if prof == "nic_down":
            st.congestion[0] += rng.poisson(40000.0 * dt)
        out = Reading()
        for g in range(G):
            out.samples += [
                sample(node, Signal.GPU_TEMP, round(float(temp[g])), ts, gpu=g),
                sample(node, Signal.SM_CLOCK, round(float(clock[g])), ts, gpu=g),
                sample(node, Signal.POWER, round(float(power[g]), 1), ts, gpu=g),
                sample(node, Signal.GPU_UTIL, round(float(util[g])), ts, gpu=g),
                sample(node, Signal.THROTTLE_REASONS, int(reasons[g]), ts, gpu=g),
                sample(node, Signal.THERMAL_THROTTLE, 1 if reasons[g] & 0x60 else 0, ts, gpu=g),
                sample(node, Signal.PCIE_REPLAY, st.pcie[g], ts, gpu=g),
            ]
            r = self.rates.rate((node, g, "pcie"), st.pcie[g], ts)
            if r is not None:
                out.samples.append(sample(node, Signal.PCIE_REPLAY_RATE, r, ts, gpu=g))
        for i, nic in enumerate(self.nics):
            out.samples += [
                sample(node, Signal.NIC_STATE, 1 if up[i] else 0, ts, nic=nic),
                sample(node, Signal.NIC_RATE, 400.0 if up[i] else 0.0, ts, nic=nic),
                sample(node, Signal.NIC_TX_BYTES, st.tx[i], ts, nic=nic),
                sample(node, Signal.NIC_RX_BYTES, st.rx[i], ts, nic=nic),
                sample(node, Signal.NIC_ERRORS, st.errors[i], ts, nic=nic),
                sample(node, Signal.NIC_LINK_DOWNED, st.downed[i], ts, nic=nic),
                sample(node, Signal.NIC_CONGESTION, st.congestion[i], ts, nic=nic),
            ]
            for key, val, sig, scale in (
                ("tx", st.tx[i], Signal.NIC_TX_GBPS, 8 / 1e9),
                ("err", st.errors[i], Signal.NIC_ERROR_RATE, 1.0),
                ("cong", st.congestion[i], Signal.NIC_CONGESTION_RATE, 1.0),
            ):
                r = self.rates.rate((node, nic, key), val, ts)
                if r is not None:
                    out.samples.append(sample(node, sig, r * scale, ts, nic=nic))
        out.samples.append(sample(node, Signal.CPU_BUSY, round(cpu, 1), ts))
        return out
