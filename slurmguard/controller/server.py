"""The controller's HTTP endpoints (stdlib server, one thread per request).

POST /v1/report        signed AgentReport (see slurmguard.reports)
GET  /metrics          Prometheus text format
GET  /healthz          200 while cycles run, 503 when the last one is stale
GET  /v1/jobs/<id>/plan  the job's mitigation plan (204 when there is none)
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from pydantic import ValidationError

from slurmguard.reports import SIG_HEADER, TIME_HEADER, AgentReport, verify

log = logging.getLogger("slurmguard.controller.http")
MAX_BODY = 8 << 20


class ControllerHTTP:
    def __init__(self, host: str, port: int, *, secret: bytes, ingest: Callable[[AgentReport], bool],
                 metrics, now: Callable[[], float], health: Callable[[], tuple[bool, str]],
                 plan: Callable[[int], dict | None] = lambda job: None) -> None:
        self.secret = secret
        handler = _make_handler(self, ingest, metrics, now, health, plan)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="controller-http",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: ControllerHTTP, ingest, metrics, now, health, plan):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # route to logging, not stderr
            log.debug("%s " + fmt, self.client_address[0], *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                self._send(200, metrics.render(), "text/plain; version=0.0.4")
            elif self.path == "/healthz":
                ok, why = health()
                self._json(200 if ok else 503, {"ok": ok, "detail": why})
            elif m := re.fullmatch(r"/v1/jobs/(\d+)/plan", self.path):
                p = plan(int(m.group(1)))
                if p is None:
                    self._send(204, b"")
                else:
                    self._json(200, p)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/report":
                self._json(404, {"error": "not found"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if length <= 0 or length > MAX_BODY:
                metrics.reports.labels("bad_request").inc()
                self._json(400, {"error": "missing or oversized body"})
                return
            body = self.rfile.read(length)
            why = verify(server.secret, self.headers.get(TIME_HEADER, ""), body,
                         self.headers.get(SIG_HEADER, ""), now())
            if why is not None:
                metrics.reports.labels("unauthorized").inc()
                log.warning("rejected report from %s: %s", self.client_address[0], why)
                self._json(401, {"error": "unauthorized"})
                return
            try:
                report = AgentReport.model_validate_json(body)
            except ValidationError as exc:
                metrics.reports.labels("invalid").inc()
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                self._json(422, {"error": f"invalid report: {where}: {first['msg']}"})
                return
            accepted = ingest(report)
            metrics.reports.labels("ok" if accepted else "stale").inc()
            self._json(200, {"accepted": accepted})

    return Handler
