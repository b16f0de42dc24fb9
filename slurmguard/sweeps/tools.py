"""The field's standard GPU/network tools as optional sweep stages.

Each stage runs one tool where it is installed (`SweepPolicy.stages`), parses its output
into figures stored beside slurmguard's own, and ends in one of four statuses
(`slurmguard.sweeps.result.StageResult`):

* ``pass``: the tool ran and reported no failure (figures at or above `min_gbps`);
* ``fail``: the tool reported a hardware failure, wrong data or a figure below
  `min_gbps`: node evidence, the sweep fails with the tool's own words;
* ``error``: the tool is required but missing, hung past `timeout_s`, exited without a
  result, or printed something this parser does not recognise: the stage failed, the node
  is not blamed for it (the sweep is inconclusive);
* ``skipped``: switched off, not installed (``run: auto``), or not applicable (CPU path,
  no InfiniBand device).

Formats (from the tools' documentation and recorded outputs):

* ``dcgmi diag -r N -j``: DCGM 3.x ``{"DCGM GPU Diagnostic": {"test_categories": [{"category",
  "tests": [{"name", "results": [{"gpu_ids"|"gpu_id", "status": Pass|Fail|Warn|Skip,
  "warnings": [str]}]}]}]}}``; DCGM 4.x ``{"DCGM Diagnostic": {"test_categories": [...
  "results": [{"entity_group": "GPU", "entity_id", "status", "warnings": [{"warning",
  "error_id", ...}]}], "test_summary": {"status"}}]}`` with "Driver Version Detected" under
  "metadata". dcgmi may print a banner line before the JSON and exits non-zero on a
  failure. A failed Deployment/software check (persistence mode off, a setting) is a
  configuration finding, not the hardware: an error, not a fail.
* nccl-tests ``all_reduce_perf``: '#' header and footer lines; one row per size:
  ``size count type redop [root] time algbw busbw #wrong time algbw busbw #wrong``
  (out-of-place then in-place; older releases have no root column and a float "error"
  column; ``N/A`` without -c); footer ``# Out of bounds values : N OK|FAILED`` and
  ``# Avg bus bandwidth : X``. busbw = algbw * 2(n-1)/n for all-reduce.
* ``nvbandwidth``: per benchmark ``Running <name>.``, a title ``memcpy CE ... bandwidth
  (GB/s)``, a matrix (``N/A`` on the diagonal) and ``SUM <name> <GB/s>``.
* perftest ``ib_write_bw --report_gbits``: a table headed ``#bytes #iterations BW peak[Gb/sec]
  BW average[Gb/sec] MsgRate[Mpps]``; without --report_gbits the unit is MB/sec (MiB/s).

Subprocesses: argv lists (no shell), the executable resolved first, a timeout per stage;
the caller's process group is killed by Slurm with the job, so a stage cannot outlive it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from slurmguard.config import ToolStage, ToolStages

EVIDENCE_CHARS = 4000
MIB = 1 << 20


@dataclass(frozen=True)
class StageOutcome:
    """What a stage found; `to_dict` is the result schema's stage record."""

    name: str
    status: str
    reason: str
    seconds: float = 0.0
    figures: Mapping[str, float] = field(default_factory=dict)
    evidence: str = ""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason[:1000],
            "seconds": round(self.seconds, 3),
            "figures": dict(self.figures),
            "evidence": self.evidence[-EVIDENCE_CHARS:],
        }


class ParseError(ValueError):
    """The output is not what the tool prints: the stage errs, the node is not blamed."""


@dataclass(frozen=True)
class Parsed:
    failed: tuple[str, ...]
    """The tool's own failure findings (empty = pass)."""
    figures: Mapping[str, float]
    errors: tuple[str, ...] = ()
    """Findings that are not the hardware (configuration): the stage errs on them."""


# ---------------------------------------------------------------- dcgmi diag
_DCGM_OK = {"pass", "skip", "skipped", "warn", "warning", "not run"}


