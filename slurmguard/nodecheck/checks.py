"""Check records and the bounded check runner.

Every check runs in its own daemon thread; all start together, so the
prolog's wall time is the slowest check, not the sum. A check that has not
finished by its deadline (its own `check_timeout_s`, capped by the total
budget) is a failure naming the step it was stuck in: a hung NVML or sysfs
call cannot be cancelled, but it can never hold the prolog past its budget.
An exception escaping a check is an *internal error* (a bug or a bad setting),
kept apart from node failures so the caller can decide what it means.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from slurmguard.clock import Clock, SystemClock
from slurmguard.errors import SlurmguardError


class Progress:
    """What a check is doing right now (set by the check, read on timeout)."""

    def __init__(self) -> None:
        self.step = "starting"

    def at(self, step: str) -> None:
        self.step = step


class Check(Protocol):
    """A node check: returns one line per problem found; [] means healthy."""

    name: str

    def run(self, progress: Progress) -> list[str]: ...


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check. duration_s is wall time in seconds."""

    name: str
    failures: tuple[str, ...] = ()
    duration_s: float = 0.0
    timed_out: bool = False
    internal_error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.internal_error is None


def run_checks(
    checks: Sequence[Check], *, budget_s: float, check_timeout_s: float, clock: Clock | None = None
) -> list[CheckResult]:
    """Run `checks` concurrently; return their results in the given order.

    budget_s: total wall-time budget (s); check_timeout_s: each check's own
    limit (s). A check past min(check_timeout_s, budget_s) is a failure.
    """
    clock = clock or SystemClock()
    start = clock.monotonic()
    limit = min(check_timeout_s, budget_s)
    slots = []
    for check in checks:
        box: dict = {}
        progress = Progress()
        done = threading.Event()

        def body(
            check: Check = check, box: dict = box, progress: Progress = progress, done: threading.Event = done
        ) -> None:
            t0 = clock.monotonic()
            try:
                box["failures"] = tuple(check.run(progress))
            except SlurmguardError as exc:  # a bad setting: its message names file and key
                box["error"] = str(exc)
            except Exception as exc:  # noqa: BLE001 - a bug, not a node fault
                box["error"] = f"{type(exc).__name__}: {exc}"
            box["duration"] = clock.monotonic() - t0
            done.set()

        th = threading.Thread(target=body, daemon=True, name=f"slurmguard-check-{check.name}")
        th.start()
        slots.append((check, box, progress, done))

    results = []
    for check, box, progress, done in slots:
        # Event.wait measures real time; the clock only labels durations
        remaining = max(0.0, start + limit - clock.monotonic())
        if not done.wait(remaining):
            results.append(
                CheckResult(
                    check.name,
                    (f"no answer within {limit:g} s (stuck in {progress.step})",),
                    clock.monotonic() - start,
                    timed_out=True,
                )
            )
            continue
        if "error" in box:
            results.append(CheckResult(check.name, (), box["duration"], internal_error=box["error"]))
        else:
            results.append(CheckResult(check.name, box["failures"], box["duration"]))
    return results
