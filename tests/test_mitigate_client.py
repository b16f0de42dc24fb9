"""Plan client against a real local HTTP server."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slurmguard.errors import InputError
from slurmguard.mitigate.client import PlanClient, PlanPoller
from slurmguard.mitigate.plan import JobPlan, rank_share


class _Controller:
    """A tiny stand-in controller: path -> (status, body, delay_s)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes, float]] = {}
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits.append(self.path)
                status, body, delay = outer.routes.get(self.path, (404, b"", 0.0))
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def set_plan(self, job: str, obj: object, status: int = 200, delay: float = 0.0) -> None:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.routes[f"/v1/jobs/{job}/plan"] = (status, body, delay)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def controller():
    c = _Controller()
    yield c
    c.close()


PLAN = {
    "job_id": "4242",
    "version": 3,
    "action": "rebalance",
    "microbatches": [6, 6, 2, 2],
    "pp": 2,
    "makespan_s": 6.0,
    "future_field": "ignored",
}


def test_fetches_a_typed_plan(controller):
    controller.set_plan("4242", PLAN)
    client = PlanClient(controller.url + "/", 4242)
    plan = client.fetch()
    assert isinstance(plan, JobPlan)
    assert plan.version == 3 and plan.microbatches == (6, 6, 2, 2) and plan.pp == 2 and plan.total == 16
    assert controller.hits == ["/v1/jobs/4242/plan"]
    assert client.errors == 0


def test_no_plan_is_none_without_error(controller):
    client = PlanClient(controller.url, "77")
    assert client.fetch() is None
    assert client.errors == 0
    controller.set_plan("77", b"", status=204)
    assert client.fetch() is None and client.errors == 0


@pytest.mark.parametrize(
    "body,status,why",
    [
        (b"{not json", 200, "malformed"),
        (json.dumps({"job_id": "5", "version": -1}).encode(), 200, "malformed"),
        (json.dumps({"job_id": "5", "version": 1, "microbatches": [3, 0]}).encode(), 200, "malformed"),
        (json.dumps({"job_id": "6", "version": 1}).encode(), 200, "not 5"),
        (b"oops", 500, "HTTP 500"),
    ],
)
def test_bad_answers_are_none_and_counted(controller, body, status, why):
    controller.set_plan("5", body, status=status)
    client = PlanClient(controller.url, "5")
    assert client.fetch() is None
    assert client.errors == 1 and why in client.last_error


def test_unreachable_controller_is_none():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PlanClient(f"http://127.0.0.1:{port}", "9", timeout_s=0.5)
    assert client.fetch() is None
    assert client.errors == 1 and "unreachable" in client.last_error


def test_slow_controller_times_out(controller):
    controller.set_plan("8", PLAN | {"job_id": "8"}, delay=1.5)
    client = PlanClient(controller.url, "8", timeout_s=0.2)
    t0 = time.monotonic()
    assert client.fetch() is None
    assert time.monotonic() - t0 < 1.2
    assert client.errors == 1


@pytest.mark.parametrize(
    "url,job", [("ftp://x/", "1"), ("127.0.0.1:8642", "1"), ("http://h", "1;rm"), ("http://h", "")]
)
def test_bad_configuration_is_an_input_error(url, job):
    with pytest.raises(InputError):
        PlanClient(url, job)


def test_from_env():
    assert PlanClient.from_env({}) is None
    c = PlanClient.from_env(
        {"SLURMGUARD_CONTROLLER_URL": "http://h:1", "SLURM_JOB_ID": "12", "SLURMGUARD_PLAN_TIMEOUT_S": "0.5"}
    )
    assert c is not None and c.url == "http://h:1/v1/jobs/12/plan" and c.timeout_s == 0.5


def test_rank_share_offsets_and_weights():
    plan = JobPlan.model_validate(PLAN)
    shares = [rank_share(plan, r, 4, 16) for r in range(4)]
    assert [(s.count, s.offset) for s in shares] == [(6, 0), (6, 6), (2, 12), (2, 14)]
    # Weighted aggregation: every micro-batch carries dp_size / total.
    assert all(s.loss_scale == 4 / 16 for s in shares)
    assert sum(s.count * s.loss_scale for s in shares) / 4 == 1.0
    uni = rank_share(None, 1, 3, 10)
    assert (uni.count, uni.offset) == (3, 4)
    with pytest.raises(InputError, match="4 DP groups, the job has 2"):
        rank_share(plan, 0, 2, 16)
    with pytest.raises(InputError, match="16 micro-batches, the job has 32"):
        rank_share(plan, 0, 4, 32)


def test_poller_fetches_every_n_steps_and_keeps_last_good_plan(controller):
    client = PlanClient(controller.url, "4242")
    poller = PlanPoller(client, every_n_steps=10, dp_size=4, total=16)
    assert poller.share(0, 3).count == 4  # no plan yet: uniform
    controller.set_plan("4242", PLAN)
    assert poller.share(5, 3).count == 4  # not a polling step
    assert poller.share(10, 3).count == 2
    assert len(controller.hits) == 2
    controller.set_plan("4242", PLAN | {"version": 4, "microbatches": [8, 8]})  # wrong shape
    assert poller.share(20, 3).count == 2 and poller.rejected == 1
    controller.routes.clear()  # controller has no plan any more / is restarting
    assert poller.share(30, 3).count == 2
    controller.set_plan("4242", PLAN | {"version": 5, "microbatches": None})  # withdrawn
    assert poller.share(40, 3).count == 4
