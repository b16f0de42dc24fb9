"""Peer-relative telemetry scoring (Guard 4.2).

Every signal of every device is compared with the same signal on its peers
(the devices of the same job, or of the same hardware class when idle) with
robust statistics: z = (x - median) / (1.4826 * MAD). A signal deviates when z
exceeds `robust_z` in the signal's bad direction (hot, slow clock, low power,
...). A device is flagged only when at least `min_signals` signals deviate
together in `consecutive_windows` consecutive windows; there are no absolute
thresholds, except for hard failures (a hardware XID, a GPU fallen off the bus,
an uncorrectable ECC error, a link down, a pending or failed HBM row remap, a
GPU recovery action required by the driver: XID 154) which flag at once.

The MAD has a floor of `mad_floor` times |median| so that a fleet of identical
readings (MAD = 0) does not turn a 1 MHz difference into an infinite z.
"Low power at normal utilisation" (Guard 3.3) is scored through a derived
signal, power per utilisation percent, so that a GPU drawing 12% less power
while as busy as its peers deviates on two signals (power and power/util).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurmguard.config import PeerPolicy
from slurmguard.detect.findings import Finding, Kind, Measure, Severity, Subject
from slurmguard.telemetry.base import (
    HARD_XIDS,
    RECOVERY_ACTIONS,
    UNITS,
    XID_RECOVERY_ACTION,
    Signal,
    TelemetrySample,
)

if TYPE_CHECKING:
    import numpy as np

#: +1: high is bad, -1: low is bad, 0: either way.
BAD_DIRECTION: dict[str, int] = {
    Signal.GPU_TEMP: +1,
    Signal.SM_CLOCK: -1,
    Signal.POWER: -1,
    Signal.GPU_UTIL: -1,
    "power_per_util": -1,
    Signal.PCIE_REPLAY_RATE: +1,
    Signal.NVLINK_ERROR_RATE: +1,
    Signal.NIC_RATE: -1,
    Signal.NIC_TX_GBPS: 0,  # misrouted traffic doubles one NIC's load
    Signal.NIC_ERROR_RATE: +1,
    Signal.NIC_CONGESTION_RATE: +1,
    Signal.CPU_BUSY: +1,
    Signal.STEP_TIME: +1,
    # DCGM profiling ratios: a starved GPU is idle more than its peers, a
    # throttled one computes longer while its peers wait in collectives
    Signal.SM_ACTIVE: 0,
    Signal.TENSOR_ACTIVE: 0,
    Signal.DRAM_ACTIVE: 0,
}


#: units of the derived signals (the measured ones are in telemetry.base.UNITS)
_UNIT = {"power_per_util": "W/%"}


@dataclass(frozen=True)
class Deviation:
    signal: str
    value: float
    median: float
    z: float


@dataclass(frozen=True)
class PeerFlag:
    """A device (node, device) flagged against its peers, with the evidence."""

    node: str
    device: str
    hard: bool
    reasons: tuple[str, ...]
    deviations: tuple[Deviation, ...] = ()
    windows: int = 0

    def text(self) -> str:
        """'gpu3 sm_clock 1380 vs peers 1980', or the hard failure."""
        if self.deviations:
            d = self.deviations[0]
            return f"{self.device} {d.signal} {d.value:.4g} vs peers {d.median:.4g}"
        return f"{self.device} {self.reasons[0] if self.reasons else 'hard failure'}"

    def finding(self, detected_at: float) -> Finding:
        """This flag as the typed finding the controller decides from: each
        deviation's value against the peer median in the signal's unit, and its z."""
        ev: list[Measure] = []
        for d in self.deviations:
            ev.append(
                Measure(d.signal, d.value, _UNIT.get(d.signal) or UNITS.get(d.signal) or "value", d.median)
            )
            ev.append(Measure(f"{d.signal}_z", d.z, "z"))
        if self.windows:
            ev.append(Measure("windows", float(self.windows), "windows"))
        return Finding(
            Kind.TELEMETRY,
            Subject(node=self.node, device=self.device),
            "peers",
            detected_at,
            Severity.CRITICAL if self.hard else Severity.WARNING,
            tuple(ev),
            text=self.text(),
        )


def _device(s: TelemetrySample) -> str:
    return _device_name(s.gpu, s.nic)


def _device_name(gpu: int | None, nic: str | None) -> str:
    if gpu is not None:
        return f"gpu{gpu}"
    if nic is not None:
        return nic
    return "host"


def _kind(gpu: int | None, nic: str | None) -> str:
    """The kind of device a sample is of: its peers are devices of the same kind."""
    return "gpu" if gpu is not None else ("nic" if nic is not None else "host")


#: the signals hard_failures looks at
_HARD_SIGNALS = frozenset(
    {
        Signal.XID,
        Signal.RECOVERY_ACTION,
        Signal.ROW_REMAP_FAILURE,
        Signal.ROW_REMAP_PENDING,
        Signal.GPU_LOST,
        Signal.ECC_DBE_DELTA,
        Signal.NIC_STATE,
        Signal.NVLINK_DOWN,
    }
)


def hard_failures(samples: list[TelemetrySample]) -> list[PeerFlag]:
    """Signals that fail a device on their own, whatever the peers say.

    XID 154 only says that the GPU's recovery action changed: the action read
    with it decides (none = nothing to do); without a readable action it fails
    the GPU, since the driver asked for something we cannot see.
    """
    out = []
    seen: set[tuple[str, str, str]] = set()
    # the few samples of these signals first: a window holds hundreds of thousands of others
    samples = [s for s in samples if s.signal in _HARD_SIGNALS]
    actions = {(s.node, s.gpu) for s in samples if s.signal == Signal.RECOVERY_ACTION}
    for s in samples:
        why = None
        if s.signal == Signal.XID and int(s.value) in HARD_XIDS:
            why = f"XID {int(s.value)}"
        elif (
            s.signal == Signal.XID and int(s.value) == XID_RECOVERY_ACTION and (s.node, s.gpu) not in actions
        ):
            why = f"XID {XID_RECOVERY_ACTION}: recovery action changed, action not readable"
        elif s.signal == Signal.RECOVERY_ACTION and s.value > 0:
            why = f"recovery action required: {RECOVERY_ACTIONS.get(int(s.value), f'code {int(s.value)}')}"
        elif s.signal == Signal.ROW_REMAP_FAILURE and s.value > 0:
            why = "row remapping failed (uncorrectable memory, replace the GPU)"
        elif s.signal == Signal.ROW_REMAP_PENDING and s.value > 0:
            why = "row remapping pending (GPU reset required)"
        elif s.signal == Signal.GPU_LOST and s.value > 0:
            why = "GPU is lost (fell off the bus)"
        elif s.signal == Signal.ECC_DBE_DELTA and s.value > 0:
            why = f"{int(s.value)} new uncorrectable ECC errors"
        elif s.signal == Signal.NIC_STATE and s.value < 1:
            why = "link down"
        elif s.signal == Signal.NVLINK_DOWN and s.value > 0:
            why = f"{int(s.value)} NVLink link(s) down"
        if why and (s.node, _device(s), why) not in seen:
            seen.add((s.node, _device(s), why))
            out.append(PeerFlag(s.node, _device(s), True, (why,)))
    return out


def robust_z(values: np.ndarray, floor: float) -> tuple[np.ndarray, float]:
    import numpy as np  # here, not at the top: the prolog imports hard_failures

    med = float(np.median(values))
    mad = float(np.median(np.abs(values - med)))
    scale = max(1.4826 * mad, floor * abs(med), 1e-12)
    return (values - med) / scale, med


class PeerScorer:
    """Stateful: call `window(samples, peer_group)` once per window."""

    def __init__(self, policy: PeerPolicy | None = None) -> None:
        self.policy = policy or PeerPolicy()
        self._streak: dict[tuple[str, str], int] = defaultdict(int)

    def deviations(
        self,
        samples: list[TelemetrySample],
        peer_group: dict[str, str] | None = None,
        means: Mapping[tuple[str, str, int | None, str | None], float] | None = None,
    ) -> dict[tuple[str, str], list[Deviation]]:
        """Per (node, device): the signals deviating from their peers this window.

        peer_group maps node -> group name (job id or hardware class); nodes
        missing from it share one group. Samples of one device and signal in a
        window are averaged first. means: (node, signal, gpu, nic) -> that
        device signal's mean over the window, averaged already (the controller
        sums samples as they arrive: controller.fleet), for device signals that
        have no samples in `samples`.
        """
        import numpy as np  # see robust_z

        p = self.policy
        peer_group = peer_group or {}
        acc: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
        for s in samples:
            if s.signal not in BAD_DIRECTION:
                continue
            kind = _kind(s.gpu, s.nic)
            acc[(peer_group.get(s.node, ""), kind, s.signal, f"{s.node}\0{_device(s)}")].append(s.value)
        table: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
        for (grp, kind, sig, dev), vals in acc.items():
            # (a plain mean: np.mean's call costs 10x the sum of the few values of one device)
            table[(grp, kind, sig)][dev] = math.fsum(vals) / len(vals)
        for (node, sig, gpu, nic), mean in (means or {}).items():
            if sig in BAD_DIRECTION:
                dev = f"{node}\0{_device_name(gpu, nic)}"
                table[(peer_group.get(node, ""), _kind(gpu, nic), sig)][dev] = mean
        # derived: power per utilisation percent (low power at normal utilisation)
        for (grp, kind, sig), devs in list(table.items()):
            if sig != Signal.POWER:
                continue
            util = table.get((grp, kind, Signal.GPU_UTIL), {})
            derived = {d: v / util[d] for d, v in devs.items() if util.get(d, 0) > 5.0}
            if derived:
                table[(grp, kind, "power_per_util")] = derived
        out: dict[tuple[str, str], list[Deviation]] = defaultdict(list)
        floor = p.mad_floor
        for (_group, _which, sig), devs in table.items():
            if len(devs) < p.min_peers:
                continue
            names = list(devs)
            values = np.array([devs[n] for n in names])
            z, med = robust_z(values, floor)
            direction = BAD_DIRECTION[sig]
            bad = (z * direction > p.robust_z) if direction else (np.abs(z) > p.robust_z)
            for i in np.nonzero(bad)[0]:
                node, dev = names[i].split("\0")
                out[(node, dev)].append(Deviation(sig, float(values[i]), med, float(z[i])))
        return out

    def window(
        self,
        samples: list[TelemetrySample],
        peer_group: dict[str, str] | None = None,
        means: Mapping[tuple[str, str, int | None, str | None], float] | None = None,
    ) -> list[PeerFlag]:
        """Score one window (means: see deviations); returns hard failures and devices
        whose multi-signal deviation has lasted consecutive_windows windows."""
        p = self.policy
        devs = self.deviations(samples, peer_group, means)
        flags = hard_failures(samples)
        multi = {k: v for k, v in devs.items() if len({d.signal for d in v}) >= p.min_signals}
        # a node whose devices deviate on several different signals (NIC errors
        # and PCIe replays, say) counts too, as device "node"
        per_node: dict[str, list[Deviation]] = defaultdict(list)
        for (node, _), v in devs.items():
            per_node[node].extend(v)
        for node, v in per_node.items():
            if len({d.signal for d in v}) >= p.min_signals and not any(k[0] == node for k in multi):
                multi[(node, "node")] = v
        for k in list(self._streak):
            if k not in multi:
                del self._streak[k]
        for k, v in multi.items():
            self._streak[k] += 1
            if self._streak[k] >= p.consecutive_windows:
                reasons = tuple(
                    f"{d.signal} {d.value:.4g} vs peer median {d.median:.4g} (z={d.z:+.1f})" for d in v
                )
                flags.append(PeerFlag(k[0], k[1], False, reasons, tuple(v), self._streak[k]))
        return flags


@dataclass
class NodeVerdict:
    node: str
    flags: list[PeerFlag] = field(default_factory=list)

    @property
    def hard(self) -> bool:
        return any(f.hard for f in self.flags)


def by_node(flags: list[PeerFlag]) -> dict[str, NodeVerdict]:
    out: dict[str, NodeVerdict] = {}
    for f in flags:
        out.setdefault(f.node, NodeVerdict(f.node)).flags.append(f)
    return out
