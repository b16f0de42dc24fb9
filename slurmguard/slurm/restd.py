"""SlurmClient over slurmrestd (Slurm's REST API), JWT-authenticated.

What the REST API of the configured version offers goes over HTTP; the rest
falls back, per operation, to the command backend (which keeps the one
implementation of the ownership rules for node writes). For openapi v0.0.38
(Slurm 22.05, the version this was checked against with `GET /openapi/v3`
on the dev cluster) the API has:

| operation | over REST | why not |
| --- | --- | --- |
| version, nodes, node, jobs, job, reservations, fleet | GET /ping, /nodes, /jobs, /job/{id}, /reservations | |
| signal, cancel | commands (`scancel`) | DELETE /job/{id}?signal=USR1 ended the job on 22.05 (CANCELLED or FAILED, seen on the dev cluster) instead of delivering a checkpoint signal, and has no batch-only flag; a plain DELETE left a job with a step FAILED, not CANCELLED |
| signal (batch step only) | commands (`scancel --batch`) | no batch-only flag |
| submit | POST /job/submit | commands when a node list or raw sbatch arguments are asked for: v0.0.38 has no required-nodes field |
| set/clear comment, drain, resume, reboot | commands (`scontrol update/reboot`) | no node update before v0.0.39 |
| create/delete reservation | commands | no reservation writes in v0.0.38 |
| requeue, release_requeue_hold | commands | no requeue operation |

`FALLBACKS` lists the operations that always use commands. Tokens: signed
here from the cluster's JWT key (`AuthAltParameters=jwt_key=`; HS256, the
`sun` claim names the user, renewed before expiry), read from a file written
by `scontrol token` (re-read when it changes), or $SLURM_JWT.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from slurmguard.slurm import parse, validate
from slurmguard.slurm.commands import CommandSlurmClient, fleet_view
from slurmguard.slurm.errors import SlurmCommandError, SlurmError, SlurmUnavailable, UnknownJob
from slurmguard.slurm.models import JobInfo, NodeInfo, ReservationInfo

FALLBACKS = frozenset(
    {
        "set_comment",
        "clear_comment",
        "drain",
        "resume",
        "reboot",
        "create_reservation",
        "delete_reservation",
        "requeue",
        "release_requeue_hold",
        "cancel",
        "signal",
    }
)
"""Operations the REST backend always runs through the command backend (v0.0.38)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign_token(key: bytes, user: str, lifespan_s: int, now: float) -> str:
    """An HS256 JWT as slurmctld's auth/jwt accepts it: claims exp, iat, sun (user)."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    claims = {"exp": int(now) + int(lifespan_s), "iat": int(now), "sun": user}
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    sig = hmac.new(key, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64(sig)}"


class TokenSource:
    """Where the JWT comes from: key_file (sign), token_file (`scontrol token` output) or $SLURM_JWT.

    lifespan_s: of tokens signed here (s, default 1800); they are renewed when
    less than a third is left. clock: Unix seconds.
    """

    def __init__(
        self,
        *,
        user: str,
        key_file: str | None = None,
        token_file: str | None = None,
        lifespan_s: int = 1800,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.user = user
        self.key_file = key_file
        self.token_file = token_file
        self.lifespan_s = lifespan_s
        self.clock = clock
        self._token: str | None = None
        self._expires = 0.0
        self._file_stamp: tuple[float, int] | None = None
        if key_file is None and token_file is None and not os.environ.get("SLURM_JWT"):
            raise SlurmError(
                "slurm.backend restd needs a token: set slurm.restd_jwt_key_file "
                "or slurm.restd_token_file, or export SLURM_JWT"
            )

    def token(self) -> str:
        now = self.clock()
        if self.key_file is not None:
            if self._token is None or now > self._expires - self.lifespan_s / 3:
                try:
                    key = Path(self.key_file).read_bytes()
                except OSError as exc:
                    raise SlurmError(f"slurm.restd_jwt_key_file {self.key_file}: {exc}") from None
                self._token = sign_token(key, self.user, self.lifespan_s, now)
                self._expires = now + self.lifespan_s
            return self._token
        if self.token_file is not None:
            p = Path(self.token_file)
            try:
                st = p.stat()
                stamp = (st.st_mtime, st.st_size)
                if stamp != self._file_stamp:
                    self._token = _strip_token(p.read_text())
                    self._file_stamp = stamp
            except OSError as exc:
                raise SlurmError(f"slurm.restd_token_file {p}: {exc}") from None
            if not self._token:
                raise SlurmError(f"slurm.restd_token_file {p} holds no token")
            return self._token
        return _strip_token(os.environ.get("SLURM_JWT", ""))


def _strip_token(text: str) -> str:
    text = text.strip()
    return text.split("=", 1)[1].strip() if text.startswith("SLURM_JWT=") else text


class RestdSlurmClient:
    """SlurmClient on slurmrestd; operations the API lacks go to `fallback`.

    url: http://host:port of slurmrestd. api: openapi plugin version in the
    paths (v0.0.38 on Slurm 22.05). timeout_s: per request, seconds.
    """

    def __init__(
        self,
        url: str,
        tokens: TokenSource,
        *,
        api: str = "v0.0.38",
        timeout_s: float = 15.0,
        fallback: CommandSlurmClient | None = None,
    ) -> None:
        self.base = url.rstrip("/") + f"/slurm/{api}"
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.fallback = fallback or CommandSlurmClient(timeout_s=timeout_s)
        self._version: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ plumbing
    def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
        job: int | None = None,
    ) -> dict[str, Any]:
        url = self.base + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            url,
            data=data,
            method=method,
            headers={
                "X-SLURM-USER-NAME": self.tokens.user,
                "X-SLURM-USER-TOKEN": self.tokens.token(),
                "Accept": "application/json",
                **({"Content-Type": "application/json"} if data else {}),
            },
        )
        what = f"{method} {url}"
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (http(s) URL from policy)
                text = resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", errors="replace")
            if exc.code in (401, 403):
                raise SlurmError(
                    f"{what}: slurmrestd refused the token for user "
                    f"{self.tokens.user!r} (HTTP {exc.code}: {text.strip()[:120]})",
                    [what],
                    text,
                ) from None
            doc = _json_or_none(text)
            msg = _errors_text(doc) or text.strip()[:200] or exc.reason
            if job is not None and "invalid job id" in msg.lower():
                raise UnknownJob(f"unknown job {job}: {msg}", [what], text) from None
            if "(error -1)" in msg:
                # what 22.05 answers when slurmctld rejects the forwarded token
                msg += (
                    " (slurmctld refused the token? check slurm.restd_jwt_key_file /"
                    " restd_token_file and the token's expiry)"
                )
            raise SlurmCommandError(f"{what}: HTTP {exc.code}: {msg}", [what], text) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SlurmUnavailable(f"slurmrestd unreachable: {what}: {reason}", [what]) from None
        doc = _json_or_none(text)
        if doc is None:
            raise SlurmCommandError(f"{what}: not JSON: {text.strip()[:120]!r}", [what], text)
        msg = _errors_text(doc)
        if msg:
            if job is not None and "invalid job id" in msg.lower():
                raise UnknownJob(f"unknown job {job}: {msg}", [what], text)
            raise SlurmCommandError(f"{what}: {msg}", [what], text)
        return doc

    # ------------------------------------------------------------------ reads
    def version(self) -> tuple[int, int, int]:
        if self._version is None:
            v = self._request("GET", "/ping").get("meta", {}).get("Slurm", {}).get("version", {})
            self._version = (int(v.get("major", 0)), int(v.get("minor", 0)), int(v.get("micro", 0)))
        return self._version

    def fleet(self) -> tuple[list[NodeInfo], list[JobInfo]]:
        """Every node (with its running jobs) and every queued job: one GET /nodes, one GET /jobs."""
        jobs = parse.jobs_from_json(self._request("GET", "/jobs"))
        nodes = parse.nodes_from_json(self._request("GET", "/nodes"))
        return fleet_view(nodes, jobs, None), jobs

    def nodes(self, names: Iterable[str] | None = None) -> list[NodeInfo]:
        wanted = [validate.node_name(n) for n in names] if names is not None else None
        jobs = parse.jobs_from_json(self._request("GET", "/jobs"))
        return fleet_view(parse.nodes_from_json(self._request("GET", "/nodes")), jobs, wanted)

    def node(self, name: str) -> NodeInfo:
        return self.nodes([name])[0]

    def jobs(self, job_ids: Iterable[int] | None = None) -> list[JobInfo]:
        ids = {validate.job_id(j) for j in job_ids} if job_ids is not None else None
        jobs = parse.jobs_from_json(self._request("GET", "/jobs"))
        return jobs if ids is None else [j for j in jobs if j.job_id in ids]

    def job(self, job_id: int) -> JobInfo:
        jid = validate.job_id(job_id)
        found = parse.jobs_from_json(self._request("GET", f"/job/{jid}", job=jid))
        if not found:
            raise UnknownJob(f"unknown job {jid}")
        return found[0]

    def reservations(self) -> list[ReservationInfo]:
        return parse.reservations_from_json(self._request("GET", "/reservations"))

    # ------------------------------------------------------------------ writes over REST
    def submit(
        self,
        script: str | Path,
        *,
        job_name: str | None = None,
        nodelist: Sequence[str] = (),
        reservation: str | None = None,
        time_limit_min: int | None = None,
        partition: str | None = None,
        output: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> int:
        if nodelist or extra_args:
            return self.fallback.submit(
                script,
                job_name=job_name,
                nodelist=nodelist,
                reservation=reservation,
                time_limit_min=time_limit_min,
                partition=partition,
                output=output,
                extra_args=extra_args,
                env=env,
            )
        if isinstance(script, Path) or not str(script).startswith("#!"):
            path = Path(script)
            if not path.is_file():
                raise SlurmError(f"batch script not found: {path}")
            text = path.read_text()
        else:
            text = str(script)
        # sbatch's default --export=ALL: the submitter's environment, plus env
        job: dict[str, Any] = {
            "environment": {**os.environ, **(env or {})},
            "current_working_directory": os.getcwd(),
        }
        if job_name:
            job["name"] = job_name
        if reservation:
            job["reservation"] = validate.reservation_name(reservation)
        if time_limit_min is not None:
            if time_limit_min <= 0:
                raise SlurmError("time limit must be positive (minutes)")
            job["time_limit"] = int(time_limit_min)
        if partition:
            job["partition"] = validate.node_name(partition)
        if output:
            job["standard_output"] = output
        doc = self._request("POST", "/job/submit", body={"script": text, "job": job})
        jid = doc.get("job_id")
        if not isinstance(jid, int):
            raise SlurmCommandError(f"slurmrestd returned no job id: {doc!r:.200}")
        return jid

    # ------------------------------------------------------------------ writes via commands
    def set_comment(self, node: str, text: str) -> str:
        return self.fallback.set_comment(node, text)

    def clear_comment(self, node: str) -> None:
        self.fallback.clear_comment(node)

    def drain(self, node: str, reason: str) -> str:
        return self.fallback.drain(node, reason)

    def resume(self, node: str) -> None:
        self.fallback.resume(node)

    def reboot(self, node: str, reason: str, *, next_state: str = "resume", asap: bool = True) -> str:
        return self.fallback.reboot(node, reason, next_state=next_state, asap=asap)

    def create_reservation(
        self, name: str, nodes: Sequence[str], *, duration_min: int, users: Sequence[str] = ("root",)
    ) -> None:
        self.fallback.create_reservation(name, nodes, duration_min=duration_min, users=users)

    def delete_reservation(self, name: str) -> None:
        self.fallback.delete_reservation(name)

    def requeue(self, job_id: int, *, restart_now: bool = True, settle_s: float = 10.0) -> None:
        self.fallback.requeue(job_id, restart_now=restart_now, settle_s=settle_s)

    def release_requeue_hold(self, job_id: int) -> str:
        return self.fallback.release_requeue_hold(job_id)

    def cancel(self, job_id: int) -> None:
        self.fallback.cancel(job_id)

    def signal(self, job_id: int, signal: str, *, batch_only: bool = True) -> None:
        self.fallback.signal(job_id, signal, batch_only=batch_only)


def _json_or_none(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _errors_text(doc: dict[str, Any] | None) -> str:
    """The `errors` of a slurmrestd reply as one line ('' when none)."""
    errs = (doc or {}).get("errors") or []
    parts = []
    for e in errs:
        if isinstance(e, dict):
            text = e.get("error") or e.get("description") or ""
            code = e.get("error_number", e.get("errno"))
            parts.append(f"{text} (error {code})" if code not in (None, 0) else str(text))
        else:
            parts.append(str(e))
    return "; ".join(p for p in parts if p)
