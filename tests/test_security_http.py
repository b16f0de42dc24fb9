"""Issue 18.5 and 18.7 (and 18.3's controller side): the report listener under attack.

A real ControllerHTTP on a loopback port, real sockets; the attacker is any
process that can reach the port (a job on a compute node), or root on one
compute node holding that node's key only.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest

from slurmguard.agent.sender import ReportSender
from slurmguard.clock import FakeClock
from slurmguard.config import ControllerPolicy
from slurmguard.controller.fleet import FleetView
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP, TokenBuckets
from slurmguard.wire import NODE_HEADER, SIG_HEADER, TIME_HEADER, AgentReport, node_key, sign
from tests.fixtures.server import self_signed_cert

MASTER = b"master-secret-0123456789abcdef0123456789"
NODES = {"node1", "node2"}


def start(**policy) -> tuple[ControllerHTTP, FleetView, ControllerMetrics]:
    fleet = FleetView()
    fleet.set_known_nodes(NODES)
    metrics = ControllerMetrics()
    http = ControllerHTTP(
        "127.0.0.1",
        0,
        secret=MASTER,
        ingest=lambda r: fleet.ingest(r, time.time()),
        metrics=metrics,
        now=time.time,
        health=lambda: (True, "ok"),
        plan=lambda job: {"job_id": str(job)},
        policy=ControllerPolicy(**policy),
        known=fleet.known,
    )
    http.start()
    return http, fleet, metrics


@pytest.fixture
def server():
    http, fleet, metrics = start()
    yield http, fleet, metrics
    http.stop()


def post(port: int, body: bytes, headers: dict, scheme: str = "http", ctx=None) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{scheme}://127.0.0.1:{port}/v1/report",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def signed(
    report: AgentReport, *, as_node: str | None = None, key_of: str | None = None, ts: str | None = None
) -> tuple[bytes, dict]:
    body = report.model_dump_json().encode()
    node = as_node or report.node
    ts = f"{time.time():.3f}" if ts is None else ts
    key = node_key(MASTER, key_of or node)
    return body, {TIME_HEADER: ts, NODE_HEADER: node, SIG_HEADER: sign(key, ts, node, body)}


def rep(node="node1", seq=1, epoch=1) -> AgentReport:
    return AgentReport(node=node, seq=seq, epoch=epoch, sent_at=time.time())


def metric(metrics: ControllerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_nodes_key_reports_for_that_node_only(server):
    """Attack (18.7): with one shared secret, root on any node reported for every node."""
    http, fleet, metrics = server
    assert post(http.port, *signed(rep("node1")))[0] == 200
    # node1's key, claiming node2 in the header: the signature is checked with node2's key
    code, answer = post(http.port, *signed(rep("node2"), key_of="node1"))
    assert code == 401 and answer == {"error": "bad signature"}
    # node1's key and header, node2 in the body: the body must name the signer
    code, answer = post(http.port, *signed(rep("node2"), as_node="node1"))
    assert code == 403 and "signed by node node1" in answer["error"]
    assert fleet.nodes_reporting(time.time()) == {"node1"}
    # a node Slurm does not know cannot grow the controller's node table
    code, answer = post(http.port, *signed(rep("ghost7")))
    assert code == 403 and "not a node of this cluster" in answer["error"]
    assert fleet.report_lag(time.time()).keys() == {"node1"}
    assert metric(metrics, "slurmguard_reports_total", outcome="unauthorized") == 1
    assert metric(metrics, "slurmguard_reports_total", outcome="forbidden") == 1
    assert metric(metrics, "slurmguard_reports_total", outcome="unknown_node") == 1


@pytest.mark.parametrize("ts", ["nan", "inf", "-inf", "1e400", "", "12:00"])
def test_non_finite_or_malformed_time_is_refused(server, ts):
    """Attack (18.7): a `nan` timestamp passed the age check (every comparison is False)."""
    http, fleet, metrics = server
    code, answer = post(http.port, *signed(rep(), ts=ts))
    assert code == 401 and ("finite" in answer["error"] or "malformed" in answer["error"])
    assert fleet.nodes_reporting(time.time()) == set()


def test_oversized_body_is_refused_before_it_is_read(server):
    """Attack (18.5): 8 MiB bodies were read before the HMAC was checked."""
    http, fleet, metrics = server
    s = socket.create_connection(("127.0.0.1", http.port), timeout=5)
    body, headers = signed(rep())
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(f"POST /v1/report HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {64 << 20}\r\n\r\n".encode())
    t0 = time.monotonic()
    answer = b""
    while chunk := s.recv(4096):  # answered without our sending a byte of the body
        answer += chunk
    answer = answer.decode()
    s.close()
    assert time.monotonic() - t0 < 3
    assert answer.startswith("HTTP/1.1 413") and "controller.max_body_bytes (1048576)" in answer
    assert metric(metrics, "slurmguard_reports_total", outcome="too_large") == 1


def test_half_sent_bodies_hold_neither_threads_nor_memory_and_others_get_through():
    """Attack (18.5): 48 half-sent bodies held 443 MiB and 50 threads for as long as the
    client wanted. Now: a fixed pool, a whole-request deadline, 503 past the queue."""
    http, fleet, metrics = start(workers=4, max_pending=4, request_timeout_s=1.5)
    threads_before = threading.active_count()
    socks = []
    try:
        body, headers = signed(rep())
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", http.port), timeout=5)
            s.sendall(
                f"POST /v1/report HTTP/1.1\r\nHost: x\r\n{head}Content-Length: {1 << 20}\r\n\r\n".encode()
                + b"{" * 1000
            )
            socks.append(s)
        time.sleep(0.5)
        assert threading.active_count() <= threads_before + 1  # no thread per connection
        # beyond 4 workers and 4 queued, connections are refused at once (the rest wait
        # in the kernel's listen backlog, which costs no thread and no buffer here)
        assert metric(metrics, "slurmguard_http_refused_total", reason="overloaded") >= 10
        # the stalled ones are cut off at the deadline; a real agent then gets through
        deadline = time.monotonic() + 10
        while True:
            try:
                code, _ = post(http.port, *signed(rep(seq=int(time.monotonic() * 1000))))
            except (urllib.error.URLError, ConnectionError):
                code = None
            if code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 200
        # every stalled client was answered (503/400) or cut off: none is still being read
        for s in socks:
            s.settimeout(5)
            try:
                answer = s.recv(200)
            except ConnectionResetError:
                answer = b""
            assert answer == b"" or answer.startswith((b"HTTP/1.1 503", b"HTTP/1.1 400")), answer
    finally:
        for s in socks:
            s.close()
        http.stop()


def test_rate_limits_per_address_and_per_node():
    http, fleet, metrics = start(ip_rate_per_s=0.01, ip_burst=5, node_rate_per_s=0.01, node_burst=2)
    try:
        codes = [post(http.port, *signed(rep(seq=i)))[0] for i in range(1, 4)]
        assert codes == [200, 200, 429]  # node1: burst of 2 reports
        assert [post(http.port, *signed(rep("node2", seq=i)))[0] for i in (1, 2)] == [200, 200]
        code, answer = post(http.port, *signed(rep("node2", seq=3)))
        assert code == 429 and "too many requests from 127.0.0.1" in answer["error"]  # 5 per address
        assert metric(metrics, "slurmguard_reports_total", outcome="rate_limited_node") == 1
        assert metric(metrics, "slurmguard_http_refused_total", reason="rate_limited_ip") == 1
    finally:
        http.stop()
    clock = FakeClock(0.0)
    b = TokenBuckets(1.0, 2, now=clock.now, max_keys=2)
    assert [b.allow("a") for _ in range(3)] == [True, True, False]
    clock.advance(1.0)
    assert b.allow("a") and not b.allow("a")
    b.allow("b"), b.allow("c")
    assert len(b._b) == 2  # bounded: an attacker's many addresses do not grow memory


def test_metrics_and_plans_only_for_read_clients_or_on_the_management_listener():
    """Finding 18.9: /metrics and plans needed no authentication."""
    http, fleet, metrics = start(read_clients=("10.0.0.0/8",))
    try:
        for path in ("/metrics", "/v1/jobs/5/plan"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=5)
            assert e.value.code == 403
        assert urllib.request.urlopen(f"http://127.0.0.1:{http.port}/healthz", timeout=5).status == 200
    finally:
        http.stop()
    http, fleet, metrics = start(management_host="127.0.0.1", management_port=0)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=5)
        assert e.value.code == 404
        mgmt = f"http://127.0.0.1:{http.management_port}"
        assert b"slurmguard_reports_total" in urllib.request.urlopen(mgmt + "/metrics", timeout=5).read()
        assert json.loads(urllib.request.urlopen(mgmt + "/v1/jobs/5/plan", timeout=5).read()) == {
            "job_id": "5"
        }
        assert post(http.port, *signed(rep()))[0] == 200  # reports only on the report listener
        code, _ = post(http.management_port, *signed(rep(seq=2)))
        assert code == 404
    finally:
        http.stop()


def test_restarted_agent_is_accepted_and_a_refusal_is_not_delivered(server):
    """Finding 18.3: a restarted agent was rejected until its counter passed the old value,
    and the sender counted `accepted: false` as delivered."""
    http, fleet, metrics = server
    url = f"http://127.0.0.1:{http.port}"
    clock = FakeClock(time.time())
    old = ReportSender(url, node_key(MASTER, "node1"), now=clock.now)
    for _ in range(5):
        old.enqueue(rep())
    assert old.flush() == 5 and old.sent == 5
    clock.advance(1)
    new = ReportSender(url, node_key(MASTER, "node1"), now=clock.now)  # the agent restarted
    new.enqueue(rep())
    assert new.flush() == 1 and new.sent == 1 and new.rejected == 0
    # the old process's report (older epoch) is a replay now: refused, not delivered
    old.enqueue(rep())
    assert old.flush() == 0 and old.sent == 5 and old.rejected == 1 and not old.queue
    # a node key that is not this node's: rejected, not retried, not counted as sent
    wrong = ReportSender(url, node_key(MASTER, "node2"), now=clock.now)
    wrong.enqueue(rep("node1"))
    assert wrong.flush() == 0 and wrong.sent == 0 and wrong.rejected == 1


def test_tls_listener_and_sender(tmp_path):
    key, cert = self_signed_cert(tmp_path)
    http, fleet, metrics = start(tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        sender = ReportSender(
            f"https://127.0.0.1:{http.port}", node_key(MASTER, "node1"), now=time.time, ca_file=str(cert)
        )
        sender.enqueue(rep())
        assert sender.flush() == 1
        # plain HTTP to the TLS port gets nowhere; an agent not trusting the cert refuses it
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            post(http.port, *signed(rep(seq=9)))
        with pytest.raises(urllib.error.URLError):
            post(http.port, *signed(rep(seq=9)), scheme="https", ctx=ssl.create_default_context())
    finally:
        http.stop()
