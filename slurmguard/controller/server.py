"""The controller's HTTP endpoints (stdlib server, bounded worker pool).

POST /v1/report          signed AgentReport (see slurmguard.wire; wire format 2, or 1)
GET  /healthz            200 while cycles run, 503 when the last one is stale
GET  /metrics            Prometheus text format         } controller.read_clients only;
GET  /v1/jobs/<id>/plan  the job's mitigation plan      } on the management listener
                         (204 when there is none)       } when one is configured

The listener faces every node of the cluster, so nothing is done for a client
before it has shown who it is, and nothing it does can hold more than a bounded
share of the controller:
- `workers` threads serve connections; `max_pending` more wait; beyond that a
  connection is answered 503 and closed at once;
- every connection has `request_timeout_s` in total (a watchdog shuts the socket
  of a client that sends slowly), not per read;
- requests per client address and signed reports per node pass token buckets
  (429 past them);
- a report's Content-Length is checked against `max_body_bytes` before a byte
  of the body is read (413), the node, time and signature headers before the
  body is parsed (401/403), the body's node against the signed one after;
- TLS when `tls_cert_file`/`tls_key_file` are set.
Every refusal is a 4xx with a one-line reason in JSON and counted in /metrics
(`slurmguard_reports_total{outcome}` for reports, `slurmguard_http_refused_total
{reason}` for the rest).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import queue
import re
import socket
import socketserver
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from slurmguard.config import ControllerPolicy

if TYPE_CHECKING:
    from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.wire import (
    NODE_HEADER,
    NODE_NAME,
    SIG_HEADER,
    TIME_HEADER,
    AgentReport,
    check_time,
    verify,
)

log = logging.getLogger(__name__)

_ACCEPTED = b'{"accepted": true}'
_BUSY = b'{"error": "controller busy (all workers and queue slots taken): try again later"}'
_OVERLOADED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY), _BUSY)
)


#: most header lines a request may have, and the longest line (bytes)
MAX_HEADERS = 64
MAX_LINE = 8192
_REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class Headers(dict):
    """Request headers by lower-cased name (the last of repeated ones)."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class TokenBuckets:
    """Per-key token buckets (rate per second, burst); at most `max_keys` keys are
    remembered (the least recently used is forgotten, i.e. starts full again)."""

    def __init__(
        self, rate: float, burst: int, now: Callable[[], float] = time.monotonic, max_keys: int = 10000
    ) -> None:
        self.rate, self.burst, self.now, self.max_keys = rate, float(burst), now, max_keys
        self._b: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        t = self.now()
        with self._lock:
            tokens, last = self._b.pop(key, (self.burst, t))
            tokens = min(self.burst, tokens + (t - last) * self.rate)
            ok = tokens >= 1.0
            self._b[key] = (tokens - 1.0 if ok else tokens, t)
            while len(self._b) > self.max_keys:
                self._b.popitem(last=False)
            return ok


class _PoolServer(socketserver.TCPServer):
    """TCPServer whose accepted connections go to a fixed pool of worker threads."""

    allow_reuse_address = True

    def __init__(
        self,
        addr: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        workers: int,
        max_pending: int,
        timeout_s: float,
        tls: ssl.SSLContext | None,
        on_overload: Callable[[], None],
    ) -> None:
        self.timeout_s = timeout_s
        self.tls = tls
        self.on_overload = on_overload
        self._q: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self._active: dict[socket.socket, float] = {}
        self._active_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.address_family = family
        super().__init__(addr, handler)
        self._threads = [
            threading.Thread(target=self._work, name=f"controller-http-{i}", daemon=True)
            for i in range(workers)
        ]
        self._threads.append(
            threading.Thread(target=self._watchdog, name="controller-http-watchdog", daemon=True)
        )
        for t in self._threads:
            t.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            self._q.put_nowait((request, client_address, time.monotonic() + self.timeout_s))
        except queue.Full:
            self.on_overload()
            try:
                if self.tls is None:
                    request.settimeout(0.2)
                    request.sendall(_OVERLOADED)
            except OSError:
                pass
            self.shutdown_request(request)

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            sock, addr, deadline = item
            if time.monotonic() >= deadline:  # waited its whole time in the queue
                self.shutdown_request(sock)
                continue
            with self._active_lock:
                self._active[sock] = deadline
            conn = sock
            try:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                if self.tls is not None:
                    conn = self.tls.wrap_socket(sock, server_side=True)
                self.finish_request(conn, addr)
            except Exception as exc:  # noqa: BLE001 - one client must not take a worker down
                log.debug("connection from %s ended: %s", addr[0], exc)
            finally:
                with self._active_lock:
                    self._active.pop(sock, None)
                self.shutdown_request(conn)

    def _watchdog(self) -> None:
        while not self._stopping.wait(0.2):
            now = time.monotonic()
            with self._active_lock:
                late = [s for s, d in self._active.items() if now >= d]
            for s in late:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # the worker's pending read returns at once
                except OSError:
                    pass

    def server_close(self) -> None:
        self._stopping.set()
        for _ in self._threads:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                break
        super().server_close()


