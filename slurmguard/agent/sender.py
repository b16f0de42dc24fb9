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

Reports go over one kept-alive HTTP/1.1 connection (the controller's
keepalive_idle_s is longer than the report interval), opened again when the
controller has closed it. No HTTP proxy is used (http_proxy and the like are
ignored): the controller is on the cluster's own network.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import urllib.parse
from collections import deque
from collections.abc import Callable

from slurmguard.errors import ConfigError
from slurmguard.wire import (
    CONTENT_TYPE,
    NODE_HEADER,
    SIG_HEADER,
    TIME_HEADER,
    AgentReport,
    encode_report,
    sign,
)

log = logging.getLogger(__name__)

#: telemetry samples merged into one request at most: the controller's default
#: controller.keep_samples_per_node, about 0.5 MB of JSON (controller.max_body_bytes: 1 MB)
BATCH_SAMPLES = 4096
#: most bytes of an answer read (the controller's are a line of JSON)
_MAX_ANSWER = 65536


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
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"agent.controller_url {url!r}: expected http(s)://HOST[:PORT]")
        self._host, self._port = parts.hostname, parts.port
        self._path = parts.path
        self._conn: http.client.HTTPConnection | None = None
        """Kept alive between reports (controller.keepalive_idle_s)."""
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

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._ssl is not None:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.timeout_s, context=self._ssl
                )
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        return self._conn

    def close(self) -> None:
        """Close the connection to the controller (the next request opens one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _exchange(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """(status, answer body) of one POST on the kept-alive connection. The
        controller closes a connection idle for its controller.keepalive_idle_s or
        full (max_idle_connections); a request that finds it closed before any answer
        came is sent once more on a new connection (it was not read, so it is not
        taken twice; a duplicate would be refused as not newer anyway)."""
        for attempt in (1, 2):
            conn = self._connection()
            reused = conn.sock is not None
            try:
                conn.request("POST", self._path, body=body, headers=headers)
                resp = conn.getresponse()
                answer = resp.read(_MAX_ANSWER)
                if not resp.isclosed():  # an answer longer than any the controller gives
                    self.close()
                return resp.status, answer
            except (ConnectionResetError, BrokenPipeError, http.client.BadStatusLine):
                # RemoteDisconnected is both: the controller closed the idle connection
                self.close()
                if not reused or attempt == 2:
                    raise
            except BaseException:
                self.close()  # the connection's state is unknown: never reuse it
                raise
        raise AssertionError("unreachable")

    def _post(self, report: AgentReport) -> str:
        body = encode_report(report)
        ts = f"{self.now():.3f}"
        headers = {
            "Content-Type": CONTENT_TYPE,
            TIME_HEADER: ts,
            NODE_HEADER: report.node,
            SIG_HEADER: sign(self.key, ts, report.node, body),
        }
        try:
            status, answer = self._exchange(body, headers)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("controller unreachable (%s); %d report(s) queued", exc, len(self.queue))
            return "retry"
        if status == 429 or status >= 500:
            log.warning("controller answered HTTP %d; will retry", status)
            return "retry"
        accepted = False
        if status < 400:
            try:
                accepted = status == 200 and json.loads(answer).get("accepted") is True
            except (ValueError, AttributeError):
                pass
        if not accepted:
            # the controller will never take this report (a 4xx, or an answer that is
            # not an acceptance): do not block the queue on it
            log.error(
                "controller %s report %d: HTTP %d %s",
                "rejected" if status >= 400 else "did not accept",
                report.seq,
                status,
                answer[:200].decode(errors="replace"),
            )
            return "rejected"
        return "ok"
