"""The controller's HTTP endpoints (one event loop per listener, stdlib only).

POST /v1/report          signed AgentReport (see slurmguard.wire; wire format 4, 3, 2 or 1)
GET  /healthz            200 while cycles run, 503 when the last one is stale
GET  /metrics            Prometheus text format         } controller.read_clients only;
GET  /v1/jobs/<id>/plan  the job's mitigation plan      } on the management listener
                         (204 when there is none)       } when one is configured

Each listener is one thread running a selector loop over non-blocking sockets:
it accepts, reads request heads and bodies as their bytes arrive, checks,
ingests and answers. Reading is concurrent, the checking and ingesting of
complete requests serial: under the interpreter lock a pool of threads bought
no parallelism, and handing each connection from the accepting thread to a
worker cost a third or more of a report's CPU and halved the rate (`slurmguard
bench scale`, same runs: 0.64 -> 0.39 and 0.82 -> 0.48 ms a report, 854 -> 2,034
and 880 -> 1,971 reports/s).

The listener faces every node of the cluster, so nothing is done for a client
before it has shown who it is, and nothing it does can hold more than a bounded
share of the controller:
- `workers` connections are served (read) at once; `max_pending` more wait,
  accepted but unread; beyond that a connection is answered 503 and closed at
  once. What is buffered is at most `workers` x `max_body_bytes`;
- every request has `request_timeout_s` in total from its connection's accept
  or, kept alive, its first byte (a client that sends slowly is cut off), not
  per read; waiting counts;
- requests per client address and signed reports per node pass token buckets
  (429 past them);
- a report's Content-Length is checked against `max_body_bytes` before a byte
  of the body is read (413), the node, time and signature headers before the
  body is parsed (401/403), the body's node against the signed one after;
- TLS when `tls_cert_file`/`tls_key_file` are set (handshakes are non-blocking
  too: a client stalling its handshake holds one slot until its deadline).
Every refusal is a 4xx with a one-line reason in JSON and counted in /metrics
(`slurmguard_reports_total{outcome}` for reports, `slurmguard_http_refused_total
{reason}` for the rest; a failure of the controller's own is answered 500 and
counted as reason "internal_error", a connection cut off at its deadline as
"timeout"). A failure while serving one connection closes that connection only.

Connections persist (HTTP/1.1 keep-alive), so an agent pays the connection's
accept and close once, not per report (they were 0.055 ms of a report's 0.36 ms
at 10,000 nodes, and about half the sending side's): after an answer to a request
read whole, a connection that did not ask to close waits, idle, for the
client's next request, for `keepalive_idle_s` (longer than the agents'
report interval) and at most `keepalive_max_requests` requests. An idle
connection holds no slot and no buffer (only its descriptor), and at most
`max_idle_connections` are kept (past it the longest idle is closed; its
client reconnects); when its next request begins it takes a slot like a new
connection (or waits, or gets 503), with `request_timeout_s` from its first
byte. A refusal before a body announced was read (413, 401, 429, ...) and
anything malformed closes the connection (the rest of the stream cannot be
trusted). Requests sent before the previous answer (pipelined) are answered in
order. Each connection takes a descriptor: the listeners raise the process's
soft open-files limit to what they may hold, and out of descriptors the
longest idle connection makes room for a new one.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from slurmguard.config import ControllerPolicy

if TYPE_CHECKING:
    from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.wire import (
    NODE_HEADER,
    NODE_NAME,
    SIG_HEADER,
    TIME_HEADER,
    AgentReport,
    ReportError,
    check_time,
    decode_report,
    signed_by,
)

log = logging.getLogger(__name__)

_BUSY = b'{"error": "controller busy (all workers and queue slots taken): try again later"}'
_OVERLOADED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY), _BUSY)
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_FAILED_BODY = b'{"error": "the controller failed serving this request (see its log)"}'
_FAILED = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_FAILED_BODY), _FAILED_BODY)
)


#: most header lines a request may have, and the longest line, request line included (bytes)
MAX_HEADERS = 64
MAX_LINE = 8192
#: bytes read from a socket at once
_CHUNK = 256 * 1024
#: how often deadlines are checked (s)
_TICK_S = 0.1
_REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class Answer(NamedTuple):
    """An answer but for its Connection header, which the listener adds (keep-alive or
    close): `head` holds the status line and the other headers, each line ending in CRLF."""

    head: bytes
    body: bytes


def _response(code: int, body: bytes, ctype: str = "application/json") -> Answer:
    return Answer(
        b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
        % (code, _REASONS.get(code, "").encode(), ctype.encode(), len(body)),
        body,
    )


_ACCEPTED = _response(200, b'{"accepted": true}')


class Headers(dict):
    """Request headers by lower-cased name (the last of repeated ones): `get` takes a
    name in any case, `lookup` a lower-case one (dict.get itself: the listener's own
    lookups, 7 a report, without a Python call each)."""

    lookup = dict.get

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


_H_LENGTH = "content-length"
_H_EXPECT = "expect"
_H_CONNECTION = "connection"
_H_NODE = NODE_HEADER.lower()
_H_TIME = TIME_HEADER.lower()
_H_SIG = SIG_HEADER.lower()


class TokenBuckets:
    """Per-key token buckets (rate per second, burst); at most `max_keys` keys are
    remembered (the least recently used is forgotten, i.e. starts full again)."""

    def __init__(
        self, rate: float, burst: int, now: Callable[[], float] = time.monotonic, max_keys: int = 10000
    ) -> None:
        self.rate, self.burst, self.now, self.max_keys = rate, float(burst), now, max_keys
        # a plain dict in use order (a key used is taken out and put back last): its
        # pop and insert cost half an OrderedDict's, and each request passes two buckets
        self._b: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        t = self.now()
        b = self._b
        with self._lock:
            tokens, last = b.pop(key, (self.burst, t))
            tokens = min(self.burst, tokens + (t - last) * self.rate)
            ok = tokens >= 1.0
            b[key] = (tokens - 1.0 if ok else tokens, t)
            while len(b) > self.max_keys:
                del b[next(iter(b))]  # the least recently used
            return ok


class HeadError(Exception):
    """A request head that cannot be served: (code, reason)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code, self.why = code, why


