"""InfiniBand / RoCE port counters from sysfs (/sys/class/infiniband).

Layout (kernel ABI, Documentation/ABI/stable/sysfs-class-infiniband):
  <root>/<dev>/ports/<port>/state        "4: ACTIVE"   (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE)
  <root>/<dev>/ports/<port>/phys_state   "5: LinkUp"   (3 Disabled, 2 Polling, ...)
  <root>/<dev>/ports/<port>/rate         "400 Gb/sec (4X NDR)"
  <root>/<dev>/ports/<port>/link_layer   "InfiniBand" or "Ethernet" (RoCE)
  <root>/<dev>/ports/<port>/counters/*   port_xmit_data, port_rcv_data (in 4-octet
        words), symbol_error, port_rcv_errors, link_downed, port_xmit_wait, ...
  <root>/<dev>/ports/<port>/counters_ext/*_64  64-bit data/packet counters (MLNX_OFED)
  <root>/<dev>/ports/<port>/hw_counters/*  mlx5 RDMA counters (np_cnp_sent,
        rp_cnp_handled, out_of_sequence, local_ack_timeout_err, ...), 64-bit
`root` is a parameter so tests read a recorded tree.

Counter widths (IBA PortCounters as the kernel prints them, drivers/infiniband/
core/sysfs.c): the error counters are 4, 8 or 16 bits wide and port_xmit_wait
32; they *saturate* (stop at 2^w - 1), they do not wrap. A saturated counter
no longer moves, so a rate computed from it reads 0 while errors go on: such
a rate is reported unavailable (once) instead, until the counters are reset.
The data counters are 64-bit when the HCA has extended counters (the kernel
then serves PortCountersExtended under the same names) and 32-bit otherwise;
a 64-bit counters_ext/port_*_data_64 is preferred where present.

Which ports matter: `expected` fnmatch patterns ("mlx5_*:1") from the policy,
or, without them, the ports seen ACTIVE since the agent started (the node's
healthy state). A non-ACTIVE port that is not expected (uncabled, storage,
an Ethernet port nobody uses) is not a link down and is not sampled; an
expected port that is not ACTIVE, or that vanished, is.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from slurmguard.clock import Clock, SystemClock
from slurmguard.telemetry.base import (
    WHOLE_SOURCE,
    CounterRates,
    Deadline,
    Reading,
    Signal,
    SourceEvent,
    SourceTimeout,
    Unavailable,
    sample,
)

ERROR_COUNTERS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "link_error_recovery",
    "port_rcv_constraint_errors",
    "port_xmit_constraint_errors",
)
HW_ERROR_COUNTERS = (
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "rnr_nak_retry_err",
    "implied_nak_seq_err",
)
CONGESTION_HW = ("rp_cnp_handled", "np_ecn_marked_roce_packets")

#: bits of each counters/ file (kernel PORT_PMA_ATTR widths); saturates at 2^bits - 1
COUNTER_BITS = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
}
#: data counters: 64-bit with extended counters, else 32-bit (then pegged at 2^32 - 1)
DATA_COUNTERS = ("port_xmit_data", "port_rcv_data")
STATE_ACTIVE = 4


def saturated(name: str, value: int) -> bool:
    """True when counter `name` stopped at its maximum (it saturates, never wraps)."""
    bits = COUNTER_BITS.get(name)
    if bits is not None:
        return value >= (1 << bits) - 1
    if name in DATA_COUNTERS:
        return value == (1 << 32) - 1  # a 32-bit PortCounters data counter, pegged
    return False


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


class ExpectedPorts:
    """Which ports are expected up: policy patterns, or learned from healthy state.

    patterns None: every port (a node check that names its ports itself).
    With patterns, a port is expected iff one matches. Empty: a port becomes
    expected the first time it is seen ACTIVE and stays expected (it going
    down later is a link down; one that was never up is not).
    """

    def __init__(self, patterns: tuple[str, ...] | list[str] | None = ()) -> None:
        self.every = patterns is None
        self.patterns = tuple(patterns or ())
        self.learned: set[tuple[str, str]] = set()  # (node, port)

    def expected(self, node: str, port: str, active: bool) -> bool:
        if self.every:
            return True
        if self.patterns:
            return any(fnmatchcase(port, p) for p in self.patterns)
        if active:
            self.learned.add((node, port))
        return (node, port) in self.learned

    def missing(self, node: str, seen: set[str]) -> list[str]:
        """Learned ports of `node` that are gone (an HCA that fell off the bus)."""
        return sorted(p for n, p in self.learned if n == node and p not in seen)

    def describe(self) -> str:
        return (
            f"agent.telemetry.ib_expected_ports {list(self.patterns)}"
            if self.patterns
            else "not seen ACTIVE since the agent started"
        )


class CounterSet:
    """Counters read for one rate: their sum, and which of them are pegged."""

    def __init__(self) -> None:
        self.total = 0
        self.pegged: list[str] = []

    def add(self, name: str, value: int | None, scale: int = 1) -> None:
        if value is None:
            return
        self.total += value * scale
        if saturated(name, value):
            bits = COUNTER_BITS.get(name, 32)
            self.pegged.append(f"{name}={value} ({bits}-bit, saturated)")


def emit_rate(
    out: Reading,
    rates: CounterRates,
    unavailable: Unavailable,
    node: str,
    nic: str,
    signal: str,
    key: str,
    counters: CounterSet,
    ts: float,
    scale: float = 1.0,
) -> None:
    """The per-second rate of `counters`, or 'unavailable' while one is saturated."""
    if counters.pegged:
        rates.rate((node, nic, key), counters.total, ts)  # keep the baseline for after a reset
        unavailable.mark(
            out,
            node,
            signal,
            f"{nic}: {', '.join(counters.pegged)}: the rate would read 0 "
            "while errors go on; reset the port counters (perfquery -R) to resume",
            ts,
            nic=nic,
        )
        return
    unavailable.clear(out, node, signal, ts, nic=nic)
    r = rates.rate((node, nic, key), counters.total, ts)
    if r is not None:
        out.samples.append(sample(node, signal, r * scale, ts, nic=nic))


class InfinibandSource:
    """Samples the expected IB/RoCE ports under `root`."""

    name = "infiniband"

    def __init__(
        self,
        node: str,
        root: str | Path = "/sys/class/infiniband",
        *,
        clock: Clock | None = None,
        timeout_s: float = 2.0,
        expected_ports: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        self.node = node
        self.root = Path(root)
        self.clock = clock or SystemClock()
        self.deadline = Deadline(timeout_s)
        self.rates = CounterRates()
        self.expected = ExpectedPorts(expected_ports)
        self.unavailable = Unavailable(self.name)
        self._ignored: set[str] = set()

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
            self.unavailable.mark(
                out, self.node, WHOLE_SOURCE, f"{self.root}: no InfiniBand/RoCE devices", ts
            )
            return out
        self.unavailable.clear(out, self.node, WHOLE_SOURCE, ts)
        seen: set[str] = set()
        for dev in sorted(p for p in self.root.iterdir() if (p / "ports").is_dir()):
            for port in sorted((dev / "ports").iterdir(), key=lambda p: p.name):
                seen.add(f"{dev.name}:{port.name}")
                self._port(out, dev.name, port, ts)
        for nic in self.expected.missing(self.node, seen):
            out.samples.append(sample(self.node, Signal.NIC_STATE, 0, ts, nic=nic))
            out.events.append(
                SourceEvent(
                    self.node,
                    self.name,
                    "error",
                    f"{nic}: expected port missing from {self.root}",
                    ts,
                    nic=nic,
                )
            )
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
            out.events.append(
                SourceEvent(node, self.name, "error", f"{port}: unparsable: {exc}", ts, nic=nic)
            )
            return
        if not self.expected.expected(node, nic, state == STATE_ACTIVE):
            if nic not in self._ignored:
                self._ignored.add(nic)
                layer = _read(port / "link_layer") or "unknown link layer"
                out.events.append(
                    SourceEvent(
                        node,
                        self.name,
                        "info",
                        f"{nic} ({layer}, state {st}): not an "
                        f"expected port ({self.expected.describe()}); ignored",
                        ts,
                        nic=nic,
                    )
                )
            return
        self._ignored.discard(nic)
        out.samples.append(sample(node, Signal.NIC_STATE, 1 if state == STATE_ACTIVE else 0, ts, nic=nic))
        out.samples.append(sample(node, Signal.NIC_PHYS_STATE, phys, ts, nic=nic))
        out.samples.append(sample(node, Signal.NIC_RATE, rate if state == STATE_ACTIVE else 0.0, ts, nic=nic))
        c, ext, hw = port / "counters", port / "counters_ext", port / "hw_counters"
        # port_{xmit,rcv}_data count 4-octet words (IBA PortCounters); prefer 64-bit
        for name, sig in (("port_xmit_data", Signal.NIC_TX_BYTES), ("port_rcv_data", Signal.NIC_RX_BYTES)):
            wide = _int(ext / f"{name}_64")
            words = wide if wide is not None else _int(c / name)
            if words is None:
                continue
            out.samples.append(sample(node, sig, words * 4, ts, nic=nic))
            if sig == Signal.NIC_TX_BYTES:
                cs = CounterSet()
                cs.add(f"{name}_64" if wide is not None else name, words, scale=4)
                emit_rate(
                    out, self.rates, self.unavailable, node, nic, Signal.NIC_TX_GBPS, "tx", cs, ts, 8 / 1e9
                )
        errs = CounterSet()
        for n in ERROR_COUNTERS:
            errs.add(n, _int(c / n))
        for n in HW_ERROR_COUNTERS:
            errs.add(n, _int(hw / n))
        out.samples.append(sample(node, Signal.NIC_ERRORS, errs.total, ts, nic=nic))
        emit_rate(out, self.rates, self.unavailable, node, nic, Signal.NIC_ERROR_RATE, "err", errs, ts)
        downed = _int(c / "link_downed")
        if downed is not None:
            out.samples.append(sample(node, Signal.NIC_LINK_DOWNED, downed, ts, nic=nic))
            if saturated("link_downed", downed):
                self.unavailable.mark(
                    out,
                    node,
                    Signal.NIC_LINK_DOWNED,
                    f"{nic}: link_downed={downed} (8-bit, saturated): new flaps no longer count",
                    ts,
                    nic=nic,
                )
        cong = CounterSet()
        cong.add("port_xmit_wait", _int(c / "port_xmit_wait"))
        for n in CONGESTION_HW:
            cong.add(n, _int(hw / n))
        out.samples.append(sample(node, Signal.NIC_CONGESTION, cong.total, ts, nic=nic))
        emit_rate(out, self.rates, self.unavailable, node, nic, Signal.NIC_CONGESTION_RATE, "cong", cong, ts)