class ControllerHTTP:
    """The report listener (host, port) and, if policy.management_host is set, the
    management listener. `secret` is the master secret; `known(node)` says whether
    Slurm knows a node (reports of other nodes are refused before their body is read)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: bytes,
        ingest: Callable[[AgentReport], bool],
        metrics: ControllerMetrics,
        now: Callable[[], float],
        health: Callable[[], tuple[bool, str]],
        plan: Callable[[int], dict | None] = lambda job: None,
        policy: ControllerPolicy | None = None,
        known: Callable[[str], bool] = lambda node: True,
    ) -> None:
        p = policy or ControllerPolicy()
        self.policy = p
        self.secret = secret
        self.metrics = metrics
        tls = None
        if p.tls_cert_file:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            tls.load_cert_chain(p.tls_cert_file, p.tls_key_file)
        ctx = _Ctx(
            self,
            ingest=ingest,
            now=now,
            health=health,
            plan=plan,
            known=known,
            readers=[ipaddress.ip_network(n, strict=False) for n in p.read_clients],
            ip_limit=TokenBuckets(p.ip_rate_per_s, p.ip_burst),
            node_limit=TokenBuckets(p.node_rate_per_s, p.node_burst),
        )
        split = p.management_host is not None
        self.servers = [self._server((host, port), ctx, "report" if split else "all", tls)]
        if p.management_host is not None:
            self.servers.append(self._server((p.management_host, p.management_port), ctx, "management", tls))
        self._threads: list[threading.Thread] = []

    def _server(self, addr: tuple[str, int], ctx: _Ctx, role: str, tls: ssl.SSLContext | None) -> _PoolServer:
        p = self.policy
        handler = _make_handler(ctx, role)
        return _PoolServer(
            addr,
            handler,
            workers=p.workers,
            max_pending=p.max_pending,
            timeout_s=p.request_timeout_s,
            tls=tls,
            on_overload=lambda: ctx.refused("overloaded"),
        )

    @property
    def port(self) -> int:
        return self.servers[0].server_address[1]

    @property
    def management_port(self) -> int | None:
        return self.servers[1].server_address[1] if len(self.servers) > 1 else None

    def start(self) -> None:
        for i, srv in enumerate(self.servers):
            t = threading.Thread(target=srv.serve_forever, name=f"controller-http-accept-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        for srv in self.servers:
            srv.shutdown()
            srv.server_close()


@dataclass
class _Ctx:
    """What the handlers of both listeners share."""

    server: ControllerHTTP
    ingest: Callable[[AgentReport], bool]
    now: Callable[[], float]
    health: Callable[[], tuple[bool, str]]
    plan: Callable[[int], dict | None]
    known: Callable[[str], bool]
    readers: list
    ip_limit: TokenBuckets
    node_limit: TokenBuckets

    def refused(self, reason: str) -> None:
        self.server.metrics.http_refused.labels(reason).inc()


def _make_handler(ctx: _Ctx, role: str) -> type[BaseHTTPRequestHandler]:
    p = ctx.server.policy
    metrics = ctx.server.metrics
    reports_ok = metrics.reports.labels("ok")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        raw_requestline: bytes  # set by handle_one_request; typeshed does not declare it

        def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
            log.debug("%s " + fmt, self.client_address[0], *args)

        def parse_request(self) -> bool:
            """The request line and headers, read here rather than by http.server's
            email-parser route (a fifth of a report's cost): HTTP/1.0 or 1.1, at most
            MAX_HEADERS lines of MAX_LINE bytes; anything else is answered 400/431/505."""
            self.command = None  # type: ignore[assignment]  # http.server's own reset (typeshed: str)
            self.request_version = "HTTP/0.9"
            self.close_connection = True  # one request per connection: workers are few
            line = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n")
            self.requestline = line
            words = line.split()
            if len(words) != 3:
                return self._bad(400, "malformed request line")
            self.command, self.path, version = words
            self.request_version = version
            if version not in ("HTTP/1.1", "HTTP/1.0"):
                return self._bad(505, f"unsupported protocol {version[:20]!r}")
            headers = Headers()
            for _ in range(MAX_HEADERS + 1):
                raw = self.rfile.readline(MAX_LINE + 1)
                if len(raw) > MAX_LINE:
                    return self._bad(431, f"a header line is longer than {MAX_LINE} bytes")
                if raw in (b"\r\n", b"\n", b""):
                    break
                name, sep, value = raw.decode("iso-8859-1").partition(":")
                if not sep or not name or name != name.strip():
                    return self._bad(400, "malformed header line")
                headers[name.lower()] = value.strip()
            else:
                return self._bad(431, f"more than {MAX_HEADERS} header lines")
            # the handlers read headers with .get only; typeshed wants an email Message
            self.headers = headers  # type: ignore[assignment]
            if headers.get("Expect", "").lower() == "100-continue" and version == "HTTP/1.1":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return True

        def _bad(self, code: int, why: str) -> bool:
            self._refuse(code, why, "bad_request")
            return False

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            """The whole answer in one write (headers and body: one segment on the wire)."""
            self.close_connection = True
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s %s %d", self.client_address[0], self.command, self.path, code)
            self.wfile.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s"
                % (code, _REASONS.get(code, "").encode(), ctype.encode(), len(body), body)
            )

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode())

        def _refuse(self, code: int, why: str, label: str, *, report: bool = False) -> None:
            if report:
                metrics.reports.labels(label).inc()
            else:
                ctx.refused(label)
            self._json(code, {"error": why})

        def _rate_ok(self) -> bool:
            if ctx.ip_limit.allow(self.client_address[0]):
                return True
            self._refuse(
                429,
                f"too many requests from {self.client_address[0]} "
                f"(controller.ip_rate_per_s={p.ip_rate_per_s:g})",
                "rate_limited_ip",
            )
            return False

        def _reader_ok(self, what: str) -> bool:
            try:
                ip = ipaddress.ip_address(self.client_address[0])
            except ValueError:
                ip = None
            if ip is not None and any(ip in net for net in ctx.readers):
                return True
            self._refuse(403, f"{what} is served only to controller.read_clients", "forbidden_reader")
            return False

        def do_GET(self) -> None:  # noqa: N802
            if not self._rate_ok():
                return
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                ok, why = ctx.health()
                self._json(200 if ok else 503, {"ok": ok, "detail": why})
            elif role == "report" and (path == "/metrics" or path.startswith("/v1/jobs/")):
                self._refuse(
                    404, "served on the management listener (controller.management_host)", "not_found"
                )
            elif path == "/metrics":
                if self._reader_ok("/metrics"):
                    self._send(200, metrics.render(), "text/plain; version=0.0.4")
            elif m := re.fullmatch(r"/v1/jobs/(\d{1,12})/plan", path):
                if self._reader_ok("plans"):
                    plan = ctx.plan(int(m.group(1)))
                    if plan is None:
                        self._send(204, b"")
                    else:
                        self._json(200, plan)
            else:
                self._refuse(404, "not found", "not_found")

        def do_POST(self) -> None:  # noqa: N802
            if not self._rate_ok():
                return
            if self.path != "/v1/report" or role == "management":
                self._refuse(404, "not found", "not_found")
                return
            self._report()

        def _report(self) -> None:
            raw = self.headers.get("Content-Length")
            if raw is None or not raw.isdigit():
                self._refuse(411, "a report needs a Content-Length", "bad_request", report=True)
                return
            length = int(raw)
            if length == 0:
                self._refuse(400, "empty report", "bad_request", report=True)
                return
            if length > p.max_body_bytes:
                self._refuse(
                    413,
                    f"report of {length} bytes is over controller.max_body_bytes ({p.max_body_bytes})",
                    "too_large",
                    report=True,
                )
                return
            node = self.headers.get(NODE_HEADER, "")
            if not NODE_NAME.match(node):
                self._refuse(401, f"missing or invalid {NODE_HEADER} header", "unauthorized", report=True)
                return
            why = check_time(self.headers.get(TIME_HEADER, ""), ctx.now())
            if why is not None:
                log.warning("rejected report from %s (node %s): %s", self.client_address[0], node, why)
                self._refuse(401, why, "unauthorized", report=True)
                return
            if not ctx.known(node):
                self._refuse(403, f"node {node} is not a node of this cluster", "unknown_node", report=True)
                return
            if not ctx.node_limit.allow(node):
                self._refuse(
                    429,
                    f"too many reports for node {node} (controller.node_rate_per_s={p.node_rate_per_s:g})",
                    "rate_limited_node",
                    report=True,
                )
                return
            body = self.rfile.read(length)
            if len(body) != length:
                self._refuse(
                    400, f"body ended after {len(body)} of {length} bytes", "bad_request", report=True
                )
                return
            why = verify(
                ctx.server.secret,
                node,
                self.headers.get(TIME_HEADER, ""),
                body,
                self.headers.get(SIG_HEADER, ""),
                ctx.now(),
            )
            if why is not None:
                log.warning("rejected report from %s: %s", self.client_address[0], why)
                self._refuse(401, "bad signature", "unauthorized", report=True)
                return
            try:
                report = AgentReport.model_validate_json(body)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                self._refuse(
                    422, f"invalid report from node {node}: {where}: {first['msg']}", "invalid", report=True
                )
                return
            if report.node != node:
                log.warning(
                    "node %s signed a report for node %s (from %s)", node, report.node, self.client_address[0]
                )
                self._refuse(
                    403,
                    f"report names node {report.node} but is signed by node {node}",
                    "forbidden",
                    report=True,
                )
                return
            if not ctx.ingest(report):
                self._refuse(
                    409,
                    f"report (epoch {report.epoch}, seq {report.seq}) is not newer "
                    f"than the last one of node {node}",
                    "stale",
                    report=True,
                )
                return
            reports_ok.inc()
            self._send(200, _ACCEPTED)

    return Handler
