"""Sim telemetry whose fault profiles live in a JSON file the demo can edit.

The file maps node -> profile (see slurmguard.telemetry.sim); when it changes
the source is rebuilt, so a fault starts (or ends) within one sample.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from slurmguard.clock import Clock
from slurmguard.telemetry.base import Reading
from slurmguard.telemetry.sim import SimTelemetrySource

log = logging.getLogger(__name__)


class SimFromFile:
    name = "sim"

    def __init__(self, path: str | Path, node: str, clock: Clock) -> None:
        self.path = Path(path)
        self.node = node
        self.clock = clock
        self._mtime: float | None = None
        self._src = SimTelemetrySource([node], None, clock=clock)

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            data = json.loads(self.path.read_text() or "{}")
            profiles = {n: v for n, v in data.items() if n == self.node}
            self._src = SimTelemetrySource([self.node], profiles, clock=self.clock)
            log.info("sim profiles for %s: %s", self.node, profiles or "healthy")
        except (ValueError, OSError) as exc:
            log.error("%s: ignored: %s", self.path, exc)

    def sample(self) -> Reading:
        self._reload()
        return self._src.sample()

    def close(self) -> None:
        self._src.close()
