"""Deliver reports to the controller: signed, bounded buffer, retry with backoff.

While the controller is unreachable reports queue up to `max_reports`; past
that the oldest are dropped and counted (reports are rolling windows, so the
newest one carries the most). Delivery is in order, oldest first, and a backlog
goes in as few requests as it can: queued reports are merged into one (the
newest one's step windows, state and sequence number, with the telemetry
samples and events of all of them in order, at most `batch_samples` samples a
request), so a node that was cut off for an hour catches up in a few requests,
not 360, and no sample is lost or sent twice.

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
from collections.abc import Callable

from slurmguard.wire import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, sign

log = logging.getLogger(__name__)

#: telemetry samples merged into one request at most: the controller's default
#: controller.keep_samples_per_node, about 0.5 MB of JSON (controller.max_body_bytes: 1 MB)
BATCH_SAMPLES = 4096


class ReportSender:
    def __init__(
        self,
        url: str,
        key: bytes,
        *,
        timeout_s: float = 5.0,
        max_reports: int = 1000,
        now: Callable[[], float],
        ca_file: str | None = None,
        batch_samples: int = BATCH_SAMPLES,
    ) -> None:
        """key: this node's report key (wire.node_key); ca_file: CA of an https
        controller; batch_samples: most telemetry samples merged into one request."""
        self.batch_samples = batch_samples
        self.requests = 0
        """Requests that delivered reports (a merged backlog is one)."""
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
        """Send queued reports until a request fails; returns how many reports were
        delivered (merged ones count each)."""
        now = self.now()
        if now < self._retry_at:
            return 0
        delivered = 0
        while self.queue:
            k, report = self._merged()
            outcome = self._post(report)
            if outcome == "retry":
                self.failures += 1
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 60.0)
                break
            for _ in range(k):
                self.queue.popleft()
            if outcome == "ok":
                delivered += k
                self.sent += k
                self.requests += 1
            else:
                self.rejected += k
        if delivered:
            self._backoff = 1.0
        return delivered

    def _merged(self) -> tuple[int, AgentReport]:
        """(k, one report standing for the oldest k queued): the k-th one with the
        telemetry and events of all k, k as large as batch_samples allows (>= 1)."""
        q = self.queue
        k, samples = 1, len(q[0].telemetry)
        while k < len(q) and samples + len(q[k].telemetry) <= self.batch_samples:
            samples += len(q[k].telemetry)
            k += 1
        if k == 1:
            return 1, q[0]
        parts = [q[i] for i in range(k)]
        return k, parts[-1].model_copy(
            update={
                "telemetry": [t for r in parts for t in r.telemetry],
                "events": [e for r in parts for e in r.events],
            }
        )

    def _post(self, report: AgentReport) -> str:
        body = report.model_dump_json().encode()
        ts = f"{self.now():.3f}"
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                TIME_HEADER: ts,
                NODE_HEADER: report.node,
                SIG_HEADER: sign(self.key, ts, report.node, body),
            },
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                answer = resp.read(4096)
            try:
                accepted = json.loads(answer).get("accepted") is True
            except (ValueError, AttributeError):
                accepted = False
            if not accepted:
                log.error(
                    "controller did not accept report %d: %s",
                    report.seq,
                    answer[:200].decode(errors="replace"),
                )
                return "rejected"
            return "ok"
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                log.warning("controller answered HTTP %d; will retry", exc.code)
                return "retry"
            if 400 <= exc.code < 500:
                # the controller will never take this report: do not block the queue on it
                log.error(
                    "controller rejected report %d: HTTP %d %s",
                    report.seq,
                    exc.code,
                    exc.read(200).decode(errors="replace"),
                )
                return "rejected"
            log.warning("controller answered HTTP %d; will retry", exc.code)
            return "retry"
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            log.warning("controller unreachable (%s); %d report(s) queued", exc, len(self.queue))
            return "retry"