def parse_dcgm_diag(text: str) -> Parsed:
    """`dcgmi diag -r N -j` output (DCGM 3.x or 4.x document)."""
    start = text.find("{")
    end = text.rfind("}")
    if start < 0 or end < start:
        raise ParseError("no JSON document in the output")
    try:
        doc = json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise ParseError(f"invalid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(doc, dict):
        raise ParseError("the JSON document is not an object")
    body = doc.get("DCGM GPU Diagnostic") or doc.get("DCGM Diagnostic")
    cats = body.get("test_categories") if isinstance(body, dict) else None
    if not isinstance(cats, list) or not cats:
        raise ParseError("no test_categories under 'DCGM GPU Diagnostic' / 'DCGM Diagnostic'")
    failed: list[str] = []
    config: list[str] = []
    counts = {"tests": 0.0, "failed": 0.0, "warned": 0.0}
    for cat in cats:
        if not isinstance(cat, dict) or not isinstance(cat.get("tests"), list):
            raise ParseError("a test category without a list of tests")
        category = str(cat.get("category", "?"))
        for test in cat["tests"]:
            if not isinstance(test, dict) or not isinstance(test.get("results"), list):
                raise ParseError(f"{category}: a test without results")
            name = str(test.get("name", "?"))
            counts["tests"] += 1
            for r in test["results"]:
                if not isinstance(r, dict):
                    raise ParseError(f"{name}: a result that is not an object")
                status = str(r.get("status", "")).strip().lower()
                gpu = r.get("entity_id", r.get("gpu_ids", r.get("gpu_id", "?")))
                if status in ("warn", "warning"):
                    counts["warned"] += 1
                if status in _DCGM_OK:
                    continue
                why = "; ".join(_dcgm_warnings(r)) or f"status {r.get('status')!r}"
                finding = f"{name} gpu{gpu}: {why}"
                if status != "fail":
                    # a status word this parser does not know is no evidence of health
                    raise ParseError(f"{name} gpu{gpu}: unknown status {r.get('status')!r}")
                counts["failed"] += 1
                if category.lower() == "deployment" or name.lower() == "software":
                    config.append(finding)
                else:
                    failed.append(finding)
    if counts["tests"] == 0:
        raise ParseError("the diagnostic reported no test")
    return Parsed(tuple(failed), counts, tuple(config))


def _dcgm_warnings(r: dict) -> list[str]:
    out = []
    for w in r.get("warnings") or []:
        if isinstance(w, dict):
            w = w.get("warning", "")
        out.append(" ".join(str(w).split())[:200])
    return [w for w in out if w]


# ---------------------------------------------------------------- nccl-tests
def parse_nccl_tests(text: str) -> Parsed:
    """nccl-tests *_perf output: busbw per size (out-of-place), wrong values, the average."""
    figures: dict[str, float] = {}
    wrong: list[str] = []
    rows = 0
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = re.match(r"#\s*Out of bounds values\s*:\s*(\d+)\s+(\w+)", s)
            if m and (int(m.group(1)) > 0 or m.group(2).upper() != "OK"):
                wrong.append(f"out of bounds values: {m.group(1)} {m.group(2)}")
            m = re.match(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)", s)
            if m:
                figures["avg_busbw_gbps"] = float(m.group(1))
            continue
        cols = s.split()
        if not cols[0].isdigit():
            continue  # NCCL INFO/WARN lines, banners
        if len(cols) not in (12, 13):
            raise ParseError(f"unexpected result row ({len(cols)} columns): {s[:120]}")
        off = len(cols) - 12  # 1 when the root column is there
        try:
            size = int(cols[0])
            busbw = float(cols[6 + off])
            busbw_in = float(cols[10 + off])
        except ValueError:
            raise ParseError(f"unreadable result row: {s[:120]}") from None
        rows += 1
        key = f"{size // MIB}MB" if size % MIB == 0 else f"{size}B"
        figures[f"busbw_gbps/{key}"] = busbw
        figures[f"busbw_inplace_gbps/{key}"] = busbw_in
        for col in (cols[7 + off], cols[11 + off]):
            bad = _wrong_count(col)
            if bad:
                wrong.append(f"{bad:g} wrong values at {key}")
    if rows == 0:
        raise ParseError("no result rows")
    return Parsed(tuple(wrong), figures)


def _wrong_count(col: str) -> float:
    if col.upper() == "N/A":
        return 0.0
    try:
        v = float(col)  # '#wrong' count, or the older float 'error' column
    except ValueError:
        raise ParseError(f"unreadable #wrong column {col!r}") from None
    return 0.0 if math.isfinite(v) and v == 0 else (v if math.isfinite(v) else math.inf)


# ---------------------------------------------------------------- nvbandwidth
def parse_nvbandwidth(text: str) -> Parsed:
    """nvbandwidth output: SUM and the smallest matrix entry per benchmark (GB/s)."""
    figures: dict[str, float] = {}
    current: str | None = None
    cells: list[float] = []
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"Running (\w+)\.", s)
        if m:
            current, cells = m.group(1), []
            continue
        m = re.match(r"SUM (\w+) ([0-9.eE+-]+)$", s)
        if m:
            figures[f"{m.group(1)}/sum_gbps"] = float(m.group(2))
            if m.group(1) == current and cells:
                figures[f"{m.group(1)}/min_gbps"] = min(cells)
            continue
        if current and re.match(r"^\d+(\s+\S+)+$", s):
            parts = s.split()[1:]
            # a matrix row: its index, then GB/s with decimals or N/A (the column header
            # row is bare integers)
            if all(re.match(r"^[0-9]+\.[0-9]+$|^N/A$", p) for p in parts):
                cells.extend(float(p) for p in parts if p != "N/A")
    if not figures:
        raise ParseError("no 'SUM <benchmark> <GB/s>' line")
    return Parsed((), figures)


