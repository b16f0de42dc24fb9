"""The controller process: HTTP ingest in a thread, cycles in the main thread,
clean shutdown on SIGTERM/SIGINT (the current cycle finishes, then the HTTP
server and the database close).

On PostgreSQL several controllers may run against one database: only the one
holding the lease (controller.lease) runs cycles and acts; the others ingest
reports, answer /healthz ("standby") and try to take the lease every
controller.lease_retry_s."""

from __future__ import annotations

import gc
import logging
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmguard.clock import Clock, SystemClock
from slurmguard.config import Policy
from slurmguard.controller.loop import Controller
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP
from slurmguard.errors import ConfigError
from slurmguard.service import stop_on_signals
from slurmguard.slurm.client import SlurmClient
from slurmguard.store import Store

if TYPE_CHECKING:
    from slurmguard.respond.actions import ActionExecutor
    from slurmguard.sweeps.scheduler import SweepScheduler
    from slurmguard.wire import AgentReport

log = logging.getLogger(__name__)


#: a report that wakes the cycle (Controller.wants_cycle) runs it no sooner than
#: this fraction of controller.cycle_interval_s after the last one began, and
#: no sooner than WAKE_DUTY times that cycle's own duration after it ended, so
#: that slow jobs' reports arriving from many nodes at different moments keep
#: the controller at most about 1 / (1 + WAKE_DUTY) busy, not in back-to-back cycles
WAKE_GAP_FRACTION = 0.2
WAKE_DUTY = 1.0

#: the cyclic collector's thresholds in the controller process (Python's default: 700, 10, 10)
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc() -> None:
    """Set up Python's cyclic garbage collector for a process that keeps every node's
    latest report (about 45 objects each, replaced every report interval), once, at
    start-up (the controller command calls it; not run(), which tests call in-process).

    With the default thresholds a report's objects lived long enough to be walked by
    the collector's older generations, and every quarter of the fleet replaced set off
    a walk over all of it: at 10,000 nodes that was about 0.1 ms of CPU a report, as
    much as parsing it (`slurmguard bench scale`). A generation 0 of GC_THRESHOLDS[0]
    objects sees most reports replaced before they are promoted, so the full walks
    become rare; what is garbage in cycles is still found, within 50,000 allocations
    while young (a pause of some tens of ms a collection). The objects of start-up (modules,
    policy, the database engine) live as long as the process: frozen, so that no
    collection walks them again."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class DaemonOptions:
    host: str
    port: int
    secret: bytes
    interval_s: float
    once: bool = False
    sweeps: bool = True


def say_held_back(now: list[str], before: set[str]) -> set[str]:
    """Log the actions held back this cycle (CycleResult.suppressed) that were
    not held back the cycle before; the set to pass next cycle."""
    for why in sorted(set(now) - before):
        log.warning("action held back: %s", why)
    return set(now)


def wait_for_cycle(
    clock: Clock, stop: threading.Event, wake: threading.Event, began: float, interval_s: float
) -> None:
    """Wait for the next cycle: interval_s after the last one began (clock's
    monotonic s; a cycle longer than that is followed at once), or sooner once
    `wake` is set, but not before WAKE_GAP_FRACTION of the interval after it
    began nor WAKE_DUTY times its duration after it ended. Returns at once on
    `stop`. The waits themselves are the events' (real seconds), as before."""
    ended = clock.monotonic()
    due = max(0.0, began + interval_s - ended)
    earliest = min(due, max(0.0, began + WAKE_GAP_FRACTION * interval_s - ended, WAKE_DUTY * (ended - began)))
    if stop.wait(earliest):
        return
    left = due - earliest
    # in slices, so that a stop ends the wait as promptly as a wake does
    while left > 0 and not stop.is_set():
        if wake.wait(min(left, 0.1)):
            break
        left -= 0.1
    wake.clear()


def _sweeper(
    policy: Policy, store: Store, slurm: SlurmClient, clock: Clock, executor: ActionExecutor
) -> SweepScheduler | None:
    """The sweep scheduler when that part is installed; None otherwise."""
    try:
        from slurmguard.sweeps.scheduler import build_scheduler
    except ImportError:
        log.warning("sweep scheduler not available: drained nodes wait for an admin")
        return None
    return build_scheduler(policy=policy, store=store, slurm=slurm, clock=clock, executor=executor)


