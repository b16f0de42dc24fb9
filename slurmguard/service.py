"""What every long-running slurmguard process shares: its logging and how it stops.

The node agent and the controller call these two and nothing else of the kind, so
both log in one format and both stop the same way: SIGTERM (systemd, slurmd) or
SIGINT sets a stop event; the daemon finishes the cycle it is in, then exits.

Loggers are named by module (`logging.getLogger(__name__)`) under "slurmguard", so
`setup_logging` sets level and format for all of them in one place.
"""

from __future__ import annotations

import logging
import signal
import threading

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(verbose: int = 0) -> None:
    """Root logging for a daemon: INFO, DEBUG from -vv on (verbose = count of -v)."""
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO, format=LOG_FORMAT)


def stop_on_signals(stop: threading.Event, log: logging.Logger, doing: str = "stopping") -> None:
    """Set `stop` on SIGTERM or SIGINT (logged as `doing`).

    Signal handlers can only be installed from the main thread; a daemon run in a
    thread (tests, the dev cluster) is stopped through the event alone.
    """

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d: %s", signum, doing)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