@dataclass
class Request:
    """A parsed request head; `length`: bytes of body still to read (0: none)."""

    client: str
    command: str
    path: str
    version: str
    headers: Headers
    length: int = 0
    node: str = ""
    """A report's node as its head named it (checked before its body is read)."""


def parse_head(buf: bytearray | bytes) -> tuple[tuple[str, str, str, Headers], int] | None:
    """((command, path, version, headers), bytes of head) once `buf` holds a whole
    request head (lines ending in CRLF or LF, up to the first empty one), None
    while it does not; HeadError for what cannot be a request head: at most
    MAX_HEADERS lines of MAX_LINE bytes, HTTP/1.0 or 1.1."""
    if buf[:1] not in (b"\r", b"\n"):  # the usual head: CRLF lines, no blank line first
        end = buf.find(b"\r\n\r\n", 0, (MAX_HEADERS + 1) * (MAX_LINE + 2) + 2)
        if end >= 0:
            # decoded once, split once; no bare LF (each LF is a CRLF's), no line too long
            fast = buf[:end].decode("iso-8859-1").split("\r\n")
            if (
                len(fast) <= MAX_HEADERS + 1
                and buf.count(b"\n", 0, end) == len(fast) - 1
                and max(map(len, fast)) <= MAX_LINE
            ):
                return _head_of(fast), end + 4
    lines: list[str] = []
    at = 0
    while True:
        nl = buf.find(b"\n", at, at + MAX_LINE + 1)
        if nl < 0:
            if len(buf) - at > MAX_LINE:
                raise HeadError(431, f"a header line is longer than {MAX_LINE} bytes")
            return None
        line = bytes(buf[at:nl]).rstrip(b"\r")
        at = nl + 1
        if not line:
            if not lines:  # blank lines before a request line (RFC 9112 2.2): skipped
                continue
            break
        lines.append(line.decode("iso-8859-1"))
        if len(lines) > MAX_HEADERS + 1:
            raise HeadError(431, f"more than {MAX_HEADERS} header lines")
    return _head_of(lines), at