def _listen_error(policy: Policy, opts: DaemonOptions, exc: OSError) -> str:
    """What an admin reads when the HTTP side cannot start: the address (a port
    in use, a host not on this machine) or the TLS files, with the keys to fix."""
    c = policy.controller
    why = exc.strerror or str(exc)
    if exc.filename or isinstance(exc, ssl.SSLError):
        files = exc.filename or f"{c.tls_cert_file}, {c.tls_key_file}"
        return f"controller cannot load its TLS certificate or key ({files}): {why} (controller.tls_cert_file, tls_key_file)"
    where = f"{opts.host}:{opts.port}"
    if c.management_host:
        where += f" or {c.management_host}:{c.management_port}"
    return f"controller cannot listen on {where}: {why} (controller.listen_host, listen_port, --listen)"


def run(
    policy: Policy,
    store: Store,
    slurm: SlurmClient,
    opts: DaemonOptions,
    clock: Clock | None = None,
    stop: threading.Event | None = None,
) -> int:
    clock = clock or SystemClock()
    stop = stop or threading.Event()
    # before anything slow: a stop during start-up (systemd, a test harness) is
    # then logged and honoured at the first cycle, not Python's silent default
    stop_on_signals(stop, log, "finishing the current cycle and shutting down")
    metrics = ControllerMetrics()
    ctl = Controller(policy, store, slurm, clock, metrics=metrics)
    lease = None
    if store.engine.url.get_backend_name() == "postgresql":
        from slurmguard.controller.lease import Lease

        lease = Lease(store, timeout_s=policy.controller.lease_timeout_s)
        ctl.executor.fence = lease.fence
        metrics.leader.set(0)  # standby until the first hold() says otherwise
    if opts.sweeps:
        ctl.sweeper = _sweeper(policy, store, slurm, clock, ctl.executor)

    def health() -> tuple[bool, str]:
        if lease is not None and not lease.held:
            return True, "standby (another controller holds the lease)"
        role = "" if lease is None else f"active (lease epoch {lease.epoch}); "
        last = metrics.last_cycle._value.get()  # noqa: SLF001 - our own gauge
        if last == 0:
            return True, role + "starting"
        age = clock.now() - last
        ok = age <= max(3 * opts.interval_s, 30.0)
        return ok, f"{role}last cycle {age:.0f}s ago"

    wake = threading.Event()

    def ingest(report: AgentReport) -> bool:
        kept = ctl.fleet.ingest(report, clock.now())
        if kept and ctl.wants_cycle(report):
            wake.set()
        return kept

    try:
        http = ControllerHTTP(
            opts.host,
            opts.port,
            secret=opts.secret,
            ingest=ingest,
            metrics=metrics,
            now=clock.now,
            health=health,
            plan=ctl.plans.served,
            policy=policy.controller,
            known=ctl.fleet.known,
        )
    except OSError as exc:
        raise ConfigError(_listen_error(policy, opts, exc)) from None
    http.start()
    c = policy.controller
    log.info(
        "controller listening on %s://%s:%d%s (dry_run=%s)",
        "https" if c.tls_cert_file else "http",
        opts.host,
        http.port,
        f", management on {c.management_host}:{http.management_port}" if c.management_host else "",
        policy.safety.dry_run,
    )

    # an action held back (a node drained by someone else, an admin's comment, the
    # circuit breaker) is said once when it starts, not every cycle while it lasts
    held_back: set[str] = set()
    try:
        while not stop.is_set():
            began = clock.monotonic()
            if lease is not None:
                leading = lease.hold()
                metrics.leader.set(1 if leading else 0)
                metrics.lease_epoch.set(lease.epoch or 0)
                if not leading:
                    ctl.stand_by()
                    if opts.once:
                        break
                    stop.wait(policy.controller.lease_retry_s)
                    continue
            res = ctl.cycle()
            for action, target in res.actions:
                log.info("action %s %s", action, target)
            for why in res.errors:
                log.error("cycle error: %s", why)
            held_back = say_held_back(res.suppressed, held_back)
            if opts.once:
                break
            wait_for_cycle(clock, stop, wake, began, opts.interval_s)
    finally:
        if lease is not None:
            lease.release()
        http.stop()
        store.close()
        log.info("controller stopped")
    return 0
