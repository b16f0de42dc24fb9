"""The Store: the small typed API the controller, sweeps and triage code use.

One class over six aggregates, each in its own module (the methods they add):

- nodes.py: nodes and their lifecycle (get_or_create_node, register_nodes,
  node_counts, get_node, list_nodes, mark_seen, transition, node_history, transitions)
- audit.py: the audit log (audit, audit_entries) and the action intents written
  ahead of it (open_intent, close_intent, open_intents)
- incidents.py: incidents (add_incident, update_incident, get_incident, incidents,
  live_incidents)
- summaries.py: telemetry and step-time windows (add_/telemetry_summaries,
  add_/step_time_summaries, prune_summaries)
- sweeps.py: sweeps (add_sweep, update_sweep, get_sweep, sweep_by_job, sweeps)
- triage.py: triage actions (add_/update_triage_action, triage_actions,
  recent_triage_entries)

They share core.py (engine, clock, transactions), checks.py (value checks),
query.py (the one filter builder of every listing) and records.from_row.

Every public method is one transaction (a lifecycle change and its transition
row commit together or not at all); `with store.atomic() as tx:` groups several
calls into one. Methods take and return records (slurmguard.store.records),
never ORM objects. Times default to the injected Clock, never to the database
server's clock, so FakeClock tests and replays are exact.
"""

from __future__ import annotations

from datetime import datetime

from slurmguard.store.audit import AuditLog
from slurmguard.store.incidents import IncidentStore
from slurmguard.store.nodes import NodeStore
from slurmguard.store.summaries import SummaryStore
from slurmguard.store.sweeps import SweepStore
from slurmguard.store.triage import TriageStore
from slurmguard.store.types import Timestamp, to_utc


def utc(ts: Timestamp) -> datetime:
    """Aware UTC datetime from epoch seconds (Clock.now()) or an aware datetime."""
    return to_utc(ts)


class Store(NodeStore, AuditLog, IncidentStore, SummaryStore, SweepStore, TriageStore):
    """Typed access to slurmguard's database.

    Build it with `Store.open(url, clock)` (checks the schema is migrated) or
    `Store(engine, clock)`; the clock defaults to the system clock.
    """
