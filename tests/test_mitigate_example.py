"""The worked DDP example: weighted aggregation keeps the gradient unchanged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

# after the skip: these import torch
from slurmguard.errors import InputError  # noqa: E402
from slurmguard.mitigate.example_ddp import ExampleConfig, run_example  # noqa: E402
from slurmguard.mitigate.plan import JobPlan, rank_share  # noqa: E402


def _grad_of_split(model, x, y, counts, b):
    """What DDP computes: the mean over ranks of each rank's accumulated gradient."""
    plan = JobPlan(job_id="1", version=1, microbatches=tuple(counts))
    world, total = len(counts), sum(counts)
    acc = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        model.zero_grad()
        share = rank_share(plan, r, world, total)
        for j in range(share.count):
            lo = (share.offset + j) * b
            loss = torch.nn.functional.cross_entropy(model(x[lo : lo + b]), y[lo : lo + b]) * share.loss_scale
            loss.backward()
        for a, p in zip(acc, model.parameters()):
            a += p.grad / world
    return acc


def test_uneven_split_with_loss_scale_gives_the_full_batch_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    b, total = 4, 10
    x = torch.randn(total * b, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (total * b,))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    full = [p.grad.clone() for p in model.parameters()]
    for counts in ([5, 5], [8, 2], [1, 9], [3, 3, 4], [7, 1, 1, 1]):
        got = _grad_of_split(model, x, y, counts, b)
        for g, f in zip(got, full):
            torch.testing.assert_close(g, f, rtol=1e-12, atol=1e-12)


def test_config_checks():
    with pytest.raises(InputError, match="world-size"):
        ExampleConfig(world_size=1).check()
    with pytest.raises(InputError, match="at least two micro-batches"):
        ExampleConfig(world_size=2, microbatches=3).check()
    with pytest.raises(InputError, match="slow-rank"):
        ExampleConfig(world_size=2, slow_rank=2).check()


@pytest.mark.slow
def test_two_gloo_ranks_plan_shifts_work_off_the_slow_rank():
    cfg = ExampleConfig(
        world_size=2,
        slow_rank=1,
        slow_factor=4.0,
        microbatches=8,
        batch=16,
        width=64,
        steps=2,
        warmup=1,
        profile_steps=2,
        timeout_s=60.0,
    )
    res = run_example(cfg)
    assert sum(res.plan) == 8 and all(m >= 1 for m in res.plan)
    assert res.per_microbatch_s[1] > res.per_microbatch_s[0]
    assert res.plan[1] < res.plan[0]
    assert res.plan_source == "planner"
    # Same global batch, same parameters: the planned split's gradient equals the uniform one's.
    assert res.grad_max_abs > 0
    assert res.grad_max_abs_diff <= 1e-5 * res.grad_max_abs + 1e-7


@pytest.mark.slow
def test_example_takes_its_plan_from_a_controller():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = json.dumps({"job_id": "77", "version": 2, "microbatches": [6, 2], "makespan_s": 0.0}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/v1/jobs/77/plan"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        cfg = ExampleConfig(
            world_size=2,
            microbatches=8,
            batch=16,
            width=64,
            steps=1,
            warmup=1,
            profile_steps=1,
            controller_url=f"http://127.0.0.1:{server.server_address[1]}",
            job_id="77",
        )
        res = run_example(cfg)
    finally:
        server.shutdown()
        server.server_close()
    assert res.plan_source == "controller" and res.plan == [6, 2]
    assert res.grad_max_abs_diff <= 1e-5 * res.grad_max_abs + 1e-7