def _head_of(lines: list[str]) -> tuple[str, str, str, Headers]:
    """(command, path, version, headers) of a head's lines (request line first), decoded
    as ISO-8859-1."""
    words = lines[0].split()
    if len(words) != 3:
        raise HeadError(400, "malformed request line")
    command, path, version = words
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HeadError(505, f"unsupported protocol {version[:20]!r}")
    headers = Headers()
    for raw in lines[1:]:
        name, sep, value = raw.partition(":")
        if not sep or not name or name != name.strip():
            raise HeadError(400, "malformed header line")
        headers[name.lower()] = value.strip()
    return command, path, version, headers


class _Conn:
    """One accepted connection and where it is in its request."""

    __slots__ = (
        "sock",
        "client",
        "deadline",
        "buf",
        "out",
        "req",
        "handshake",
        "answered",
        "keep",
        "served",
        "writing",
    )

    def __init__(self, sock: socket.socket, client: str, deadline: float) -> None:
        self.sock = sock
        self.client = client
        self.deadline = deadline
        self.buf = bytearray()
        self.out = b""
        self.req: Request | None = None
        self.handshake = False
        self.answered = False
        """c.out holds an answer (not a 100 Continue)."""
        self.keep = False
        """The connection stays open once c.out is sent."""
        self.served = 0
        """Requests answered on this connection."""
        self.writing = False
        """Registered for writing (an answer waits on the socket), not reading."""