# ---------------------------------------------------------------- ib_write_bw
def parse_ib_write_bw(text: str) -> Parsed:
    """perftest bandwidth table: average and peak of the last row, in GB/s."""
    unit = None
    last: list[str] | None = None
    for line in text.splitlines():
        s = line.strip()
        m = re.match(r"#bytes\s+#iterations\s+BW peak\[(\S+)\]\s+BW average\[(\S+)\]", s)
        if m:
            unit = m.group(2)
            continue
        if unit and re.match(r"^\d+\s+\d+\s+[0-9.]+\s+[0-9.]+", s):
            last = s.split()
    if unit is None:
        raise ParseError("no '#bytes #iterations BW peak[...] BW average[...]' table")
    if last is None:
        raise ParseError("the bandwidth table has no result row")
    factor = {"Gb/sec": 1 / 8.0, "MB/sec": MIB / 1e9}.get(unit)
    if factor is None:
        raise ParseError(f"unknown bandwidth unit {unit!r}")
    return Parsed(
        (),
        {"bytes": float(last[0]), "peak_gbps": float(last[2]) * factor, "avg_gbps": float(last[3]) * factor},
    )


# ---------------------------------------------------------------- running
Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


def run_argv(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        shell=False,
        errors="replace",
        stdin=subprocess.DEVNULL,
    )


def resolve(command: str) -> str | None:
    """Absolute path of the tool, or None when it is not installed here."""
    if os.path.isabs(command):
        return command if os.access(command, os.X_OK) else None
    return shutil.which(command)


