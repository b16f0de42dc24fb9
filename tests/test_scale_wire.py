"""Issue 17.1, ingestion: the compact report wire format (schema version 3) and
what the report listener does with bad input at scale. A real ControllerHTTP on
a loopback port, real sockets, the agent's real ReportSender; fast (about 2 s)."""

from __future__ import annotations

import base64
import json
import struct
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from slurmguard.agent.sender import ReportSender
from slurmguard.controller.fleet import FleetView
from slurmguard.controller.metrics import ControllerMetrics
from slurmguard.controller.server import ControllerHTTP
from slurmguard.wire import (
    NODE_HEADER,
    SCHEMA_VERSION,
    SIG_HEADER,
    TIME_HEADER,
    AgentReport,
    JobReport,
    RankReport,
    ReportError,
    StepSample,
    StepWindow,
    TelemetryColumns,
    TelemetryRecord,
    decode_report,
    encode_report,
    node_key,
    sign,
)
from tests.fixtures.server import start_listener

MASTER = b"wire-test-master-secret-0123456789abcdef"


def _report(node: str = "node1", seq: int = 1, steps: int = 256, ranks: int = 8) -> AgentReport:
    rng = np.random.default_rng(seq)
    now = time.time()
    rks = []
    for r in range(ranks):
        st = 1.0 + rng.normal(0, 0.01, steps)
        end = now - steps + np.cumsum(st)
        ss = [StepSample(end=float(e), step_s=float(s), comm_s=float(s) * 0.3) for e, s in zip(end, st)]
        rks.append(
            RankReport(
                rank=r,
                gpu=r,
                baseline_step_s=1.0,
                baseline_compute_s=0.7,
                steps=ss,
                total_steps=1000,
                last_progress=float(end[-1]),
            )
        )
    tel = [
        TelemetryRecord(signal="power", value=650.0 + g, unit="W", timestamp=now, gpu=g) for g in range(ranks)
    ]
    return AgentReport(
        node=node, seq=seq, epoch=1, sent_at=now, jobs=[JobReport(job_id=7, ranks=rks)], telemetry=tel
    )


def test_a_report_goes_packed_and_comes_back_the_same():
    rep = _report()
    sent_body = encode_report(rep)  # what the agent sends: JSON, a line break, the columns
    head, _, tail = sent_body.partition(b"\n")
    wire4 = json.loads(head)
    assert wire4["schema_version"] == SCHEMA_VERSION == 4
    assert wire4["jobs"][0]["ranks"][3] == {  # fields at their defaults left out
        "rank": 3,
        "gpu": 3,
        "baseline_step_s": 1.0,
        "baseline_compute_s": 0.7,
        "steps": {"n": 256},
        "total_steps": 1000,
        "last_progress": rep.jobs[0].ranks[3].steps[-1].end,
    }
    assert wire4["telemetry"] == {"keys": [["power", "W", g, None] for g in range(8)], "n": 8}
    assert len(tail) == 8 * 24 * 256 + 8 * 20  # raw float64 windows, then the telemetry columns
    # the JSON form (model_dump_json: the columns in base64 in place) reads the same
    body = rep.model_dump_json()
    wire = json.loads(body)
    packed = wire["jobs"][0]["ranks"][3]["steps"]
    assert set(packed) == {"n", "cols"} and packed["n"] == 256
    assert len(base64.b64decode(packed["cols"])) == 24 * 256
    for back in (decode_report(sent_body), decode_report(body.encode())):
        assert back.schema_version == 4
        for sent, got in zip(rep.jobs[0].ranks, back.jobs[0].ranks):
            assert isinstance(got.steps, StepWindow)
            assert got.steps.end.tolist() == [s.end for s in sent.steps]  # bit-exact float64
            assert got.steps.step_s.tolist() == [s.step_s for s in sent.steps]
            assert got.steps.comm_s.tolist() == [s.comm_s for s in sent.steps]
            assert got.model_dump(exclude={"steps"}) == sent.model_dump(exclude={"steps"})
        assert back.model_dump(exclude={"jobs", "telemetry"}) == rep.model_dump(exclude={"jobs", "telemetry"})
        # a window read back serialises to the same bytes (a controller could forward it)
        assert back.model_dump_json() == body
        assert encode_report(back) == sent_body
    assert len(sent_body) < 0.75 * len(body)
    back = decode_report(body.encode())
    # version 3 (the previous release's agents: the JSON form) still reads
    assert decode_report(json.dumps({**wire, "schema_version": 3}).encode()).schema_version == 3
    # telemetry goes as columns (version 3): each device signal named once
    tel = wire["telemetry"]
    assert set(tel) == {"keys", "n", "k", "cols"} and tel["n"] == 8
    assert tel["keys"] == [["power", "W", g, None] for g in range(8)]
    assert isinstance(back.telemetry, TelemetryColumns)
    assert list(back.telemetry) == rep.telemetry  # reads like the list it replaces, bit-exact
    # version 2 (telemetry as a list of records) still reads, into the same samples
    v2 = decode_report(
        json.dumps(
            {**wire, "schema_version": 2, "telemetry": [t.model_dump() for t in rep.telemetry]}
        ).encode()
    )
    assert v2.schema_version == 2 and list(v2.telemetry) == rep.telemetry
    # the default report (256 iterations of 8 ranks): 66 KB, version 1 185 KB
    v1 = json.dumps(
        {
            **wire,
            "schema_version": 1,
            "jobs": [
                {
                    **wire["jobs"][0],
                    "ranks": [
                        {**rk, "steps": [s.model_dump() for s in sent.steps]}
                        for rk, sent in zip(wire["jobs"][0]["ranks"], rep.jobs[0].ranks)
                    ],
                }
            ],
        }
    )
    assert len(body) < 0.4 * len(v1), (len(body), len(v1))
    # version 1 (the previous release's agents) still reads, into the same values
    old = decode_report(v1.encode())
    assert old.schema_version == 1
    assert [s.step_s for s in old.jobs[0].ranks[5].steps] == back.jobs[0].ranks[5].steps.step_s.tolist()