class _Listener:
    """One listening socket served by one thread's selector loop (serve_forever):
    `workers` connections read at once, `max_pending` more accepted and waiting,
    each cut off `timeout_s` after its accept or its first byte after an idle
    spell; up to `max_idle` more open and idle between requests (keep-alive) for
    at most `idle_s` each and `max_requests` requests; `serve` answers requests."""

    def __init__(
        self,
        addr: tuple[str, int],
        serve: _Service,
        *,
        workers: int,
        max_pending: int,
        timeout_s: float,
        tls: ssl.SSLContext | None,
        refused: Callable[[str], None],
        accepted: Callable[[], None] = lambda: None,
        idle_s: float = 0.0,
        max_requests: int = 1,
        max_idle: int = 0,
    ) -> None:
        self.serve, self.workers, self.max_pending = serve, workers, max_pending
        self.timeout_s, self.tls, self.refused, self.accepted = timeout_s, tls, refused, accepted
        self.idle_s, self.max_requests, self.max_idle = idle_s, max_requests, max_idle
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.sock = socket.create_server(addr, family=family, backlog=max(128, workers + max_pending))
        self.sock.setblocking(False)
        self.server_address = self.sock.getsockname()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._active: dict[socket.socket, _Conn] = {}
        self._pending: deque[_Conn] = deque()
        self._idle: OrderedDict[socket.socket, _Conn] = OrderedDict()
        """Kept-alive connections between requests, longest idle first; registered
        for reading, holding no slot."""
        self._keep_line = b"Connection: keep-alive\r\nKeep-Alive: timeout=%d\r\n\r\n" % int(idle_s)
        self._stopping = threading.Event()

    # ---- the loop
    def serve_forever(self) -> None:
        try:
            next_tick = time.monotonic() + _TICK_S
            while not self._stopping.is_set():
                for key, events in self._sel.select(_TICK_S):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._event(key.data, events)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + _TICK_S
                    self._expire(now)
        finally:
            for c in [*self._active.values(), *self._pending, *self._idle.values()]:
                self._shut(c.sock)
            self._active.clear()
            self._pending.clear()
            self._idle.clear()

    def _accept(self) -> None:
        for _ in range(64):  # then serve the connections already open
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, a connection reset before accept
                log.warning("accept failed: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._idle:
                    # the longest idle kept-alive connection makes room for a new client
                    _, old = self._idle.popitem(last=False)
                    self._drop_idle(old)
                    continue
                return
            sock.setblocking(False)
            self.accepted()
            self._admit(_Conn(sock, str(addr[0]), time.monotonic() + self.timeout_s))

    def _admit(self, c: _Conn) -> bool:
        """A connection with a request to read (new, or idle and readable again): a
        free slot (True), else the queue, else 503."""
        if len(self._active) < self.workers:
            self._start(c)
            return True
        if len(self._pending) < self.max_pending:
            self._pending.append(c)
        else:
            self.refused("overloaded")
            if not isinstance(c.sock, ssl.SSLSocket) and self.tls is None:
                try:
                    c.sock.send(_OVERLOADED)
                except OSError:
                    pass
            self._shut(c.sock)
        return False

    def _start(self, c: _Conn) -> None:
        """Serve a connection (a free slot): TLS handshake first where configured."""
        try:
            if self.tls is not None and not isinstance(c.sock, ssl.SSLSocket):
                c.sock = self.tls.wrap_socket(c.sock, server_side=True, do_handshake_on_connect=False)
                c.handshake = True
            self._active[c.sock] = c
            self._sel.register(c.sock, selectors.EVENT_READ, c)
        except (OSError, ValueError) as exc:
            log.debug("connection from %s ended: %s", c.client, exc)
            self._active.pop(c.sock, None)
            self._shut(c.sock)
            self._next()
            return
        if c.handshake:
            self._handshake(c)

    def _next(self) -> None:
        """A slot is free: the oldest waiting connection that is still in time gets it."""
        now = time.monotonic()
        while self._pending and len(self._active) < self.workers:
            c = self._pending.popleft()
            if now >= c.deadline:  # waited its whole time
                self.refused("timeout")
                self._shut(c.sock)
                continue
            self._start(c)

    def _event(self, c: _Conn, events: int) -> None:
        if c.sock.fileno() < 0:  # closed while serving an earlier event of this round
            return
        try:
            if c.sock in self._idle:
                self._wake(c)
            elif c.handshake:
                self._handshake(c)
            elif c.out:
                if self._flush(c) and self._serve_buffer(c):
                    self._read(c)
            elif events & selectors.EVENT_READ:
                self._read(c)
        except Exception as exc:  # noqa: BLE001 - one client must not take the listener down
            log.error("serving %s failed: %s", c.client, exc, exc_info=not isinstance(exc, OSError))
            if not c.answered and not isinstance(exc, OSError):
                self.refused("internal_error")
                try:
                    c.sock.send(_FAILED)
                except OSError:
                    pass
            self._close(c)

    def _wake(self, c: _Conn) -> None:
        """An idle connection is readable: its next request (or its end) is coming."""
        del self._idle[c.sock]
        c.deadline = time.monotonic() + self.timeout_s
        if len(self._active) < self.workers:  # a slot: it stays registered as it is
            self._active[c.sock] = c
            self._read(c)
            return
        self._sel.unregister(c.sock)
        self._admit(c)

    def _handshake(self, c: _Conn) -> None:
        assert isinstance(c.sock, ssl.SSLSocket)
        try:
            c.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(c.sock, selectors.EVENT_READ, c)
            return
        except ssl.SSLWantWriteError:
            self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
            return
        except (ssl.SSLError, OSError) as exc:
            log.debug("TLS handshake with %s failed: %s", c.client, exc)
            self._close(c)
            return
        c.handshake = False
        self._sel.modify(c.sock, selectors.EVENT_READ, c)
        self._read(c)  # the request may have come with the handshake's last flight

    def _read(self, c: _Conn) -> None:
        while True:
            want = _CHUNK if c.req is None else max(1, min(_CHUNK, c.req.length - len(c.buf)))
            try:
                data = c.sock.recv(want)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as exc:
                log.debug("connection from %s ended: %s", c.client, exc)
                self._close(c)
                return
            if not data:  # the client is gone (before its request was whole, or between requests)
                self._close(c)
                return
            c.buf += data
            if not self._serve_buffer(c):
                return
            if not isinstance(c.sock, ssl.SSLSocket) or not c.sock.pending():
                return

    def _serve_buffer(self, c: _Conn) -> bool:
        """Serve the requests the buffer holds, one after another (a client may send
        its next one before reading an answer); True while more bytes are wanted."""
        while True:
            answer = self._advance(c)
            if answer is None:
                return not c.out and c.sock in self._active  # not waiting on a 100 Continue
            c.answered, c.keep = True, answer[1]
            c.served += 1
            c.out = answer[0]
            if not self._flush(c):
                return False
            if not c.buf:
                return False  # answered and idle, or closed
            c.deadline = time.monotonic() + self.timeout_s  # the next request, pipelined

    def _advance(self, c: _Conn) -> tuple[bytes, bool] | None:
        """The answer to the buffer's first request once it is whole (bytes to send,
        and whether the connection stays open after them); None while it is not."""
        if c.req is None:
            try:
                head = parse_head(c.buf)
            except HeadError as exc:
                return self._finish(c, self.serve.bad_head(exc), False)
            if head is None:
                return None
            (command, path, version, headers), used = head
            del c.buf[:used]
            c.req = Request(c.client, command, path, version, headers)
            answer = self.serve.head(c.req)
            if answer is not None:
                # a body that was announced is not read: the connection cannot go on
                unread = headers.lookup(_H_LENGTH, "0") != "0" or "transfer-encoding" in headers
                return self._finish(c, answer, not unread)
            if headers.lookup(_H_EXPECT, "").lower() == "100-continue" and version == "HTTP/1.1":
                c.out = _CONTINUE  # checked: the client may send its body now
                c.answered = False
                self._flush(c)
                return None
        if len(c.buf) < c.req.length:
            return None
        body = bytes(c.buf[: c.req.length])
        del c.buf[: c.req.length]
        return self._finish(c, self.serve.body(c.req, body), True)

    def _finish(self, c: _Conn, answer: Answer, can_keep: bool) -> tuple[bytes, bool]:
        """The answer's bytes with its Connection header: keep-alive where the request
        was read whole, the client did not ask to close (HTTP/1.1 only), and the
        connection has requests left; the request is done."""
        req, c.req = c.req, None
        keep = (
            can_keep
            and req is not None
            and self.idle_s > 0
            and req.version == "HTTP/1.1"
            and req.headers.lookup(_H_CONNECTION, "").lower() != "close"
            and c.served + 1 < self.max_requests
            and not self._stopping.is_set()
        )
        if not keep:
            c.buf = bytearray()
            return answer.head + b"Connection: close\r\n\r\n" + answer.body, False
        return answer.head + self._keep_line + answer.body, True

    def _flush(self, c: _Conn) -> bool:
        """Send c.out; True once it is sent and the connection goes on reading."""
        try:
            while c.out:
                n = c.sock.send(c.out)
                c.out = c.out[n:]
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            if not c.writing:
                self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
                c.writing = True
            return False
        except OSError as exc:
            log.debug("connection from %s ended: %s", c.client, exc)
            self._close(c)
            return False
        if c.writing:
            self._sel.modify(c.sock, selectors.EVENT_READ, c)
            c.writing = False
        if not c.answered:  # a 100 Continue: the body comes next
            return True
        c.answered = False
        if not c.keep:
            self._close(c)
            return False
        if c.buf or (isinstance(c.sock, ssl.SSLSocket) and c.sock.pending()):
            return True  # pipelined: the next request is here already
        self._rest(c)
        return False

    def _rest(self, c: _Conn) -> None:
        """Answered, kept alive, nothing buffered: idle, its slot free for another."""
        del self._active[c.sock]
        c.deadline = time.monotonic() + self.idle_s
        self._idle[c.sock] = c
        while len(self._idle) > self.max_idle:  # the longest idle makes room (it reconnects)
            _, old = self._idle.popitem(last=False)
            self._drop_idle(old)
        self._next()

    def _drop_idle(self, c: _Conn) -> None:
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        self._shut(c.sock)

    def _expire(self, now: float) -> None:
        for c in [c for c in self._active.values() if now >= c.deadline]:
            log.info("connection from %s cut off: no whole request in %gs", c.client, self.timeout_s)
            self.refused("timeout")
            self._close(c)
        while self._pending and now >= self._pending[0].deadline:
            self.refused("timeout")
            self._shut(self._pending.popleft().sock)
        # idle for keepalive_idle_s: closed, not refused (the client asked nothing)
        while self._idle:
            c = next(iter(self._idle.values()))
            if now < c.deadline:
                break
            del self._idle[c.sock]
            self._drop_idle(c)

    def _close(self, c: _Conn) -> None:
        if self._active.pop(c.sock, None) is not None:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
        elif self._idle.pop(c.sock, None) is not None:
            self._drop_idle(c)
            return
        self._shut(c.sock)
        self._next()

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    # ---- from other threads
    def shutdown(self) -> None:
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def server_close(self) -> None:
        """After shutdown and the loop's end (ControllerHTTP.stop joins it)."""
        self._sel.close()
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()


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

    def _server(self, addr: tuple[str, int], ctx: _Ctx, role: str, tls: ssl.SSLContext | None) -> _Listener:
        p = self.policy
        return _Listener(
            addr,
            _Service(ctx, role),
            workers=p.workers,
            max_pending=p.max_pending,
            timeout_s=p.request_timeout_s,
            tls=tls,
            refused=ctx.refused,
            accepted=self.metrics.http_connections.inc,
            idle_s=p.keepalive_idle_s,
            max_requests=p.keepalive_max_requests,
            max_idle=p.max_idle_connections,
        )

    @property
    def port(self) -> int:
        return int(self.servers[0].server_address[1])

    @property
    def management_port(self) -> int | None:
        return int(self.servers[1].server_address[1]) if len(self.servers) > 1 else None

    def start(self) -> None:
        _ensure_descriptors(
            len(self.servers) * (self.policy.max_idle_connections + self.policy.workers) + 1024
        )
        for i, srv in enumerate(self.servers):
            t = threading.Thread(target=srv.serve_forever, name=f"controller-http-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        for srv in self.servers:
            srv.shutdown()
        for t in self._threads:
            t.join(5)
        for srv in self.servers:
            srv.server_close()


def _ensure_descriptors(need: int) -> None:
    """Raise this process's soft limit on open descriptors towards `need` (kept-alive
    connections take one each), up to the hard limit; a warning when that is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, new, exc)
            new = soft
        if new < need:
            log.warning(
                "open-files limit %d is below the %d the listeners may hold "
                "(controller.max_idle_connections): raise LimitNOFILE; past it the longest "
                "idle connection is closed for each new one",
                new,
                need,
            )


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


class _Service:
    """What a listener of `role` ("all", "report" or "management") answers: `head`
    once a request's head is read (an answer, or None to read `req.length` bytes of
    body), `body` once those are."""

    def __init__(self, ctx: _Ctx, role: str) -> None:
        self.ctx, self.role = ctx, role
        self.p = ctx.server.policy
        self.metrics = ctx.server.metrics
        self.reports_ok = self.metrics.reports.labels("ok")

    def _json(self, code: int, obj: Any) -> Answer:
        return _response(code, json.dumps(obj).encode())

    def _refuse(self, code: int, why: str, label: str, *, report: bool = False) -> Answer:
        if report:
            self.metrics.reports.labels(label).inc()
        else:
            self.ctx.refused(label)
        return self._json(code, {"error": why})

    def bad_head(self, exc: HeadError) -> Answer:
        return self._refuse(exc.code, exc.why, "bad_request")

    def _reader_ok(self, req: Request) -> bool:
        try:
            ip = ipaddress.ip_address(req.client)
        except ValueError:
            return False
        return any(ip in net for net in self.ctx.readers)

    def head(self, req: Request) -> Answer | None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s", req.client, req.command, req.path)
        if not self.ctx.ip_limit.allow(req.client):
            return self._refuse(
                429,
                f"too many requests from {req.client} (controller.ip_rate_per_s={self.p.ip_rate_per_s:g})",
                "rate_limited_ip",
            )
        if req.command == "GET":
            return self._get(req)
        if req.command == "POST":
            if req.path != "/v1/report" or self.role == "management":
                return self._refuse(404, "not found", "not_found")
            return self._report_head(req)
        return self._refuse(405, f"method {req.command[:20]!r} is not served", "bad_request")

    def _get(self, req: Request) -> Answer:
        path = req.path.split("?", 1)[0]
        if path == "/healthz":
            ok, why = self.ctx.health()
            return self._json(200 if ok else 503, {"ok": ok, "detail": why})
        if self.role == "report" and (path == "/metrics" or path.startswith("/v1/jobs/")):
            return self._refuse(
                404, "served on the management listener (controller.management_host)", "not_found"
            )
        if path == "/metrics":
            if not self._reader_ok(req):
                return self._refuse(
                    403, "/metrics is served only to controller.read_clients", "forbidden_reader"
                )
            return _response(200, self.metrics.render(), "text/plain; version=0.0.4")
        if m := re.fullmatch(r"/v1/jobs/(\d{1,12})/plan", path):
            if not self._reader_ok(req):
                return self._refuse(
                    403, "plans is served only to controller.read_clients", "forbidden_reader"
                )
            plan = self.ctx.plan(int(m.group(1)))
            return _response(204, b"") if plan is None else self._json(200, plan)
        return self._refuse(404, "not found", "not_found")

    def _report_head(self, req: Request) -> Answer | None:
        """Everything that can be checked before the body is read."""
        p, ctx = self.p, self.ctx
        raw = req.headers.lookup(_H_LENGTH)
        if raw is None or not raw.isdigit():
            return self._refuse(411, "a report needs a Content-Length", "bad_request", report=True)
        length = int(raw)
        if length == 0:
            return self._refuse(400, "empty report", "bad_request", report=True)
        if length > p.max_body_bytes:
            return self._refuse(
                413,
                f"report of {length} bytes is over controller.max_body_bytes ({p.max_body_bytes})",
                "too_large",
                report=True,
            )
        node = req.headers.lookup(_H_NODE, "")
        if not NODE_NAME.match(node):
            return self._refuse(401, f"missing or invalid {NODE_HEADER} header", "unauthorized", report=True)
        why = check_time(req.headers.lookup(_H_TIME, ""), ctx.now())
        if why is not None:
            log.warning("rejected report from %s (node %s): %s", req.client, node, why)
            return self._refuse(401, why, "unauthorized", report=True)
        if not ctx.known(node):
            return self._refuse(
                403, f"node {node} is not a node of this cluster", "unknown_node", report=True
            )
        if not ctx.node_limit.allow(node):
            return self._refuse(
                429,
                f"too many reports for node {node} (controller.node_rate_per_s={p.node_rate_per_s:g})",
                "rate_limited_node",
                report=True,
            )
        req.length, req.node = length, node
        return None

    def body(self, req: Request, body: bytes) -> Answer:
        ctx = self.ctx
        node = req.node  # its name and the time were checked with the head (_report_head)
        headers = req.headers
        if not signed_by(
            ctx.server.secret, node, headers.lookup(_H_TIME, ""), body, headers.lookup(_H_SIG, "")
        ):
            log.warning("rejected report from %s: bad signature for node %s", req.client, node)
            return self._refuse(401, "bad signature", "unauthorized", report=True)
        try:
            report = decode_report(body)
        except ReportError as exc:
            return self._refuse(422, f"invalid report from node {node}: {exc}", "invalid", report=True)
        if report.node != node:
            log.warning("node %s signed a report for node %s (from %s)", node, report.node, req.client)
            return self._refuse(
                403, f"report names node {report.node} but is signed by node {node}", "forbidden", report=True
            )
        if not ctx.ingest(report):
            return self._refuse(
                409,
                f"report (epoch {report.epoch}, seq {report.seq}) is not newer "
                f"than the last one of node {node}",
                "stale",
                report=True,
            )
        self.reports_ok.inc()
        return _ACCEPTED
