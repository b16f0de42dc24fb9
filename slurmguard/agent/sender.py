"""Deliver reports to the controller: signed, bounded buffer, retry with backoff.

While the controller is unreachable reports queue up to `max_reports`; past
that the oldest are dropped and counted (reports are rolling windows, so the
newest one carries the most). Delivery is in order, oldest first.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections import deque
from typing import Callable

from slurmguard.reports import SIG_HEADER, TIME_HEADER, AgentReport, sign

log = logging.getLogger("slurmguard.agent.sender")


class ReportSender:
    def __init__(self, url: str, secret: bytes, *, timeout_s: float = 5.0, max_reports: int = 1000,
                 now: Callable[[], float]) -> None:
        self.url = url.rstrip("/") + "/v1/report"
        self.secret = secret
        self.timeout_s = timeout_s
        self.queue: deque[AgentReport] = deque(maxlen=max_reports)
        self.now = now
        self.dropped = 0
        self.sent = 0
        self.failures = 0
        self.rejected = 0
        self._retry_at = 0.0
        self._backoff = 1.0

    def enqueue(self, report: AgentReport) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append(report)

    def flush(self) -> int:
        """Send queued reports until one fails; returns how many were delivered."""
        now = self.now()
        if now < self._retry_at:
            return 0
        delivered = 0
        while self.queue:
            report = self.queue[0]
            outcome = self._post(report)
            if outcome == "retry":
                self.failures += 1
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 60.0)
                break
            self.queue.popleft()
            if outcome == "ok":
                delivered += 1
                self.sent += 1
            else:
                self.rejected += 1
        if delivered:
            self._backoff = 1.0
        return delivered

    def _post(self, report: AgentReport) -> str:
        body = report.model_dump_json().encode()
        ts = f"{self.now():.3f}"
        req = urllib.request.Request(self.url, data=body, method="POST", headers={
            "Content-Type": "application/json", TIME_HEADER: ts, SIG_HEADER: sign(self.secret, ts, body)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
            return "ok"
        except urllib.error.HTTPError as exc:
            if exc.code in (400, 401, 422):
                # the controller will never take this report: do not block the queue on it
                log.error("controller rejected report %d: HTTP %d %s", report.seq, exc.code,
                          exc.read(200).decode(errors="replace"))
                return "rejected"
            log.warning("controller answered HTTP %d; will retry", exc.code)
            return "retry"
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            log.warning("controller unreachable (%s); %d report(s) queued", exc, len(self.queue))
            return "retry"
