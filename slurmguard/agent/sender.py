"""Deliver reports to the controller: signed, bounded buffer, retry with backoff.

While the controller is unreachable reports queue up to `max_reports`; past
that the oldest are dropped and counted (reports are rolling windows, so the
newest one carries the most). Delivery is in order, oldest first.

Each report is stamped here with this sender's epoch (its start, Unix ns) and
the next sequence number, so (epoch, seq) grows across agent restarts and the
controller takes a restarted agent's first report. A report counts as
delivered only when the controller answered 200 with "accepted": true; a
refusal (4xx, or accepted: false) is counted in `rejected`, logged, and not
retried (the next report carries the newer window).
"""

from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request
from collections import deque
from typing import Callable

from slurmguard.reports import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, sign

log = logging.getLogger(__name__)


class ReportSender:
    def __init__(self, url: str, key: bytes, *, timeout_s: float = 5.0, max_reports: int = 1000,
                 now: Callable[[], float], ca_file: str | None = None) -> None:
        """key: this node's report key (reports.node_key); ca_file: CA of an https controller."""
        self.url = url.rstrip("/") + "/v1/report"
        self.key = key
        self.epoch = int(now() * 1e9)
        self._seq = 0
        self._ssl = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
        self.timeout_s = timeout_s
        self.queue: deque[AgentReport] = deque(maxlen=max_reports)
        self.now = now
        self.dropped = 0
        self.sent = 0
        self.failures = 0
        self.rejected = 0
        self._retry_at = 0.0
        self._backoff = 1.0

    def enqueue(self, report: AgentReport) -> AgentReport:
        """Queue the report under this sender's (epoch, next seq); returns what is sent."""
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self._seq += 1
        report = report.model_copy(update={"epoch": self.epoch, "seq": self._seq})
        self.queue.append(report)
        return report

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
            "Content-Type": "application/json", TIME_HEADER: ts, NODE_HEADER: report.node,
            SIG_HEADER: sign(self.key, ts, report.node, body)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                answer = resp.read(4096)
            try:
                accepted = json.loads(answer).get("accepted") is True
            except (ValueError, AttributeError):
                accepted = False
            if not accepted:
                log.error("controller did not accept report %d: %s", report.seq,
                          answer[:200].decode(errors="replace"))
                return "rejected"
            return "ok"
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                log.warning("controller answered HTTP %d; will retry", exc.code)
                return "retry"
            if 400 <= exc.code < 500:
                # the controller will never take this report: do not block the queue on it
                log.error("controller rejected report %d: HTTP %d %s", report.seq, exc.code,
                          exc.read(200).decode(errors="replace"))
                return "rejected"
            log.warning("controller answered HTTP %d; will retry", exc.code)
            return "retry"
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            log.warning("controller unreachable (%s); %d report(s) queued", exc, len(self.queue))
            return "retry"
