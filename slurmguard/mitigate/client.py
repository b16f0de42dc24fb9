"""What a training loop calls to get its mitigation plan from the controller.

    client = PlanClient.from_env()           # or PlanClient(url, job_id)
    poller = PlanPoller(client, every_n_steps=50, dp_size=world, total=M)
    for step in ...:
        share = poller.share(step, dp_rank)  # fetches every 50 steps
        ... run share.count micro-batches from share.offset, loss * share.loss_scale ...

Fetching never raises into the training loop: an unreachable controller, a
timeout, no plan (404/204) or a malformed answer all give ``None`` (the loop
keeps its current split); failures are counted and logged. In a multi-rank job
let one rank fetch and broadcast the plan (``plan.model_dump_json()``) so all
ranks switch at the same step.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Protocol

from pydantic import ValidationError

from slurmguard.errors import InputError
from slurmguard.mitigate.plan import JobPlan, RankShare, rank_share

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
"""Per request, seconds: short, because a training step waits on it."""

MAX_BODY_BYTES = 1 << 20


class HttpGet(Protocol):
    """GET ``url``; return (HTTP status, body). Raises OSError when unreachable."""

    def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]: ...


class UrllibGet:
    """HttpGet over urllib (standard library, honours the timeout per socket op)."""

    def __call__(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            return exc.code, b""


class PlanClient:
    """Fetches ``GET {controller_url}/v1/jobs/{job_id}/plan``.

    ``timeout_s``: per request (default 2 s). ``http``: transport (default urllib).
    """

    def __init__(
        self,
        controller_url: str,
        job_id: str | int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        http: HttpGet | None = None,
    ) -> None:
        parts = urllib.parse.urlsplit(controller_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InputError(f"plan client: controller URL {controller_url!r} is not an http(s) URL")
        job = str(job_id).strip()
        if not job or not all(c.isalnum() or c in "_+." for c in job):
            raise InputError(f"plan client: job id {job_id!r} is not a Slurm job id")
        if not timeout_s > 0:
            raise InputError(f"plan client: timeout {timeout_s!r} must be > 0 seconds")
        self.job_id = job
        self.url = f"{controller_url.rstrip('/')}/v1/jobs/{urllib.parse.quote(job, safe='')}/plan"
        self.timeout_s = float(timeout_s)
        self._http: HttpGet = http or UrllibGet()
        self.errors = 0
        self.last_error: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PlanClient | None:
        """From ``SLURMGUARD_CONTROLLER_URL`` and ``SLURM_JOB_ID``; None if unset."""
        env = dict(os.environ) if env is None else env
        url, job = env.get("SLURMGUARD_CONTROLLER_URL"), env.get("SLURM_JOB_ID")
        if not url or not job:
            return None
        timeout = float(env.get("SLURMGUARD_PLAN_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        return cls(url, job, timeout_s=timeout)

    def _fail(self, why: str) -> None:
        self.errors += 1
        self.last_error = why
        log.warning("slurmguard plan fetch %s: %s", self.url, why)

    def fetch(self) -> JobPlan | None:
        """The job's current plan, or None (no plan, or the controller failed)."""
        try:
            status, body = self._http(self.url, self.timeout_s)
        except (OSError, ValueError) as exc:  # URLError, timeouts, refused, reset
            self._fail(f"unreachable: {getattr(exc, 'reason', exc)}")
            return None
        if status in (204, 404):
            return None
        if status != 200:
            self._fail(f"HTTP {status}")
            return None
        if len(body) > MAX_BODY_BYTES:
            self._fail(f"answer larger than {MAX_BODY_BYTES} bytes")
            return None
        try:
            plan = JobPlan.model_validate(json.loads(body))
        except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
            first = str(exc).splitlines()
            self._fail(f"malformed plan: {first[0] if first else exc}")
            return None
        if plan.job_id != self.job_id:
            self._fail(f"plan is for job {plan.job_id}, not {self.job_id}")
            return None
        return plan


class PlanPoller:
    """Asks for the plan every ``every_n_steps`` steps and keeps the last good one.

    A plan that does not fit the job (``dp_size`` groups, ``total``
    micro-batches) is refused with a warning and the previous one stays.
    A plan with ``microbatches`` None (e.g. the controller withdrew the
    rebalance) restores the uniform split.
    """

    def __init__(self, client: PlanClient | None, every_n_steps: int, dp_size: int, total: int) -> None:
        if every_n_steps < 1:
            raise InputError(f"plan poller: every_n_steps={every_n_steps} must be >= 1")
        self.client = client
        self.every = every_n_steps
        self.dp_size = dp_size
        self.total = total
        self.plan: JobPlan | None = None
        self.rejected = 0

    def poll(self, step: int) -> JobPlan | None:
        """The plan in force at ``step`` (fetches on multiples of every_n_steps)."""
        if self.client is not None and step % self.every == 0:
            new = self.client.fetch()
            if new is not None and (self.plan is None or new.version != self.plan.version):
                try:
                    rank_share(new, 0, self.dp_size, self.total)
                except InputError as exc:
                    self.rejected += 1
                    log.warning("slurmguard: ignoring plan: %s", exc)
                else:
                    self.plan = new
        return self.plan

    def share(self, step: int, dp_rank: int) -> RankShare:
        return rank_share(self.poll(step), dp_rank, self.dp_size, self.total)
