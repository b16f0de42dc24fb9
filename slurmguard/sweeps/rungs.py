"""The triage ladder's rules, as pure functions of the policy and the records.

The ladder (triage/ladder.py) acts on them and the report's "what next"
(triage/report_next.py) shows them, so what the report says the ladder will do is
what it does:

* the rung after another: the next one of `TriagePolicy.ladder`, the last one
  repeating (an unknown or missing rung starts at the first);
* Guard's repeat rule: the entries into triage inside the last
  `repeat_window_days` (actions with is_entry, at >= now - window) are counted; a
  node entering for the `repeat_limit`-th time goes straight to terminal.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from slurmguard.config import TriagePolicy
from slurmguard.store import TriageActionRecord, TriageRung, utc


def window_start(now: float | datetime, policy: TriagePolicy) -> datetime:
    """The oldest time (UTC) an entry may have to count for the repeat rule."""
    return utc(now) - timedelta(days=policy.repeat_window_days)


def entries_in_window(
    actions: Iterable[TriageActionRecord], now: float | datetime, policy: TriagePolicy
) -> int:
    """How many of `actions` opened a triage episode inside the repeat window."""
    start = window_start(now, policy)
    return sum(1 for a in actions if a.is_entry and a.at >= start)


def repeat_limit_reached(entries: int, policy: TriagePolicy) -> bool:
    """True when `entries` (the current one included) reach repeat_limit: replace."""
    return entries >= policy.repeat_limit


def rung_after(done: TriageRung | str | None, policy: TriagePolicy) -> TriageRung:
    """The rung after `done` (None or a rung not on the ladder: the first rung)."""
    ladder = list(policy.ladder)
    last = done.value if isinstance(done, TriageRung) else done
    if last is None or last not in ladder:
        return TriageRung(ladder[0])
    return TriageRung(ladder[min(ladder.index(last) + 1, len(ladder) - 1)])


def entry_rung(earlier_entries: int, policy: TriagePolicy) -> tuple[TriageRung, str, int]:
    """(rung, why, entry count) for a node entering triage after `earlier_entries`
    entries inside the window."""
    count = earlier_entries + 1
    if repeat_limit_reached(count, policy):
        return (
            TriageRung.TERMINAL,
            f"triage entry {count} within {policy.repeat_window_days:g} days"
            f" (limit {policy.repeat_limit}): replace",
            count,
        )
    return rung_after(None, policy), f"triage entry {count}", count