def run_stage(
    name: str,
    cfg: ToolStage,
    args: Sequence[str],
    parse: Callable[[str], Parsed],
    *,
    min_key: str | None = None,
    runner: Runner = run_argv,
    applicable: str | None = None,
) -> StageOutcome:
    """Run one tool stage and judge its output (module docstring)."""
    if cfg.run == "never":
        return StageOutcome(name, "skipped", "switched off in the policy")
    if applicable is not None:
        return StageOutcome(name, "skipped", f"not applicable: {applicable}")
    exe = resolve(cfg.command)
    if exe is None:
        if cfg.run == "required":
            return StageOutcome(name, "error", f"{cfg.command}: not installed on this node (required)")
        return StageOutcome(name, "skipped", f"{cfg.command}: not installed")
    argv = [exe, *args, *cfg.args]
    t0 = time.monotonic()
    try:
        proc = runner(argv, cfg.timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = _text(exc.stdout) + _text(exc.stderr)
        return StageOutcome(
            name, "error", f"timed out after {cfg.timeout_s:g}s", time.monotonic() - t0, {}, out
        )
    except OSError as exc:
        return StageOutcome(name, "error", f"cannot run {exe}: {exc.strerror or exc}", time.monotonic() - t0)
    secs = time.monotonic() - t0
    out = (proc.stdout or "") + (("\n" + proc.stderr) if proc.stderr else "")
    try:
        parsed = parse(proc.stdout or "")
    except ParseError as exc:
        why = f"exit {proc.returncode}, unrecognised output: {exc}"
        return StageOutcome(name, "error", why, secs, {}, out)
    if parsed.failed:
        return StageOutcome(name, "fail", "; ".join(parsed.failed)[:1000], secs, parsed.figures, out)
    if parsed.errors:
        return StageOutcome(
            name, "error", "configuration: " + "; ".join(parsed.errors)[:990], secs, parsed.figures, out
        )
    if proc.returncode != 0:
        return StageOutcome(
            name, "error", f"exit {proc.returncode} without a reported failure", secs, parsed.figures, out
        )
    if cfg.min_gbps is not None and min_key is not None:
        low = {k: v for k, v in parsed.figures.items() if re.fullmatch(min_key, k) and v < cfg.min_gbps}
        if low:
            k, v = min(low.items(), key=lambda kv: kv[1])
            return StageOutcome(
                name, "fail", f"{k} {v:.4g} GB/s below {cfg.min_gbps:g}", secs, parsed.figures, out
            )
    return StageOutcome(name, "pass", "ok", secs, parsed.figures, out)


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b


def node_stages(
    stages: ToolStages, *, gpus: int, device: str, runner: Runner = run_argv
) -> list[StageOutcome]:
    """The 1-node sweep's stages: DCGM diagnostics, nccl-tests all-reduce, nvbandwidth."""
    cpu = "the CPU path has no GPU" if device != "cuda" else None
    out = [
        run_stage(
            "dcgm_diag",
            stages.dcgm_diag,
            ["diag", "-r", str(stages.dcgm_level), "-j"],
            parse_dcgm_diag,
            runner=runner,
            applicable=cpu,
        )
    ]
    out.append(
        run_stage(
            "nccl_all_reduce",
            stages.nccl_all_reduce,
            ["-g", str(max(gpus, 1)), "-c", "1"],
            parse_nccl_tests,
            min_key=r"busbw_gbps/.*",
            runner=runner,
            applicable=cpu or ("one GPU: nothing to reduce" if gpus < 2 else None),
        )
    )
    out.append(
        run_stage(
            "nvbandwidth",
            stages.nvbandwidth,
            [],
            parse_nvbandwidth,
            min_key=r".*/min_gbps",
            runner=runner,
            applicable=cpu,
        )
    )
    return out


def ib_hcas(stages: ToolStages, sysfs: str = "/sys/class/infiniband") -> list[str]:
    """The HCAs ib_write_bw measures: the policy's list, else every device in sysfs."""
    if stages.ib_hcas:
        return list(stages.ib_hcas)
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def merge_outcomes(name: str, parts: Sequence[tuple[str, StageOutcome]]) -> StageOutcome:
    """One stage record from per-device runs (ib_write_bw per HCA): the worst status wins
    (fail > error > pass > skipped), figures keyed '<device>/<figure>'."""
    if not parts:
        return StageOutcome(name, "skipped", "nothing to measure")
    rank = {"fail": 3, "error": 2, "pass": 1, "skipped": 0}
    worst = max(rank[o.status] for _, o in parts)
    status = next(k for k, v in rank.items() if v == worst)
    reasons = [f"{dev}: {o.reason}" for dev, o in parts if rank[o.status] == worst]
    figures = {f"{dev}/{k}": v for dev, o in parts for k, v in o.figures.items()}
    evidence = "\n".join(
        f"== {dev}\n{o.evidence[-EVIDENCE_CHARS // max(1, len(parts)) :]}" for dev, o in parts
    )
    return StageOutcome(
        name,
        status,
        "; ".join(reasons) if status != "pass" else "ok",
        sum(o.seconds for _, o in parts),
        figures,
        evidence,
    )
