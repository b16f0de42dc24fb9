"""InfiniBand / RoCE port counters from sysfs (/sys/class/infiniband).

Layout (kernel ABI, Documentation/ABI/stable/sysfs-class-infiniband):
  <root>/<dev>/ports/<port>/state        "4: ACTIVE"   (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE)
  <root>/<dev>/ports/<port>/phys_state   "5: LinkUp"   (3 Disabled, 2 Polling, ...)
  <root>/<dev>/ports/<port>/rate         "400 Gb/sec (4X NDR)"
  <root>/<dev>/ports/<port>/link_layer   "InfiniBand" or "Ethernet" (RoCE)
  <root>/<dev>/ports/<port>/counters/*   port_xmit_data, port_rcv_data (in 4-octet
        words), symbol_error, port_rcv_errors, link_downed, port_xmit_wait, ...
  <root>/<dev>/ports/<port>/hw_counters/*  mlx5 RDMA counters (np_cnp_sent,
        rp_cnp_handled, out_of_sequence, local_ack_timeout_err, ...)
`root` is a parameter so tests read a recorded tree.
"""

from __future__ import annotations

from pathlib import Path

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import CounterRates, Deadline, Reading, Signal, SourceEvent, SourceTimeout, sample

ERROR_COUNTERS = ("symbol_error", "port_rcv_errors", "port_rcv_remote_physical_errors",
                  "port_xmit_discards", "local_link_integrity_errors",
                  "excessive_buffer_overrun_errors", "link_error_recovery",
                  "port_rcv_constraint_errors", "port_xmit_constraint_errors")
HW_ERROR_COUNTERS = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err",
                     "rnr_nak_retry_err", "implied_nak_seq_err")
CONGESTION_HW = ("rp_cnp_handled", "np_ecn_marked_roce_packets")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, PermissionError, OSError):
        return None


def _int(path: Path) -> int | None:
    s = _read(path)
    if s is None:
        return None
    try:
        return int(s)
    except ValueError:
        return None


def parse_state(text: str) -> int:
    """'4: ACTIVE' -> 4."""
    return int(text.split(":", 1)[0])


def parse_rate_gbps(text: str) -> float:
    """'400 Gb/sec (4X NDR)' -> 400.0; '25 Gb/sec (1X EDR)' -> 25.0."""
    return float(text.split()[0])


class InfinibandSource:
    """Samples every IB/RoCE port under `root`."""

    name = "infiniband"

    def __init__(self, node: str, root: str | Path = "/sys/class/infiniband", *,
                 clock: Clock | None = None, timeout_s: float = 2.0) -> None:
        self.node = node
        self.root = Path(root)
        self.clock = clock or SystemClock()
        self.deadline = Deadline(timeout_s)
        self.rates = CounterRates()

    def close(self) -> None:
        pass

    def sample(self) -> Reading:
        ts = self.clock.now()
        try:
            return self.deadline.call(self._scan, ts)
        except SourceTimeout as exc:
            r = Reading()
            r.events.append(SourceEvent(self.node, self.name, "timeout", f"{self.root}: {exc}", ts))
            return r

    def _scan(self, ts: float) -> Reading:
        out = Reading()
        if not self.root.is_dir():
            out.events.append(SourceEvent(self.node, self.name, "unsupported",
                                          f"{self.root}: no InfiniBand devices", ts))
            return out
        for dev in sorted(p for p in self.root.iterdir() if (p / "ports").is_dir()):
            for port in sorted((dev / "ports").iterdir(), key=lambda p: p.name):
                self._port(out, dev.name, port, ts)
        return out

    def _port(self, out: Reading, dev: str, port: Path, ts: float) -> None:
        nic = f"{dev}:{port.name}"
        node = self.node
        st = _read(port / "state")
        if st is None:
            out.events.append(SourceEvent(node, self.name, "error", f"{port}/state unreadable", ts, nic=nic))
            return
        try:
            state = parse_state(st)
            phys = parse_state(_read(port / "phys_state") or "0: unknown")
            rate = parse_rate_gbps(_read(port / "rate") or "0 Gb/sec")
        except (ValueError, IndexError) as exc:
            out.events.append(SourceEvent(node, self.name, "error", f"{port}: unparsable: {exc}", ts, nic=nic))
            return
        out.samples.append(sample(node, Signal.NIC_STATE, 1 if state == 4 else 0, ts, nic=nic))
        out.samples.append(sample(node, Signal.NIC_PHYS_STATE, phys, ts, nic=nic))
        out.samples.append(sample(node, Signal.NIC_RATE, rate if state == 4 else 0.0, ts, nic=nic))
        c = port / "counters"
        # port_{xmit,rcv}_data count 4-octet words (IBA PortCounters)
        for name, sig in (("port_xmit_data", Signal.NIC_TX_BYTES), ("port_rcv_data", Signal.NIC_RX_BYTES)):
            v = _int(c / name)
            if v is not None:
                out.samples.append(sample(node, sig, v * 4, ts, nic=nic))
                if sig == Signal.NIC_TX_BYTES:
                    r = self.rates.rate((nic, "tx"), v * 4, ts)
                    if r is not None:
                        out.samples.append(sample(node, Signal.NIC_TX_GBPS, r * 8 / 1e9, ts, nic=nic))
        hw = port / "hw_counters"
        errs = sum(v for v in (_int(c / n) for n in ERROR_COUNTERS) if v is not None)
        errs += sum(v for v in (_int(hw / n) for n in HW_ERROR_COUNTERS) if v is not None)
        out.samples.append(sample(node, Signal.NIC_ERRORS, errs, ts, nic=nic))
        r = self.rates.rate((nic, "err"), errs, ts)
        if r is not None:
            out.samples.append(sample(node, Signal.NIC_ERROR_RATE, r, ts, nic=nic))
        downed = _int(c / "link_downed")
        if downed is not None:
            out.samples.append(sample(node, Signal.NIC_LINK_DOWNED, downed, ts, nic=nic))
        cong = sum(v for v in (_int(c / "port_xmit_wait"), *(_int(hw / n) for n in CONGESTION_HW))
                   if v is not None)
        out.samples.append(sample(node, Signal.NIC_CONGESTION, cong, ts, nic=nic))
        r = self.rates.rate((nic, "cong"), cong, ts)
        if r is not None:
            out.samples.append(sample(node, Signal.NIC_CONGESTION_RATE, r, ts, nic=nic))
