"""The report listener's event loop (issue 17.1, ingestion): one thread reads every
connection as its bytes come, so a slow client holds neither the loop nor the others,
and a failure while serving one request is answered and leaves the listener serving.
A real ControllerHTTP on a loopback port, real sockets (about 1 s)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time

import pytest

from slurmguard.controller.fleet import FleetView
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP, HeadError, parse_head
from slurmguard.wire import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, node_key, sign
from tests.fixtures.server import start_listener

MASTER = b"master-secret-0123456789abcdef0123456789"


def _start(ingest=None, **policy) -> tuple[ControllerHTTP, FleetView, ControllerMetrics]:
    return start_listener(MASTER, ingest=ingest, **policy)


def _request(node: str, seq: int = 1) -> bytes:
    body = AgentReport(node=node, seq=seq, epoch=1, sent_at=time.time()).model_dump_json().encode()
    ts = f"{time.time():.3f}"
    sig = sign(node_key(MASTER, node), ts, node, body)
    return (
        f"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"{TIME_HEADER}: {ts}\r\n{NODE_HEADER}: {node}\r\n{SIG_HEADER}: {sig}\r\n\r\n"
    ).encode() + body


def _answer(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def test_a_trickling_client_holds_neither_the_loop_nor_the_others():
    """Two slots: one client sends its report a few bytes at a time; the other's report
    is answered meanwhile, and the slow one is served once it is whole."""
    http, fleet, _ = _start(workers=2, max_pending=0)
    try:
        slow = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        req = _request("slow1")
        slow.sendall(req[:30])  # inside the request line
        slow.sendall(req[30:200])  # the head, part of the body
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as fast:
            fast.sendall(_request("fast1"))
            assert _answer(fast).startswith(b"HTTP/1.1 200 ")
        assert fleet.nodes_reporting(time.time()) == {"fast1"}  # the slow one is not whole yet
        for i in range(200, len(req), 7):
            slow.sendall(req[i : i + 7])
        assert _answer(slow).startswith(b"HTTP/1.1 200 ")
        slow.close()
        assert fleet.nodes_reporting(time.time()) == {"fast1", "slow1"}
    finally:
        http.stop()


def test_a_failure_while_ingesting_is_answered_500_counted_and_the_next_report_served():
    """A daemon never dies of one bad record: the request that broke something gets a
    500 naming no internals, the failure is counted, the listener goes on."""
    fleet = FleetView()

    def ingest(r: AgentReport) -> bool:
        if r.node == "bad1":
            raise RuntimeError("boom")
        return fleet.ingest(r, time.time())

    http, _, metrics = _start(ingest=ingest)
    try:
        for node, code in (("bad1", b"500"), ("good1", b"200")):
            with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
                s.sendall(_request(node))
                answer = _answer(s)
            assert answer.startswith(b"HTTP/1.1 " + code + b" "), answer[:60]
        assert b"boom" not in answer
        assert (
            metrics.registry.get_sample_value("slurmguard_http_refused_total", {"reason": "internal_error"})
            == 1
        )
        assert fleet.nodes_reporting(time.time()) == {"good1"}
    finally:
        http.stop()


def test_a_stalled_client_is_cut_off_at_its_deadline_and_counted():
    http, fleet, metrics = _start(request_timeout_s=0.3)
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=10) as s:
            s.sendall(_request("node1")[:100])  # and nothing more
            assert _answer(s) == b""  # closed by the listener, not by this client's timeout
        assert metrics.registry.get_sample_value("slurmguard_http_refused_total", {"reason": "timeout"}) == 1
        assert fleet.nodes_reporting(time.time()) == set()
        with socket.create_connection(("127.0.0.1", http.port), timeout=10) as s:
            s.sendall(_request("node1"))
            assert _answer(s).startswith(b"HTTP/1.1 200 ")
    finally:
        http.stop()


def test_expect_100_continue_is_sent_only_for_a_report_that_passed_its_header_checks():
    http, _, _ = _start(max_body_bytes=4096)
    try:
        req = _request("node1")
        head, body = req.split(b"\r\n\r\n", 1)
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(head + b"\r\nExpect: 100-continue\r\n\r\n")
            assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
            s.sendall(body)
            assert _answer(s).startswith(b"HTTP/1.1 200 ")
        big = head.replace(b"Content-Length: %d" % len(body), b"Content-Length: 999999")
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(big + b"\r\nExpect: 100-continue\r\n\r\n")
            answer = _answer(s)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer
        assert "max_body_bytes (4096)" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    finally:
        http.stop()


def test_parse_head_waits_for_a_whole_head_and_names_what_is_wrong():
    assert parse_head(b"POST /v1/report HTTP/1.1\r\nHost: x\r\n") is None
    (cmd, path, version, headers), used = parse_head(b"\r\nGET /healthz HTTP/1.0\nX-A:  b \n\nrest")
    assert (cmd, path, version, headers.get("x-a"), headers.get("X-A")) == (
        "GET",
        "/healthz",
        "HTTP/1.0",
        "b",
        "b",
    )
    assert used == len(b"\r\nGET /healthz HTTP/1.0\nX-A:  b \n\n")
    for head, code in (
        (b"GET / HTTP/1.1\r\n" + b"a" * 9000, 431),  # an unended line past the limit
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/3\r\n\r\n", 505),
    ):
        with pytest.raises(HeadError) as e:
            parse_head(head)
        assert e.value.code == code, head


def test_a_stalled_tls_handshake_holds_its_slot_only(tmp_path):
    """TLS handshakes are non-blocking too: a client that connects and sends no
    ClientHello does not hold the loop; another agent's report gets through."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    http, fleet, _ = _start(tls_cert_file=str(cert), tls_key_file=str(key), workers=2, max_pending=0)
    try:
        stalled = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        ctx = ssl.create_default_context(cafile=str(cert))
        raw = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:  # the loop is not blocked
            s.sendall(_request("node1"))
            assert _answer(s).startswith(b"HTTP/1.1 200 ")
        assert fleet.nodes_reporting(time.time()) == {"node1"}
        stalled.close()
    finally:
        http.stop()