def _cols(end, step, comm) -> str:
    n = len(end)
    return base64.b64encode(struct.pack(f"<{3 * n}d", *end, *step, *comm)).decode()


@pytest.mark.parametrize(
    "steps, why",
    [
        ({"n": 3, "cols": _cols([1, 2, 3], [1, 1, 1], [0, 0, 0])[:-4]}, "bytes; n=3 needs 24 x n = 72"),
        ({"n": 2, "cols": _cols([1, 2, 3], [1, 1, 1], [0, 0, 0])}, "cols holds 72 bytes; n=2 needs"),
        ({"n": 2, "cols": _cols([1, 2], [1, float("nan")], [0, 0])}, "not a finite number"),
        ({"n": 2, "cols": _cols([1, float("inf")], [1, 1], [0, 0])}, "not a finite number"),
        ({"n": 2, "cols": _cols([1, 2], [1, 1], [0, -0.5])}, "step_s and comm_s must be >= 0"),
        ({"n": 1, "cols": "not base64!"}, "cols: Data should be valid base64"),
        ({"n": -1, "cols": ""}, "greater than or equal to 0"),
        ({"n": 1, "cols": _cols([1], [1], [0]), "extra": 1}, "extra"),
        ([{"end": 1.0, "step_s": -1.0, "comm_s": 0.0}], "greater than or equal to 0"),
    ],
)
def test_a_bad_window_is_refused_naming_node_and_field(steps, why):
    http, fleet, metrics = _start()
    try:
        body = _report(ranks=2, steps=4).model_dump_json()
        wire = json.loads(body)
        wire["jobs"][0]["ranks"][1]["steps"] = steps
        code, answer = _post(http.port, "node1", json.dumps(wire).encode())
        assert code == 422
        assert "node node1" in answer["error"] and "jobs.0.ranks.1.steps" in answer["error"]
        assert why in answer["error"]
        assert _metric(metrics, "slurmguard_reports_total", outcome="invalid") == 1
        assert fleet.nodes_reporting(time.time()) == set()
        # the listener goes on: the node's next good report is taken
        code, _ = _post(http.port, "node1", _report(seq=2, ranks=2, steps=4).model_dump_json().encode())
        assert code == 200 and fleet.nodes_reporting(time.time()) == {"node1"}
    finally:
        http.stop()


def _tel(keys, k, ts, values) -> dict:
    return {
        "keys": keys,
        "n": len(ts),
        "k": base64.b64encode(struct.pack(f"<{len(k)}I", *k)).decode(),
        "cols": base64.b64encode(struct.pack(f"<{2 * len(ts)}d", *ts, *values)).decode(),
    }


