"""NIC link check through sysfs (slurmguard.telemetry.infiniband).

A port that is not ACTIVE is a failure (hard_failures: "link down"), and so is
an unreadable port. Optional: fewer than `min_ports` ACTIVE ports, or an
ACTIVE port negotiated below `min_rate_gbps` (a 400 Gb/s NDR link that came up
at 200 is a classic grey failure). `ports` limits the check to fnmatch
patterns like "mlx5_*:1", so unused or management ports can be left out.
A node without InfiniBand/RoCE devices passes unless min_ports asks for some.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from slurmguard.detect.peers import hard_failures
from slurmguard.nodecheck.checks import Progress
from slurmguard.telemetry.base import Signal
from slurmguard.telemetry.infiniband import InfinibandSource

#: IBA PortPhysicalState names (sysfs phys_state "5: LinkUp")
PHYS_STATES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "PhyTest",
}


class NicLinkCheck:
    """Every selected IB/RoCE port is ACTIVE (and fast enough, and enough of them)."""

    name = "nic_link"

    def __init__(
        self,
        node: str,
        root: str | Path = "/sys/class/infiniband",
        *,
        ports: tuple[str, ...] = (),
        min_ports: int = 0,
        min_rate_gbps: float | None = None,
        call_timeout_s: float = 2.0,
    ) -> None:
        self.node = node
        self.root = Path(root)
        self.ports = tuple(ports)
        self.min_ports = min_ports
        self.min_rate_gbps = min_rate_gbps
        self.call_timeout_s = call_timeout_s

    def _selected(self, nic: str | None) -> bool:
        return nic is not None and (not self.ports or any(fnmatchcase(nic, p) for p in self.ports))

    def run(self, progress: Progress) -> list[str]:
        progress.at(f"reading {self.root}")
        src = InfinibandSource(self.node, self.root, timeout_s=self.call_timeout_s)
        reading = src.sample()
        out = []
        for ev in reading.events:
            if ev.kind == "timeout":
                out.append(f"sysfs read did not finish: {ev.detail}")
            elif ev.kind == "error" and (ev.nic is None or self._selected(ev.nic)):
                out.append(ev.detail)
        phys = {s.nic: int(s.value) for s in reading.samples if s.signal == Signal.NIC_PHYS_STATE}
        rate = {s.nic: s.value for s in reading.samples if s.signal == Signal.NIC_RATE}
        state = {
            s.nic: s.value
            for s in reading.samples
            if s.signal == Signal.NIC_STATE and s.nic is not None and self._selected(s.nic)
        }
        for flag in hard_failures(
            [s for s in reading.samples if s.signal == Signal.NIC_STATE and self._selected(s.nic)]
        ):
            p = phys.get(flag.device, 0)
            out.append(
                f"{flag.device}: {', '.join(flag.reasons)} (port not ACTIVE, "
                f"phys_state {p}: {PHYS_STATES.get(p, 'unknown')})"
            )
        active = sorted(n for n, v in state.items() if v >= 1)
        if self.min_rate_gbps is not None:
            for nic in active:
                if rate.get(nic, 0.0) < self.min_rate_gbps:
                    out.append(
                        f"{nic}: link at {rate.get(nic, 0.0):g} Gb/s, below {self.min_rate_gbps:g} Gb/s"
                    )
        if len(active) < self.min_ports:
            where = (
                f"{len(state)} selected port(s) under {self.root}"
                if state
                else f"no selected port under {self.root}"
            )
            out.append(f"{len(active)} ACTIVE port(s), {self.min_ports} required ({where})")
        return out
