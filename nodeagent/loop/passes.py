"""One pass, and when the next one comes: every ordering rule of the loop is here.

A pass is observe -> decide -> act -> record. Its order is the product's
safety, and it is decided here and nowhere else:

1. **Outcomes first.** What the workers finished since the last pass reaches
   guard memory before anything is observed; it is kept even if this pass
   fails further on, and recorded after the protective steps (rule 6).
2. **Observe, then decide**, once: the whole node as the guards declared it,
   every guard from the same snapshot.
3. **Protective first.** Each guard's host side takes its protective step
   (the hold's responder lease closes), a closed gate's file is withdrawn,
   and an urgent plan starts, before memory, status, timeline, any other plan or exporter
   (``host/gatefile.py``: the order).
4. **Write-ahead.** What the pass learned (e.g. "a MOFED restart was seen,
   that flag is stale") is on disk before any other plan starts, so dying
   mid-action loses nothing.
5. **Publish as soon as the decision is durable**: a fresh observation, the
   decision and its memory on disk are what make an open gate safe; records,
   labels and status are reports of it and come after (each stood between
   MOFED's ready flag and a held load: issue 39). A gate file says "a recent
   pass decided open, and its memory is on disk". An event since the
   observation makes the decision stale: it vouches for nothing (an open file
   of an earlier pass goes too), and the next pass, at once since the event
   is pending, decides again. Freshness is asked again between the gate
   file's fsync and its rename. **What follows the gate follows the published
   gate**: each host side's ``after_publish`` (the hold lets a held load go
   only when ``wait`` would). Then the other plans go to the workers, never
   joined (observe mode: they are recorded as not performed); started sooner,
   a worker's Python would compete with the publication for the GIL.
6. **Record** what the workers did, in the order it happened, then this
   pass's decisions: each guard's, when any verdict or action changed or an
   event happened; an undone observe-mode action once, not per pass. The
   exporters see each record at once; the timeline gets the pass's records
   in one write before the status (the rest at the pass's end), and one sync
   at the pass's end: a sync per record put milliseconds of disk between the
   ready flag and a held load.
7. **Bookkeeping**: memory again, the host sides' (the VF snapshot), the
   exporters that publish from the verdicts (labels, NPD), the status.
8. **A pass whose bookkeeping failed takes its gates back** before it ends: a
   failure of memory or status closes the sides (the hold first), then
   withdraws what step 5 published. Without its memory a restarted agent could take
   a stale ready flag for a fresh one; without status the operator cannot
   see why a gate is open. A held load let go in between was let go on a
   sound, durable decision.
9. **Fail closed.** A pass that raises vouches for no gate: every gate file
   is withdrawn (``Passes.run``).

When the loop wakes next is ``WakeSchedule``: a guard's ``wake_at``, the
resync, the retry of a failed pass and the heartbeat of the leases.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from nodeagent.core.actions import ActionOutcome
from nodeagent.core.guard import Verdict
from nodeagent.core.reconcile import AgentMemory, Reconciler
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.guards.side import GuardSide
from nodeagent.host.gatefile import RENEW_S
from nodeagent.host.observe import Observer
from nodeagent.loop.exporters import Exporters
from nodeagent.loop.gates import Gates
from nodeagent.loop.records import Bookkeeping, action_record, status_document
from nodeagent.loop.workers import FinishedPlan, PlanWorkers

# A failed pass is tried again this soon (or at the resync, if that is sooner).
PASS_RETRY_S = 5.0


@dataclass(frozen=True)
class PassResult:
    snapshot: NodeSnapshot
    verdicts: dict[str, Verdict]
    outcomes: tuple[ActionOutcome, ...]
    wake_at: float | None
    # For the exporters: what woke this pass and when it began (agent clock); each
    # performed outcome carries when it finished and how long it took.
    woken_by: tuple[str, ...] = ()
    started: float = 0.0


class Passes:
    def __init__(
        self,
        *,
        enforce: bool,
        mode: str,
        resync_seconds: float,
        clock: Callable[[], float],
        wall: Callable[[], float],
        reconciler: Reconciler,
        observer: Observer,
        workers: PlanWorkers,
        books: Bookkeeping,
        gates: Gates,
        sides: Mapping[str, GuardSide],
        exporters: Exporters,
        memory: AgentMemory,
        pass_context: Callable[[], AbstractContextManager[object]],
        on_pass: Callable[[PassResult | None, Exception | None], None] | None,
    ) -> None:
        self.enforce = enforce
        self.mode = mode
        self.resync_seconds = resync_seconds
        self.clock = clock
        self.wall = wall
        self.reconciler = reconciler
        self.observer = observer
        self.workers = workers
        self.books = books
        self.gates = gates
        self.sides = sides
        self.exporters = exporters
        self.memory = memory
        self.pass_context = pass_context
        self.on_pass = on_pass
        self._last_signature: Any = None
        self.count = 0
        self._done = threading.Condition()

    def run(self, woken_by: Sequence[str] = ()) -> PassResult:
        # No cyclic garbage collection inside a pass: a collection of the older generations
        # is 1.5-2 ms here, and fell inside the pass that opens a gate in one in twenty
        # (issue 39). What the pass allocated is collected when it ends, between passes.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(woken_by)
        finally:
            if collecting:
                gc.enable()

    def _run(self, woken_by: Sequence[str]) -> PassResult:
        with self.pass_context():
            try:
                try:
                    result = self._pass(woken_by)
                finally:
                    self.books.end_pass()  # its records on disk, whatever happened
                if not self.workers.threaded:
                    self.workers.run_pending()
            except BaseException as exc:
                self.gates.withdraw(self.reconciler.gates)  # rule 9
                if isinstance(exc, Exception):
                    self._passed(None, exc)
                raise
            self._passed(result, None)
            return result

    def _passed(self, result: PassResult | None, exc: Exception | None) -> None:
        """The exporters, then the embedder, see every pass, inside its context."""
        self.exporters.on_pass(result, exc)
        if self.on_pass is not None:
            self.on_pass(result, exc)

    def _pass(self, woken_by: Sequence[str]) -> PassResult:
        now = self.clock()
        books = self.books
        books.begin_pass()
        # 1. Outcomes first.
        finished, outcomes = self.take_finished(now)
        # 2. Observe, then decide.
        snap = self.observer.observe(now)
        rec = self.reconciler.decide(snap, self.memory)
        # 3. Protective first: what stands between loaders and the kernel closes (the
        # hold's responder lease), then the gate files a reader asks go.
        for name, side in self.sides.items():
            if name in rec.verdicts:
                side.protect(rec.verdicts[name])
        books.problems += self.gates.withdraw(
            [g for g in self.reconciler.gates if not rec.verdicts[g].ok]
        )
        if self.enforce:
            self.workers.submit(rec.plans, only_urgent=True, decided_at=now)
        # 4. Write-ahead, then the other plans.
        memory = rec.memory
        books.save_memory(memory)
        planned: list[ActionOutcome] = []
        if not self.enforce:
            planned = [ActionOutcome(action=a, ok=True, performed=False) for a in rec.actions]
            memory = self.reconciler.absorb(memory, planned, self.clock())

        # 5. Publish: the decision is durable; reports do not stand before the gate.
        def fresh() -> bool:
            return self.gates.fresh(snap)

        def vouches() -> bool:
            return books.can_vouch and fresh()

        open_gates = [g for g in self.reconciler.gates if rec.verdicts[g].ok]
        published = self.gates.settle(snap, open_gates, books.can_vouch, fresh)
        # What follows the gate follows the published gate.
        self._follow_gates(rec.verdicts, published, vouches)
        if self.enforce:  # the other plans: a worker thread's Python would slow the above
            self.workers.submit(rec.plans, decided_at=now)  # to the workers: never joined
        # 6. Record: what the workers did, then this pass's decisions.
        books.record_finished(finished)
        signature = (
            tuple((g, v.verdict, v.reasons) for g, v in rec.verdicts.items()),
            tuple(a.describe() for a in rec.actions),
        )
        changed = signature != self._last_signature
        if changed or rec.events:
            for guard, verdict in rec.verdicts.items():
                books.record(
                    {
                        "kind": "decision",
                        "guard": guard,
                        "verdict": verdict.verdict,
                        "ok": verdict.ok,
                        "gate": guard in self.reconciler.gates,
                        "reasons": list(verdict.reasons),
                        "events": [e for g, e in rec.events if g == guard],
                        "actions": [a.describe() for a in rec.actions if a.guard == guard],
                        "mode": self.mode,
                        "woken_by": list(woken_by)[:8],
                        "kernel": snap.kernel,
                        "evidence": verdict.evidence,
                    }
                )
            self._last_signature = signature
        if changed:  # observe mode: the same undone action is recorded once, not per pass
            for o in planned:
                books.record(action_record(o))
        outcomes += planned
        # 7. Bookkeeping.
        self.memory = memory
        books.save_memory(memory)
        for side in self.sides.values():
            side.after_memory(memory)
        for problem in self.exporters.publish(rec.verdicts):  # never held against a gate
            books.problem(problem)
        for side in self.sides.values():
            for problem in side.problems():
                books.problem(problem)
        books.flush()  # the pass's records so far, in one write, before its status
        books.write_status(self.status(snap, rec.verdicts, outcomes))
        # 8. A pass whose bookkeeping failed takes back the gates it published.
        if published and not books.can_vouch:
            self._follow_gates(rec.verdicts, [], vouches)  # the hold closes first
            books.problems += self.gates.withdraw(published)
            self.gates.published = []
        with self._done:
            self.count += 1
            self._done.notify_all()
        return PassResult(
            snap,
            dict(rec.verdicts),
            tuple(outcomes),
            rec.wake_at,
            woken_by=tuple(woken_by),
            started=now,
        )

    def _follow_gates(
        self, verdicts: Mapping[str, Verdict], published: Sequence[str], vouches: Callable[[], bool]
    ) -> None:
        for name, side in self.sides.items():
            if name in verdicts:
                side.after_publish(verdicts[name], name in published, vouches)

    def status(
        self,
        snap: NodeSnapshot,
        verdicts: Mapping[str, Verdict],
        outcomes: Sequence[ActionOutcome],
    ) -> dict[str, Any]:
        return status_document(
            wall=self.wall,
            mode=self.mode,
            resync_seconds=self.resync_seconds,
            snap=snap,
            verdicts=verdicts,
            outcomes=outcomes,
            problems=self.books.problems,
            workers=self.workers,
            parts={s.status_key: s.status() for s in self.sides.values() if s.status_key},
        )

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: self.count >= count, timeout)

    # -- what the workers finished ------------------------------------------------

    def take_finished(self, now: float) -> tuple[list[FinishedPlan], list[ActionOutcome]]:
        """What the workers finished, absorbed into guard memory; (plans, their outcomes)."""
        finished = self.workers.take_finished()
        outcomes = [o for f in finished for o in f.outcomes]
        if outcomes:
            self.memory = self.reconciler.absorb(self.memory, outcomes, now)
        return finished, outcomes

    def absorb_finished(self) -> list[ActionOutcome]:
        """Outcomes the workers handed back outside a pass (``--once``, stop) reach memory."""
        finished, outcomes = self.take_finished(self.clock())
        if outcomes:
            self.books.record_finished(finished)
            self.books.save_memory(self.memory)
        return outcomes


class WakeSchedule:
    """When the loop wakes next: the one place that says it.

    A pass is due at the earliest of a guard's ``wake_at`` (a retry backoff, a
    deadline) and the resync; a failed pass is tried again within
    ``PASS_RETRY_S``. Until then the loop waits for an event, waking every
    ``RENEW_S`` to beat while there is a lease to renew, a withdrawal to retry
    or a heartbeat to write.
    """

    def __init__(self, now: float, resync_s: float) -> None:
        self.resync_s = resync_s
        self.resync_at = now + resync_s
        self.wake_at: float | None = None

    def passed(self, wake_at: float | None) -> None:
        self.wake_at = wake_at

    def failed(self, at: float) -> None:
        self.wake_at = at + min(PASS_RETRY_S, self.resync_s)

    def after(self, now: float) -> None:
        """A pass (or its failure) is behind us: a resync that came due is rescheduled."""
        if now >= self.resync_at:
            self.resync_at = now + self.resync_s

    def due(self, now: float) -> str:
        """Why a pass came due at ``now`` with no event (the reason the pass records)."""
        return "resync" if now >= self.resync_at else "scheduled"

    def next_wake(self, now: float, beat: bool) -> tuple[float, float]:
        """(when a pass is due, how long to wait for an event before looking again)."""
        deadline = self.resync_at if self.wake_at is None else min(self.resync_at, self.wake_at)
        wait = max(0.0, deadline - now)
        return deadline, (min(wait, RENEW_S) if beat else wait)