@pytest.mark.parametrize(
    "tel, why",
    [
        (
            _tel([["power", "W", 0, None]], [0, 1], [1.0, 2.0], [650.0, 651.0]),
            "k names key 1; there are 1 keys",
        ),
        (
            _tel([["power", "W", 0, None]], [0], [1.0, 2.0], [650.0, 651.0]),
            "k holds 4 bytes and cols 32; n=2",
        ),
        (_tel([["power", "W", 0, None]], [0, 0], [1.0, 2.0], [650.0, float("nan")]), "not a finite number"),
        (
            {**_tel([["power", "W", 0, None]], [0], [1.0], [650.0]), "k": "!!"},
            "k: Data should be valid base64",
        ),
        (_tel([["power", "W", "gpu0", None]], [0], [1.0], [650.0]), "valid integer"),
        ([{"signal": "power", "value": "hot", "timestamp": 1.0}], "valid number"),
    ],
)
def test_bad_telemetry_columns_are_refused_naming_node_and_field(tel, why):
    """Version 3 sends a report's samples as columns: every check of a sample holds for
    them (and a value must be a finite number, or the device's mean would be lost)."""
    http, fleet, metrics = _start()
    try:
        wire = json.loads(_report(ranks=1, steps=4).model_dump_json())
        code, answer = _post(http.port, "node1", json.dumps({**wire, "telemetry": tel}).encode())
        assert code == 422, answer
        assert "node node1" in answer["error"] and "telemetry" in answer["error"] and why in answer["error"]
        assert _metric(metrics, "slurmguard_reports_total", outcome="invalid") == 1
        assert fleet.queued_samples() == 0
    finally:
        http.stop()


def test_unknown_versions_nodes_and_oversized_reports_are_refused_and_counted():
    http, fleet, metrics = _start(max_body_bytes=64 * 1024)
    try:
        wire = json.loads(_report(ranks=1, steps=4).model_dump_json())
        code, answer = _post(http.port, "node1", json.dumps({**wire, "schema_version": 5}).encode())
        assert code == 422 and "schema_version" in answer["error"]
        assert _metric(metrics, "slurmguard_reports_total", outcome="invalid") == 1
        code, answer = _post(http.port, "node9", _report("node9", steps=4).model_dump_json().encode())
        assert code == 403 and "node9" in answer["error"]
        assert _metric(metrics, "slurmguard_reports_total", outcome="unknown_node") == 1
        big = _report(steps=2000).model_dump_json().encode()  # 8 ranks x 2,000 iterations: 0.5 MB
        code, answer = _post(http.port, "node2", big)
        assert code == 413 and "max_body_bytes" in answer["error"]
        assert _metric(metrics, "slurmguard_reports_total", outcome="too_large") == 1
        assert fleet.nodes_reporting(time.time()) == set()
    finally:
        http.stop()


def test_the_agents_sender_delivers_packed_windows_the_controller_keeps_as_arrays():
    http, fleet, metrics = _start()
    try:
        sender = ReportSender(f"http://127.0.0.1:{http.port}", node_key(MASTER, "node2"), now=time.time)
        rep = _report("node2", steps=300)
        sender.enqueue(rep)
        assert sender.flush() == 1 and sender.rejected == 0
        (_, kept), *_ = fleet.job_ranks(7, time.time())[0]
        assert isinstance(kept.steps, StepWindow) and len(kept.steps) == fleet.keep_steps == 256
        assert kept.steps.end.tolist() == [s.end for s in rep.jobs[0].ranks[0].steps[-256:]]
        assert fleet.queued_samples() == 8
        assert _metric(metrics, "slurmguard_reports_total", outcome="ok") == 1
    finally:
        http.stop()


def _start(**policy) -> tuple[ControllerHTTP, FleetView, ControllerMetrics]:
    return start_listener(MASTER, known={"node1", "node2"}, **policy)


