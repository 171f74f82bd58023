"""What the loop keeps of itself: timeline records, memory on disk, the status document,
and the pass's bookkeeping failures.

None of it decides anything, and none of it delays a protective step
(``passes.py`` orders the pass). A bookkeeping failure is logged, reported in
``status.json`` and, when it is memory or status that could not be written,
takes back this pass's open gates (``can_vouch``; ``passes.py`` rules 5 and 8:
memory before the gate, status after it): without its memory on disk a
restarted agent could take a stale ready flag for a fresh one, and without
status the operator cannot see why. The timeline is a record only: its
failure is reported, not held against a gate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nodeagent import __version__
from nodeagent.core.actions import ActionOutcome
from nodeagent.core.guard import Verdict
from nodeagent.core.reconcile import AgentMemory, Reconciler
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.errors import NodeagentError
from nodeagent.host.state import STATE_VERSION, StateStore
from nodeagent.loop.workers import FinishedPlan, PlanWorkers
from nodeagent.timeline import Timeline, bounded

log = logging.getLogger("nodeagent")


def superseded_record(f: FinishedPlan) -> dict[str, Any]:
    """A plan a newer decision replaced: what it did and what it left undone."""
    return {
        "kind": "plan-superseded",
        "guard": f.plan.guard,
        "done": [o.action.describe() for o in f.outcomes],
        "not_done": [a.describe() for a in f.not_done],
    }


def action_record(o: ActionOutcome) -> dict[str, Any]:
    return {
        "kind": "action",
        "guard": o.action.guard,
        "module": getattr(o.action, "module", None),
        "action": o.action.describe(),
        "seconds": None if o.seconds is None else round(o.seconds, 6),
        "reason": o.action.reason,
        "performed": o.performed,
        "ok": o.ok,
        "errno": o.errno,
        "error": o.error,
        "kernel_messages": list(o.kernel_messages),
    }


class Bookkeeping:
    def __init__(
        self,
        *,
        timeline: Timeline,
        state: StateStore,
        reconciler: Reconciler,
        wall: Callable[[], float],
        on_record: Callable[[dict[str, Any]], None] | None = None,
        record_hooks: Sequence[Callable[[dict[str, Any]], None]] = (),
    ) -> None:
        """``on_record`` (an embedder's) and ``record_hooks`` (the exporters: the journal,
        Prometheus, NPD's events) see every record."""
        self.timeline = timeline
        self.state = state
        self.reconciler = reconciler
        self.wall = wall
        self.on_record = on_record
        self.record_hooks = list(record_hooks)
        self.problems: list[str] = []  # this pass's bookkeeping failures
        self.can_vouch = True  # False once memory or status could not be written this pass
        self._saved_memory: dict[str, Any] | None = None
        # A pass's records, written to the timeline together (one write, one sync) before
        # its status and at its end; None between passes: each record written at once.
        self._pending: list[dict[str, Any]] | None = None
        self._unsynced = False  # appended this pass, not yet fdatasync'ed
        self._saved_object: AgentMemory | None = None  # the memory this pass saved, as is

    def begin_pass(self) -> None:
        self.problems, self.can_vouch = [], True
        self._pending = []
        self._saved_object = None

    def end_pass(self) -> None:
        """The pass's last records to the timeline, and its one sync; records are written
        (and synced) at once again."""
        self.flush()
        self._pending = None
        if self._unsynced:
            self._unsynced = False
            try:
                self.timeline.sync()
            except (OSError, NodeagentError) as exc:
                self.failed("timeline sync failed", exc, vouch=True)

    def flush(self) -> None:
        """This pass's records so far, in one append, synced at the pass's end: a disk sync
        is milliseconds, and none stands between the ready flag and the gate. Readers see
        the lines at once; only a power loss could take them, with /run's gate files."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        try:
            self.timeline.append_many(pending, sync=False)
            self._unsynced = True
        except (OSError, NodeagentError) as exc:
            self.failed("timeline write failed", exc, vouch=True)

    def record(self, rec: dict[str, Any]) -> None:
        rec = bounded({"ts": round(self.wall(), 6), **rec})
        if self.on_record is not None:
            self.on_record(rec)
        for hook in self.record_hooks:
            hook(rec)
        if self._pending is not None:
            self._pending.append(rec)
        else:
            try:
                self.timeline.append(rec)
            except (OSError, NodeagentError) as exc:
                self.failed("timeline write failed", exc, vouch=True)
        log.info(rec.get("kind", "record"), extra={"record": rec})

    def failed(self, what: str, exc: Exception, *, vouch: bool) -> None:
        """Log and report; ``vouch=False``: this pass may not publish an open gate."""
        problem = f"{what}: {getattr(exc, 'strerror', None) or exc}"
        log.error(problem)
        self.problems.append(problem)
        self.can_vouch = self.can_vouch and vouch

    def problem(self, problem: str) -> None:
        """An exporter's problem of this pass: reported, never held against a gate."""
        self.problems.append(problem)

    def record_finished(self, finished: Sequence[FinishedPlan]) -> None:
        for f in finished:
            if f.superseded:
                self.record(superseded_record(f))
            for o in f.outcomes:
                self.record(action_record(o))

    def load_memory(self) -> AgentMemory:
        memory, problems = self.state.load_memory(self.reconciler)
        for p in problems:
            log.warning(p)
            self.record({"kind": "state-problem", "problem": p})
        return memory

    def save_memory(self, memory: AgentMemory) -> None:
        if memory is self._saved_object and self._pending is not None:
            return  # this pass saved this very memory already (write-ahead, then step 6)
        doc, refused = self.reconciler.memory_to_save(memory, self._saved_memory)
        for guard, problem in refused.items():
            log.error(problem)
            self.problems.append(problem)
            if guard in self.reconciler.gates:
                self.can_vouch = False  # a gate's memory the next start would not have
        if doc != self._saved_memory or not self.state.memory_intact():
            try:
                self.state.save_memory(doc)
                self._saved_memory = doc
            except (OSError, NodeagentError) as exc:
                self.failed("memory save failed", exc, vouch=False)
                return
        if not refused:  # (a refused part is refused again, and said, at step 6)
            self._saved_object = memory

    def write_status(self, doc: Mapping[str, Any]) -> None:
        try:
            self.state.write_status(doc)
        except (OSError, NodeagentError) as exc:
            self.failed("status write failed", exc, vouch=False)


def status_document(
    *,
    wall: Callable[[], float],
    mode: str,
    resync_seconds: float,
    snap: NodeSnapshot,
    verdicts: Mapping[str, Verdict],
    outcomes: Sequence[ActionOutcome],
    problems: Sequence[str],
    workers: PlanWorkers,
    parts: Mapping[str, Any],
) -> dict[str, Any]:
    """``status.json``: what the last pass saw and decided. ``parts``: the guards' host
    sides' own (``GuardSide.status``), by key."""
    abandoned = workers.abandoned()
    return bounded(
        {
            "version": __version__,
            "state_version": STATE_VERSION,  # the memory file's schema this agent writes
            "time": wall(),  # readers compare it with their own wall clock
            "mode": mode,
            "kernel": snap.kernel,
            "resync_seconds": resync_seconds,  # status tells a dead agent by it
            "pid": os.getpid(),
            "problems": [
                *snap.problems,
                *problems,
                *(f"step still running after its timeout: {s}" for s in abandoned),
            ],
            # Steps the guards' workers have begun and not yet handed back.
            "plans_in_flight": workers.in_flight(),
            **parts,
            "guards": {g: v.to_json() for g, v in verdicts.items()},
            "last_actions": [
                {
                    "action": o.action.describe(),
                    "performed": o.performed,
                    "ok": o.ok,
                    "error": o.error,
                }
                for o in outcomes
            ],
        }
    )
