"""Kill the scheduler between any two steps: the next one finishes the job, nothing twice.

The scenario covers every kind of step: quarantine, resume + sweep submission, judging,
a failed 1-node sweep (drain + triage entry), a reboot rung, a passing round with a
2-node sweep (reference reservation), and the return to service. It is run once without
a crash to count the state-changing calls (Slurm writes and database writes), then once
per call with a crash right *after* that call took effect (the worst moment: done, not
yet recorded), followed by a fresh scheduler on the same database and Slurm.
"""

from __future__ import annotations

import collections
import json
from dataclasses import replace

from slurmguard.config import SweepPolicy, TriagePolicy
from slurmguard.respond.actions import ActionExecutor
from slurmguard.slurm.fake import FakeSlurm
from slurmguard.store import AuditOutcome, NodeState, Store, SweepKind, Verdict, db
from slurmguard.sweeps.episode import load_episode
from slurmguard.sweeps.resultfiles import LocalResultFiles
from slurmguard.sweeps.scheduler import SweepScheduler
from tests.fixtures.sweeps import node_doc, pair_doc

CLASS = "h100"
SLURM_WRITES = (
    "drain",
    "resume",
    "set_comment",
    "clear_comment",
    "create_reservation",
    "delete_reservation",
    "submit",
    "cancel",
    "reboot",
)
STORE_WRITES = ("transition", "add_sweep", "update_sweep", "add_triage_action", "update_triage_action")


class Crash(BaseException):
    """The controller process dies (not an error anything may catch)."""


class Counter:
    def __init__(self, crash_at: int | None) -> None:
        self.n = 0
        self.crash_at = crash_at
        self.crashed = False

    def hit(self) -> None:
        self.n += 1
        if self.n == self.crash_at and not self.crashed:
            self.crashed = True
            raise Crash(f"crash after write {self.n}")


class CrashAfter:
    def __init__(self, target, methods, counter: Counter) -> None:
        self._target, self._methods, self._counter = target, methods, counter

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name not in self._methods:
            return attr

        def wrapped(*a, **kw):
            out = attr(*a, **kw)
            self._counter.hit()
            return out

        return wrapped


