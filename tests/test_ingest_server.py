"""The report listener's event loop (issue 17.1, ingestion): one thread reads every
connection as its bytes come, so a slow client holds neither the loop nor the others,
and a failure while serving one request is answered and leaves the listener serving;
an agent's connection is kept alive between its reports, bounded in idle time, number
and requests. A real ControllerHTTP on a loopback port, real sockets (about 5 s)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time

import pytest

from slurmguard.config import ControllerPolicy
from slurmguard.controller.fleet import FleetView
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP, HeadError, parse_head
from slurmguard.wire import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, node_key, sign
from tests.fixtures.server import self_signed_cert, start_listener

MASTER = b"master-secret-0123456789abcdef0123456789"


def _start(ingest=None, **policy) -> tuple[ControllerHTTP, FleetView, ControllerMetrics]:
    return start_listener(MASTER, ingest=ingest, **policy)


def _request(node: str, seq: int = 1, *, close: bool = True) -> bytes:
    """A signed report; close: ask for Connection: close (then the answer ends at EOF)."""
    body = AgentReport(node=node, seq=seq, epoch=1, sent_at=time.time()).model_dump_json().encode()
    ts = f"{time.time():.3f}"
    sig = sign(node_key(MASTER, node), ts, node, body)
    return (
        f"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + f"{TIME_HEADER}: {ts}\r\n{NODE_HEADER}: {node}\r\n{SIG_HEADER}: {sig}\r\n\r\n"
    ).encode() + body


def _answer(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(4096):
        out += chunk
    return out


def _one_answer(s: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """The next answer on a kept-alive connection: (status, headers, body), read by its
    Content-Length; `buf` carries bytes of later answers over."""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        assert chunk, f"connection closed before a whole answer: {bytes(buf)!r}"
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = s.recv(4096)
        assert chunk, "connection closed inside an answer's body"
        rest += chunk
    buf[:] = rest[n:]
    return int(lines[0].split()[1]), headers, rest[:n]


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


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
    key, cert = self_signed_cert(tmp_path)
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


# ---- keep-alive: a connection serves an agent's reports one after another


def test_reports_one_after_another_and_pipelined_share_one_connection():
    """The accept and close are paid once per agent, not per report: three reports on
    one connection, then two sent before reading an answer, answered in order."""
    http, fleet, metrics = _start()
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            buf = bytearray()
            for seq in (1, 2, 3):
                s.sendall(_request("node1", seq, close=False))
                code, headers, body = _one_answer(s, buf)
                assert (code, headers["connection"], json.loads(body)) == (
                    200,
                    "keep-alive",
                    {"accepted": True},
                )
            s.sendall(_request("node1", 4, close=False) + _request("node1", 4, close=False))
            assert _one_answer(s, buf)[0] == 200
            code, headers, body = _one_answer(s, buf)  # the same report again: a replay
            assert code == 409 and "not newer" in json.loads(body)["error"]
            assert headers["connection"] == "keep-alive"  # its body was read: the stream goes on
            s.sendall(_request("node1", 5, close=True))
            code, headers, _ = _one_answer(s, buf)
            assert (code, headers["connection"]) == (200, "close") and _closed_by_server(s)
        assert fleet._seq["node1"] == (1, 5)
        assert metrics.registry.get_sample_value("slurmguard_http_connections_total") == 1
        assert metrics.registry.get_sample_value("slurmguard_reports_total", {"outcome": "ok"}) == 5
    finally:
        http.stop()


def test_an_idle_connection_holds_no_slot_and_is_closed_after_its_idle_time():
    """One slot, no queue: an agent's connection idle between its reports leaves the slot
    to another agent; idle past keepalive_idle_s it is closed (not counted as a refusal)."""
    http, fleet, metrics = _start(workers=1, max_pending=0, keepalive_idle_s=0.5)
    try:
        a = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        buf_a = bytearray()
        a.sendall(_request("node1", 1, close=False))
        assert _one_answer(a, buf_a)[0] == 200
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as b:
            b.sendall(_request("node2", 1, close=False))
            assert _one_answer(b, bytearray())[0] == 200
            a.sendall(_request("node1", 2, close=False))  # back from idle: served again
            assert _one_answer(a, buf_a)[0] == 200
            t0 = time.monotonic()
            assert _closed_by_server(a) and _closed_by_server(b)
            assert 0.3 < time.monotonic() - t0 < 3
        a.close()
        assert fleet._seq == {"node1": (1, 2), "node2": (1, 1)}
        assert (
            metrics.registry.get_sample_value("slurmguard_http_refused_total", {"reason": "timeout"}) is None
        )
    finally:
        http.stop()


def test_kept_alive_connections_are_bounded_in_number_and_requests():
    """max_idle_connections: the longest idle is closed to make room (its agent
    reconnects); keepalive_max_requests: the last answer says Connection: close."""
    http, _, _ = _start(max_idle_connections=1, keepalive_max_requests=2)
    try:
        a = socket.create_connection(("127.0.0.1", http.port), timeout=5)
        a.sendall(_request("node1", 1, close=False))
        assert _one_answer(a, bytearray())[0] == 200
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as b:
            buf = bytearray()
            b.sendall(_request("node2", 1, close=False))
            assert _one_answer(b, buf)[0] == 200
            assert _closed_by_server(a)  # b's idle connection took a's place
            b.sendall(_request("node2", 2, close=False))
            code, headers, _ = _one_answer(b, buf)
            assert (code, headers["connection"]) == (200, "close") and _closed_by_server(b)
        a.close()
    finally:
        http.stop()


def test_a_refusal_before_the_body_is_read_closes_the_connection():
    """413 (and every refusal of a report's head) leaves the announced body unread: the
    rest of the stream cannot be trusted, so the connection ends; a refused GET that
    announced no body does not end it."""
    http, _, metrics = _start(max_body_bytes=4096, read_clients=())
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            buf = bytearray()
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            code, headers, body = _one_answer(s, buf)
            assert (code, headers["connection"]) == (403, "keep-alive")
            head = _request("node1", close=False).split(b"\r\n\r\n", 1)[0]
            s.sendall(head.replace(b"Content-Length: ", b"Content-Length: 99999", 1) + b"\r\n\r\n")
            code, headers, body = _one_answer(s, buf)
            assert (code, headers["connection"]) == (413, "close") and _closed_by_server(s)
        assert metrics.registry.get_sample_value("slurmguard_reports_total", {"outcome": "too_large"}) == 1
    finally:
        http.stop()


def test_reports_arriving_over_kept_alive_connections_while_cycles_run_are_scored_once(
    sqlite_store, fake_clock
):
    """Issue 17.1: four agents post 25 reports each on their own kept-alive connection
    while the controller runs cycles (each takes the telemetry window) in another
    thread: every one of the 400 samples is scored exactly once, none lost between a
    window's swap and the next, none counted twice."""
    from slurmguard.config import parse_policy
    from slurmguard.controller.loop import Controller
    from slurmguard.slurm.fake import FakeSlurm
    from slurmguard.wire import TelemetryRecord

    policy = parse_policy("detection:\n  peers: {window_s: 1, consecutive_windows: 2, min_peers: 4}\n")
    nodes = [f"node{i}" for i in range(1, 5)]
    ctl = Controller(policy, sqlite_store, FakeSlurm(nodes, clock=fake_clock), fake_clock)
    ctl.cycle()  # Slurm's nodes become the known ones
    metrics = ControllerMetrics()
    http = ControllerHTTP(
        "127.0.0.1",
        0,
        secret=MASTER,
        ingest=lambda r: ctl.fleet.ingest(r, fake_clock.now()),
        metrics=metrics,
        now=time.time,
        health=lambda: (True, "ok"),
        policy=ControllerPolicy(node_burst=100),  # 25 reports a node at once
        known=ctl.fleet.known,
    )
    http.start()
    stop, cycles = threading.Event(), [0]

    def cycling() -> None:
        while not stop.is_set():
            fake_clock.advance(1.0)  # a window is due every cycle
            ctl.cycle()
            cycles[0] += 1

    def agent(node: str, out: list) -> None:
        with socket.create_connection(("127.0.0.1", http.port), timeout=10) as s:
            buf = bytearray()
            for seq in range(1, 26):
                tel = [
                    TelemetryRecord(signal="sm_clock", value=1.0, unit="MHz", timestamp=seq + i / 4, gpu=0)
                    for i in range(4)
                ]
                body = (
                    AgentReport(node=node, seq=seq, epoch=1, sent_at=time.time(), telemetry=tel)
                    .model_dump_json()
                    .encode()
                )
                ts = f"{time.time():.3f}"
                sig = sign(node_key(MASTER, node), ts, node, body)
                s.sendall(
                    (
                        f"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                        f"{TIME_HEADER}: {ts}\r\n{NODE_HEADER}: {node}\r\n{SIG_HEADER}: {sig}\r\n\r\n"
                    ).encode()
                    + body
                )
                out.append(_one_answer(s, buf)[0])

    cycler = threading.Thread(target=cycling)
    answers: dict[str, list] = {n: [] for n in nodes}
    agents = [threading.Thread(target=agent, args=(n, answers[n])) for n in nodes]
    try:
        cycler.start()
        for t in agents:
            t.start()
        for t in agents:
            t.join(60)
    finally:
        stop.set()
        cycler.join(60)
        http.stop()
    assert all(a == [200] * 25 for a in answers.values()), answers
    assert cycles[0] >= 2  # reports did arrive between and during cycles
    taken_before = ctl.fleet.samples_taken
    fake_clock.advance(1.0)
    ctl.cycle()  # the last window takes what came after the cycles stopped
    assert ctl.fleet.samples_taken == 4 * 25 * 4, (taken_before, ctl.fleet.samples_taken)
    assert ctl.fleet.queued_samples() == 0
    assert metrics.registry.get_sample_value("slurmguard_http_connections_total") == 4


def test_the_agents_sender_keeps_its_connection_and_reconnects_once_the_controller_closed_it():
    """The sender posts its reports on one connection; when the controller has closed it
    (idle past keepalive_idle_s), the next report goes on a new one, not counted as a
    failure, not delayed to the next flush."""
    from slurmguard.agent.sender import ReportSender

    http, fleet, metrics = _start(keepalive_idle_s=0.3)
    try:
        sender = ReportSender(f"http://127.0.0.1:{http.port}", node_key(MASTER, "node1"), now=time.time)
        for _ in range(3):
            sender.enqueue(AgentReport(node="node1", seq=0, sent_at=time.time()))
            assert sender.flush() == 1
        assert metrics.registry.get_sample_value("slurmguard_http_connections_total") == 1
        time.sleep(0.8)  # the controller closes the idle connection
        sender.enqueue(AgentReport(node="node1", seq=0, sent_at=time.time()))
        assert sender.flush() == 1
        assert (sender.sent, sender.failures, sender.rejected) == (4, 0, 0)
        assert metrics.registry.get_sample_value("slurmguard_http_connections_total") == 2
        assert fleet._seq["node1"] == (sender.epoch, 4)
        sender.close()
    finally:
        http.stop()


def test_the_listener_raises_its_open_files_limit_for_its_kept_alive_connections(caplog):
    """A descriptor per kept-alive connection: the soft limit goes up to what the listeners
    may hold, as far as the hard limit allows, and a shortfall is said in the log."""
    import resource

    from slurmguard.controller.server import _ensure_descriptors

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"hard open-files limit {hard} is too low to test with")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
        _ensure_descriptors(3000)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 3000
        if hard != resource.RLIM_INFINITY:
            _ensure_descriptors(hard + 1)
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            assert "raise LimitNOFILE" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_over_tls_the_senders_reports_share_one_connection(tmp_path):
    """An HTTPS controller keeps the agent's TLS connection alive too: one handshake for
    several reports (the connection goes idle and wakes between them)."""
    from slurmguard.agent.sender import ReportSender

    key, cert = self_signed_cert(tmp_path)
    http, fleet, metrics = _start(tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        sender = ReportSender(
            f"https://127.0.0.1:{http.port}", node_key(MASTER, "node1"), now=time.time, ca_file=str(cert)
        )
        for _ in range(3):
            sender.enqueue(AgentReport(node="node1", seq=0, sent_at=time.time()))
            assert sender.flush() == 1
            time.sleep(0.05)
        assert metrics.registry.get_sample_value("slurmguard_http_connections_total") == 1
        assert fleet._seq["node1"] == (sender.epoch, 3)
        sender.close()
    finally:
        http.stop()


@pytest.mark.parametrize("bad", ["", "0" * 64, "é" * 64, "\u00ff" + "a" * 63])
def test_a_bad_signature_of_any_text_is_refused_401_and_counted(bad):
    """The signature header is compared as bytes: empty, wrong or not ASCII (the head is
    read as ISO-8859-1) is a 401 counted as unauthorized, never a failure of the
    controller's own; the node's next good report is taken on a new connection."""
    http, fleet, metrics = _start()
    try:
        good = _request("node1")
        head, _, body = good.partition(b"\r\n\r\n")
        lines = [ln for ln in head.split(b"\r\n") if not ln.startswith(SIG_HEADER.encode())]
        forged = b"\r\n".join([*lines, f"{SIG_HEADER}: {bad}".encode("iso-8859-1")]) + b"\r\n\r\n" + body
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(forged)
            answer = _answer(s)
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:60]
        assert b'"bad signature"' in answer
        reg = metrics.registry
        assert reg.get_sample_value("slurmguard_reports_total", {"outcome": "unauthorized"}) == 1
        assert not reg.get_sample_value("slurmguard_http_refused_total", {"reason": "internal_error"})
        assert fleet.nodes_reporting(time.time()) == set()
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(good)
            assert _answer(s).startswith(b"HTTP/1.1 200 ")
        assert fleet.nodes_reporting(time.time()) == {"node1"}
    finally:
        http.stop()
