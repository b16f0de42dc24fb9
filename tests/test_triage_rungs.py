"""The ladder's pure rules (triage/rungs.py), shared by the ladder and the report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from slurmguard.config import TriagePolicy
from slurmguard.store import ActionStatus, TriageActionRecord, TriageRung
from slurmguard.sweeps.rungs import entries_in_window, entry_rung, rung_after

NOW = datetime(2026, 1, 10, tzinfo=UTC)


def entry(days_ago: float, is_entry: bool = True) -> TriageActionRecord:
    return TriageActionRecord(
        id=1,
        node="n1",
        rung=TriageRung.RESWEEP,
        at=NOW - timedelta(days=days_ago),
        is_entry=is_entry,
        status=ActionStatus.DONE,
        finished_at=None,
        detail="",
    )


def test_rung_after_walks_the_policy_ladder_and_repeats_the_last():
    pol = TriagePolicy(ladder=["resweep", "reboot", "terminal"])
    assert rung_after(None, pol) is TriageRung.RESWEEP
    assert rung_after("reimage", pol) is TriageRung.RESWEEP  # not on this ladder: start over
    assert rung_after(TriageRung.RESWEEP, pol) is TriageRung.REBOOT
    assert rung_after("terminal", pol) is TriageRung.TERMINAL


def test_window_counts_entries_only_and_includes_its_start():
    pol = TriagePolicy(repeat_window_days=7, repeat_limit=3)
    rows = [entry(7.0), entry(6.0), entry(1.0, is_entry=False), entry(7.01)]
    assert entries_in_window(rows, NOW, pol) == 2
    assert entries_in_window(rows, NOW.timestamp(), pol) == 2  # epoch seconds alike
    assert entry_rung(2, pol)[0] is TriageRung.TERMINAL and entry_rung(2, pol)[2] == 3
    assert entry_rung(1, pol) == (TriageRung.RESWEEP, "triage entry 2", 2)