def scenario(tmp_path, crash_at: int | None, fake_clock) -> tuple[Counter, dict]:
    from slurmguard.clock import FakeClock

    clock = FakeClock()
    url = f"sqlite:///{tmp_path / f'db{crash_at}.db'}"
    db.upgrade(url)
    store = Store.open(url, clock)
    fake = FakeSlurm(clock=clock, features=(f"hwclass={CLASS}",))
    fake._nodes["node2"] = replace(fake.node("node2"), boot_time=1.6e9)
    files = LocalResultFiles(tmp_path / f"res{crash_at}")
    counter = Counter(crash_at)
    cslurm = CrashAfter(fake, SLURM_WRITES, counter)
    cstore = CrashAfter(store, STORE_WRITES, counter)
    for n in fake.nodes():
        store.get_or_create_node(n.name, partitions=list(n.partitions))
    for node in ("node3", "node4"):  # class baseline and trusted references
        s = store.add_sweep(node, SweepKind.ONE_NODE, hw_class=CLASS)
        # a day old: inside the baseline's age (policy baseline_max_age_h)
        day_old = clock.now() - 86400.0
        store.update_sweep(
            s.id,
            verdict=Verdict.PASS,
            metrics={"outcome": "pass", "result": node_doc(node, hw_class=CLASS, finished=day_old)},
        )
        s = store.add_sweep(node, SweepKind.TWO_NODE, reference_node="node1", hw_class=CLASS)
        store.update_sweep(
            s.id,
            verdict=Verdict.PASS,
            metrics={"outcome": "pass", "result": pair_doc(node, "node1", hw_class=CLASS, finished=day_old)},
        )
    ActionExecutor(fake, store).drain("node2", "slurmguard: step time +15% vs peers")
    store.transition("node2", NodeState.DRAINING, "drained by the controller")

    def new_sched():
        return SweepScheduler(
            SweepPolicy(bootstrap_min_nodes=2),
            TriagePolicy(ladder=("reboot", "terminal")),
            cstore,
            cslurm,
            clock,
            ActionExecutor(cslurm, cstore),
            files=files,
        )

    sched = new_sched()
    ran: dict[int, str] = {}
    errors: list[str] = []
    failed_once = False
    for _ in range(150):
        clock.advance(5)
        try:
            res = sched.tick()
            errors += res.errors
        except Crash:
            sched = new_sched()  # restart
            continue
        if store.get_node("node2").state is NodeState.HEALTHY:
            break
        # Slurm side: run submitted sweep jobs, complete requested reboots
        for j in fake.jobs():
            if j.state != "PENDING" or j.job_id in ran:
                continue
            ep = load_episode(store, "node2")
            s = (
                next(x for x in ep.sweeps if x.slurm_job_id == str(j.job_id))
                if any(x.slurm_job_id == str(j.job_id) for x in ep.sweeps)
                else None
            )
            if s is None:
                continue  # submitted, id not recorded yet: the adoption path finds it
            kind = "node" if s.kind is SweepKind.ONE_NODE else "pair"
            out, _ = files.paths("node2", s.id, kind)
            state = "COMPLETED"
            if kind == "node" and not failed_once:
                state, failed_once = "FAILED", True
            else:
                doc = (
                    node_doc("node2", hw_class=CLASS)
                    if kind == "node"
                    else pair_doc("node2", s.reference_node, hw_class=CLASS)
                )
                with open(out, "w") as fh:
                    json.dump({**doc, "job_id": str(j.job_id)}, fh)
            fake._jobs[j.job_id] = replace(j, state="RUNNING", start_time=clock.now())
            fake.finish_job(j.job_id, state)
            ran[j.job_id] = state
        n2 = fake.node("node2")
        if "REBOOT_REQUESTED" in n2.flags:
            fake._nodes["node2"] = replace(
                n2,
                flags=n2.flags - {"REBOOT_REQUESTED", "DRAIN"},
                reason=None,
                boot_time=(n2.boot_time or 0) + 100,
            )
    final = {
        "state": store.get_node("node2").state,
        "errors": errors,
        "reboots": len(fake.reboots),
        "submitted": sorted(c[1] for c in fake.calls if c[0] == "submit"),
        "recorded": sorted(int(s.slurm_job_id) for s in store.sweeps(node="node2") if s.slurm_job_id),
        "reservations": fake.reservations(),
        "drains": [c for c in fake.calls if c[0] == "drain"],
        "node": fake.node("node2"),
        "rungs": [(a.rung.value, a.status.value) for a in store.triage_actions("node2")],
        "verdicts": [s.verdict.value for s in store.sweeps(node="node2")],
        # (FakeSlurm names its calls as the audit log names the actions)
        "called": collections.Counter(c[0] for c in fake.calls),
        "audited": collections.Counter(e.action for e in store.audit_entries(outcome=AuditOutcome.OK)),
        "open_intents": store.open_intents(),
    }
    store.close()
    return counter, final


def check(final: dict, where: str) -> None:
    assert final["state"] is NodeState.HEALTHY, where
    assert not final["errors"], (where, final["errors"])
    assert final["reboots"] == 1, where
    assert final["submitted"] == final["recorded"], (where, final)  # no orphan or duplicate sweep job
    assert final["reservations"] == [], where
    assert len(final["drains"]) == 2, (where, final["drains"])  # the controller's + the failed sweep's
    assert not final["node"].drained and final["node"].comment is None, where
    assert final["rungs"] == [("reboot", "done")], (where, final["rungs"])
    assert final["verdicts"].count("pass") == 2, (where, final["verdicts"])
    # every Slurm action has exactly one audit row, also when the crash came between the
    # two (the next scheduler records it late from the intent written ahead)
    assert final["audited"] == final["called"] and final["open_intents"] == [], (where, final)


def test_killed_between_any_two_steps_the_next_tick_continues_without_duplicates(tmp_path, fake_clock):
    counter, final = scenario(tmp_path, None, fake_clock)
    check(final, "no crash")
    assert final["verdicts"] == ["error", "pass", "pass"]
    writes = counter.n
    assert writes > 15
    for k in range(1, writes + 1):
        c, final = scenario(tmp_path, k, fake_clock)
        assert c.crashed, k
        check(final, f"crash after write {k}")