def _post(port: int, node: str, body: bytes) -> tuple[int, dict]:
    ts = f"{time.time():.3f}"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/report",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            TIME_HEADER: ts,
            NODE_HEADER: node,
            SIG_HEADER: sign(node_key(MASTER, node), ts, node, body),
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _metric(metrics: ControllerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("batch_samples, requests", [(4096, 1), (16, 3)])
def test_a_backlog_goes_in_few_requests_and_every_sample_once(batch_samples, requests):
    """After an outage the sender merges its queue: the newest windows, all samples in order."""
    http, fleet, metrics = _start()
    try:
        sender = ReportSender(
            f"http://127.0.0.1:{http.port}",
            node_key(MASTER, "node1"),
            now=time.time,
            batch_samples=batch_samples,
        )
        reps = [_report(seq=k, ranks=8, steps=8) for k in range(1, 6)]  # 8 samples each
        for r in reps:
            sender.enqueue(r)
        assert sender.flush() == 5 and sender.sent == 5 and not sender.queue
        assert sender.requests == requests
        assert _metric(metrics, "slurmguard_reports_total", outcome="ok") == requests
        assert fleet.queued_samples() == 40  # none lost, none twice
        taken = fleet.take_telemetry()
        assert taken.count == 40 and sorted(taken.means.values()) == [650.0 + g for g in range(8)]
        (_, kept), *_ = fleet.job_ranks(7, time.time())[0]
        assert kept.steps.end.tolist() == [s.end for s in reps[-1].jobs[0].ranks[0].steps]  # newest
    finally:
        http.stop()


@pytest.mark.parametrize(
    "head, code",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /v1/report HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"POST /v1/report HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(100)) + b"\r\n", 431),
        (b"POST /v1/report HTTP/1.1\r\nX-Long: " + b"a" * 10000 + b"\r\n\r\n", 431),
        (b"POST /v1/report HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"POST /v1/report HTTP/1.1\r\n : empty name\r\n\r\n", 400),
    ],
)
def test_a_malformed_request_head_is_answered_and_counted(head, code):
    """The listener reads request heads itself (not http.server's email parser): bounded,
    answered with a reason, counted, and the next client is served."""
    import socket

    http, fleet, metrics = _start()
    try:
        with socket.create_connection(("127.0.0.1", http.port), timeout=5) as s:
            s.sendall(head)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 %d " % code), answer[:80]
        assert b'"error"' in answer
        assert _metric(metrics, "slurmguard_http_refused_total", reason="bad_request") == 1
        code, _ = _post(http.port, "node1", _report(ranks=1, steps=4).model_dump_json().encode())
        assert code == 200
    finally:
        http.stop()


def test_telemetry_columns_keep_hard_failure_samples_as_sent_and_sum_the_others():
    """Through the wire (format 3) into the fleet: the averaged signals become one mean per
    device, the others (an XID, a link going down) stay samples in the order sent."""
    recs = [
        TelemetryRecord(signal="power", value=600.0, unit="W", timestamp=1.0, gpu=0),
        TelemetryRecord(signal="xid", value=79.0, timestamp=1.5, gpu=1),
        TelemetryRecord(signal="power", value=700.0, unit="W", timestamp=2.0, gpu=0),
        TelemetryRecord(signal="ib_port_down", value=1.0, timestamp=2.5, nic="mlx5_0:1"),
        TelemetryRecord(signal="xid", value=48.0, timestamp=3.0, gpu=0),
        TelemetryRecord(signal="power", value=650.0, unit="W", timestamp=3.0, gpu=1),
    ]
    body = encode_report(AgentReport(node="node1", seq=1, sent_at=time.time(), telemetry=recs))
    back = decode_report(body)
    assert isinstance(back.telemetry, TelemetryColumns) and list(back.telemetry) == recs
    fleet = FleetView()
    assert fleet.ingest(back, time.time())
    window = fleet.take_telemetry()
    assert window.count == 6
    assert window.means == {("node1", "power", 0, None): 650.0, ("node1", "power", 1, None): 650.0}
    assert [(s.signal, s.value, s.timestamp, s.gpu, s.nic) for s in window.samples] == [
        ("xid", 79.0, 1.5, 1, None),
        ("ib_port_down", 1.0, 2.5, None, "mlx5_0:1"),
        ("xid", 48.0, 3.0, 0, None),
    ]


def _packed_report(jobs: list[list[np.ndarray | None]]) -> dict:
    """A format-3 report as JSON: per job, per rank a (3, n) window packed, or None for a
    rank sent as a list of records (format 1), which the packed ones are read around."""
    out = []
    for j, ranks in enumerate(jobs):
        rks = []
        for r, a in enumerate(ranks):
            if a is None:
                steps: object = [{"end": 1.0, "step_s": 1.0, "comm_s": 0.25}]
            else:
                steps = {"n": a.shape[1], "cols": base64.b64encode(a.astype("<f8").tobytes()).decode()}
            rks.append({"rank": 8 * j + r, "steps": steps})
        out.append({"job_id": j + 1, "ranks": rks})
    return {"schema_version": 3, "node": "node1", "seq": 1, "sent_at": 1.0, "jobs": out}


def _windows(rng: np.random.Generator, n: int) -> np.ndarray:
    end = 1e9 + np.cumsum(rng.uniform(0.5, 1.5, n))
    step = rng.uniform(0.5, 1.5, n)
    return np.stack([end, step, step * rng.uniform(0, 1, n)])


@pytest.mark.parametrize("same_length", [True, False])
def test_every_bad_value_in_any_window_is_refused_naming_its_rank(same_length):
    """A report's windows are checked together (one array when they have one length):
    whichever job, rank, column and iteration holds a bad value, the report is refused
    naming that rank's steps, and a good report reads back bit-exact."""
    rng = np.random.default_rng(17 if same_length else 18)
    shape = [[None if (j, r) == (1, 2) else 0 for r in range(5)] for j in range(3)]
    for trial in range(40):
        jobs = [
            [
                None if x is None else _windows(rng, 6 if same_length else int(rng.integers(0, 9)))
                for x in ranks
            ]
            for ranks in shape
        ]
        good = decode_report(json.dumps(_packed_report(jobs)).encode())
        for j, ranks in enumerate(jobs):
            for r, a in enumerate(ranks):
                if a is not None:
                    assert np.array_equal(good.jobs[j].ranks[r].steps.columns, a)
        candidates = [
            (j, r)
            for j, ranks in enumerate(jobs)
            for r, a in enumerate(ranks)
            if a is not None and a.shape[1]
        ]
        j, r = candidates[int(rng.integers(len(candidates)))]
        row, col = int(rng.integers(3)), int(rng.integers(jobs[j][r].shape[1]))
        bad, why = [
            (float("nan"), "not a finite number"),
            (float("inf"), "not a finite number"),
            (-float("inf"), "not a finite number"),
            (-0.001, "step_s and comm_s must be >= 0"),
        ][trial % 4]
        if row == 0 and why.startswith("step_s"):
            row = 2  # a negative end is a time, not an error
        jobs[j][r][row, col] = bad
        with pytest.raises(ReportError) as err:
            decode_report(json.dumps(_packed_report(jobs)).encode())
        msg = str(err.value)
        assert f"jobs.{j}.ranks.{r}.steps: " in msg and why in msg, (trial, j, r, row, col, msg)
        assert sum(f"ranks.{x}.steps" in msg for x in range(5)) == 1  # that rank only


def test_a_window_whose_length_does_not_fit_is_named_among_windows_of_one_length():
    """Lengths are checked for all windows at once; a short one is named, not a neighbour."""
    rng = np.random.default_rng(3)
    wire = _packed_report([[_windows(rng, 4) for _ in range(4)]])
    wire["jobs"][0]["ranks"][2]["steps"]["n"] = 5  # 96 bytes sent for 5 iterations
    wire["jobs"][0]["ranks"][3]["steps"]["n"] = 3  # and 96 for 3: the total still fits
    with pytest.raises(ReportError) as err:
        decode_report(json.dumps(wire).encode())
    assert "jobs.0.ranks.2.steps: cols holds 96 bytes; n=5 needs 24 x n = 120" in str(err.value)


def test_format_4_columns_are_checked_and_named_like_the_json_form():
    """Format 4 carries the columns after the JSON: every window and the telemetry take
    their bytes in order; too few or too many, a bad value, or a window without its
    bytes in an older format is refused naming the field."""
    rep = _report(ranks=3, steps=4)
    body = encode_report(rep)
    head, _, tail = body.partition(b"\n")
    assert decode_report(body).jobs[0].ranks[2].steps.end.tolist() == [
        s.end for s in rep.jobs[0].ranks[2].steps
    ]
    bad = [
        (head + b"\n" + tail[:-1], "telemetry: k holds 11 bytes and cols 48; n=3 needs 4 x n = 12"),
        (head + b"\n" + tail + b"\0", "the body's columns hold"),
        (
            head.replace(b'"schema_version":4', b'"schema_version":3') + b"\n" + tail,
            "wire format 3 has nothing",
        ),
        (
            head.replace(b'"schema_version":4', b'"schema_version":3'),
            "jobs.0.ranks.0.steps.cols: Field required",
        ),
    ]
    nan = bytearray(tail)
    nan[2 * 96 + 24 + 8 : 2 * 96 + 24 + 16] = struct.pack("<d", float("nan"))  # rank 2, step_s[1]
    bad.append((head + b"\n" + bytes(nan), "jobs.0.ranks.2.steps: cols holds a value that is not a finite"))
    neg = bytearray(tail)
    neg[96 + 64 : 96 + 72] = struct.pack("<d", -1.0)  # rank 1, comm_s[0]
    bad.append((head + b"\n" + bytes(neg), "jobs.0.ranks.1.steps: step_s and comm_s must be >= 0"))
    tel = bytearray(tail)
    tel[3 * 96 + 16 * 3 : 3 * 96 + 16 * 3 + 4] = struct.pack("<I", 9)  # the first sample's key
    bad.append((head + b"\n" + bytes(tel), "telemetry: k names key 9; there are 3 keys"))
    for b, why in bad:
        with pytest.raises(ReportError) as err:
            decode_report(b)
        assert why in str(err.value), (why, str(err.value))
