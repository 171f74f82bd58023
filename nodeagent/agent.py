"""The reconcile loop: wake -> absorb -> observe -> guards decide -> act -> record.

Level-triggered: a wake-up only says "look again"; each pass reads the whole
node, so a missed event, an agent restart or a crash costs one pass. Guard
memory is persisted after every pass, so a restarted agent knows, for
example, that the ready flag it sees predates a MOFED restart.

The loop never waits on a plan: it hands each guard's plan to that guard's
worker (host/worker.py) and absorbs what the workers finished at the start of
a later pass. Protective work comes first in every pass: closed gates'
files are withdrawn and urgent plans started before memory, status, timeline
or any exporter; a gate is published open last, and only when no event
arrived after the pass's observation (docs/design.md, "The loop").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from nodeagent import __version__
from nodeagent.config import Config
from nodeagent.core.actions import ActionOutcome
from nodeagent.core.guard import Verdict
from nodeagent.core.labels import node_labels
from nodeagent.core.reconcile import AgentMemory, Reconciler
from nodeagent.core.registry import build_reconciler as build_guard_reconciler
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.core.sriov import SriovMemory
from nodeagent.errors import NodeagentError
from nodeagent.host.act import Actuator, KernelLog, kmsg_reader
from nodeagent.host.conditions import NpdFiles
from nodeagent.host.containers import RootScanner
from nodeagent.host.events import FileWatch, Poke, UeventSource, Waker, WakeSource, pending
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import LEASE_S, RENEW_S, GateFiles
from nodeagent.host.hold import HoldHost, Responder, start_hold
from nodeagent.host.kmod import ModuleOps, default_module_ops
from nodeagent.host.labels import FeatureFile
from nodeagent.host.netlink import PyrouteOps, SriovOps
from nodeagent.host.observe import Observer, Readers, no_sriov
from nodeagent.host.sriov import SriovObserver, SriovStore
from nodeagent.host.state import StateStore
from nodeagent.host.worker import FinishedPlan, PlanWorkers
from nodeagent.timeline import Timeline, bounded

log = logging.getLogger("nodeagent")

# At stop, steps in flight get this long to end before the stop actions run (SIGTERM's
# grace is 1.5 s: host/events.py, StopOnSignal).
STOP_WAIT_S = 1.0


def build_reconciler(cfg: Config) -> Reconciler:
    """Every guard of core/registry.py with its configured policy."""
    return build_guard_reconciler(cfg.policies, cfg.paths)


def sriov_host(
    cfg: Config, host: HostRoot, ops: SriovOps | None
) -> tuple[SriovObserver, SriovStore]:
    """The VF guard's reader (PFs, VFs, sriov-cni cache, snapshot file) and its store."""
    store = SriovStore(host, cfg.paths.sriov_snapshot)
    return SriovObserver(host, ops, store, cfg.paths.sriov_cni_cache), store


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


class SteadyClock:
    """Wall time as it was at start, advanced by the monotonic clock: what the agent
    schedules by. A step of the wall clock (NTP, an operator) moves no deadline; what is
    persisted stays comparable with wall time across restarts (guards clamp a saved
    deadline further ahead than its own length)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._anchor = wall() - monotonic()

    def __call__(self) -> float:
        return self._anchor + self._monotonic()


class Agent:
    def __init__(
        self,
        cfg: Config,
        *,
        module_ops: ModuleOps | None = None,
        kernel_log: KernelLog | None = None,
        wake_sources: Sequence[WakeSource] = (),
        clock: Callable[[], float] | None = None,
        pass_context: Callable[[], AbstractContextManager[object]] | None = None,
        on_pass: Callable[[PassResult | None, Exception | None], None] | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        readers: Readers | None = None,
        sriov_ops: SriovOps | None = None,
        stepped_plans: bool = False,
        hold_host: HoldHost | None = None,
    ) -> None:
        """``pass_context`` wraps every pass (the simulator holds its world lock in it);
        ``on_pass`` runs at the end of every pass, inside that context, with the result or
        the exception; ``on_record``
        sees every timeline record. All three are for embedding; the daemon uses none.
        ``readers`` replaces the observer's readers of locks, mounts, NVMe and SR-IOV;
        ``sriov_ops`` the netlink and ``sriov_numvfs`` access of the VF guard (the
        simulator's kernel; pyroute2 by default). ``stepped_plans``: plans run right
        after the pass that submitted them, inside its ``pass_context``, instead of in
        worker threads (the simulator, whose virtual clock must order every step).
        ``hold_host``: the kernel the fanotify hold marks and answers (the running one
        by default; the simulator's own).
        """
        self.cfg = cfg
        self.pass_context = pass_context or nullcontext
        self.on_pass = on_pass
        self.on_record = on_record
        self.host = HostRoot(cfg.host_root)
        # Schedules (deadlines, backoffs, the resync) run on a clock a wall-clock step cannot
        # move: wall time at start, advanced by the monotonic clock. Records carry wall time.
        # An embedder's clock (the simulator's virtual one) serves as both.
        self.clock: Callable[[], float] = clock or SteadyClock()
        self.wall: Callable[[], float] = clock or time.time
        self.reconciler = build_reconciler(cfg)
        self.sriov_ops = sriov_ops or PyrouteOps(self.host)
        sriov_reader, self.sriov_store = sriov_host(cfg, self.host, self.sriov_ops)
        readers = readers or Readers()
        if readers.sriov is no_sriov:
            readers = replace(readers, sriov=sriov_reader.read)
        self.observer = Observer(self.host, cfg, self.reconciler.needs(), readers)
        self.actuator = Actuator(
            self.host,
            module_ops or default_module_ops(),
            kernel_log or kmsg_reader(cfg.kmsg),
            sriov_ops=self.sriov_ops,
            verified_fd=self.observer.verified_fd,  # load the very file the gate checked
            clock=self.clock,
        )
        self.workers = PlanWorkers(
            self.reconciler.guards,
            self.actuator.perform,
            step_timeout_s=lambda _a: cfg.step_timeout_seconds,
            on_done=lambda g: self.plans_ended.poke(f"plan of {g} ended"),
            threaded=not stepped_plans,
        )
        # What may wake the loop; anything pending here after a pass's observation makes
        # that pass's decision stale (run() adds inotify, uevents and the extra sources).
        self._wake_sources: list[WakeSource] = []
        self.state = StateStore(self.host, cfg.paths.state_dir, self.wall)
        self.gates = GateFiles(self.host, cfg.paths.state_dir)
        # Node labels through NFD's features.d ([labels] nfd): what the cluster can select on.
        self.labels = (
            FeatureFile(self.host, cfg.labels.features_dir, cfg.labels.expiry_seconds, self.wall)
            if cfg.labels.nfd
            else None
        )
        # What node-problem-detector's plugin reads ([npd] enabled): conditions, events and
        # the loop's heartbeat, so a dead or stuck agent reads as Unknown on the Node.
        self.npd = NpdFiles(self.host, cfg.paths.state_dir) if cfg.npd.enabled else None
        # Bookkeeping failures of the current pass (memory, timeline, status): logged,
        # reported in status.json, never a reason to skip an action.
        self._pass_problems: list[str] = []
        self._can_vouch = True  # False once memory or status could not be written this pass
        self.timeline = Timeline(
            self.host, cfg.paths.timeline_dir, cfg.timeline_max_bytes, cfg.timeline_keep
        )
        self.extra_sources = list(wake_sources)
        self.poke = Poke()
        # A worker's plan ended: wakes the loop to absorb it. Not a node event: its effects
        # on the node arrive as inotify or uevents of their own.
        self.plans_ended = Poke()
        self.stopping = threading.Event()
        self.memory: AgentMemory
        self.memory, problems = self.state.load_memory(self.reconciler)
        for p in problems:
            log.warning(p)
            self.record({"kind": "state-problem", "problem": p})
        # The fanotify hold of anyone's peermem load ([peermem] hold_loads), started by run().
        self.hold: Responder | None = None
        self.hold_marked: list[str] = []
        self.hold_containers: RootScanner | None = None  # driver containers' roots, as they start
        self.hold_host = hold_host or HoldHost(group=FanotifyGroup)
        self.hold_since: float | None = None
        self._hold_gate_open = False  # what the responder reads: never a file, never a lock
        # The gates the last pass published, renewed by the loop until a pass decides again.
        self._published: list[str] = []
        self._published_snap: NodeSnapshot | None = None
        self._stuck_gates: dict[str, str] = {}  # gate -> why its file could not be withdrawn
        self._last_signature: Any = None
        self._saved_memory: dict[str, Any] | None = None
        self.passes = 0
        self._pass_done = threading.Condition()

    # -- recording ------------------------------------------------------------

    def record(self, rec: dict[str, Any]) -> None:
        rec = bounded({"ts": round(self.wall(), 6), **rec})
        if self.on_record is not None:
            self.on_record(rec)
        if self.npd is not None:
            self.npd.on_record(rec)  # a Warning event for NPD, if it is one
        try:
            self.timeline.append(rec)
        except (OSError, NodeagentError) as exc:
            self._bookkeeping_failed("timeline write failed", exc, vouch=True)
        log.info(rec.get("kind", "record"), extra={"record": rec})

    # -- one pass -------------------------------------------------------------

    def run_pass(self, woken_by: Sequence[str] = ()) -> PassResult:
        with self.pass_context():
            try:
                result = self._pass(woken_by)
                if not self.workers.threaded:
                    self.workers.run_pending()
            except BaseException as exc:
                # Fail closed: a pass that did not complete vouches for no gate.
                self._withdraw(self.reconciler.gates)
                if self.on_pass is not None and isinstance(exc, Exception):
                    self.on_pass(None, exc)
                raise
            if self.on_pass is not None:
                self.on_pass(result, None)
            return result

    def _pass(self, woken_by: Sequence[str]) -> PassResult:
        now = self.clock()
        self._pass_problems, self._can_vouch = [], True
        # What the workers finished since the last pass reaches guard memory first (kept
        # even if this pass fails further on); it is recorded after the protective steps.
        finished, outcomes = self._take_finished(now)
        memory = self.memory
        snap = self.observer.observe(now)
        rec = self.reconciler.decide(snap, memory)
        # Protective first: a closed gate's file goes, and an urgent plan starts, before
        # memory, status, timeline, any other plan or exporter (gatefile.py: the order).
        self._pass_problems += self._withdraw(
            [g for g in self.reconciler.gates if not rec.verdicts[g].ok]
        )
        if "peermem" in rec.verdicts and not rec.verdicts["peermem"].ok:
            self._set_hold_gate(False)
        enforce = self.cfg.mode == "enforce"
        if enforce:
            self.workers.submit(rec.plans, only_urgent=True, decided_at=now)
        memory = rec.memory
        # Write-ahead: what this pass learned (e.g. "a MOFED restart was seen, that flag is
        # stale") is on disk before any other plan starts, so dying mid-action loses nothing.
        self._save_memory(memory)
        planned: list[ActionOutcome] = []
        if enforce:
            self.workers.submit(rec.plans, decided_at=now)  # to the workers: never joined
        else:
            planned = [ActionOutcome(action=a, ok=True, performed=False) for a in rec.actions]
            memory = self.reconciler.absorb(memory, planned, self.clock())

        # What the workers did, in the order it happened: before this pass's decisions.
        self._record_finished(finished)
        signature = (
            tuple((g, v.verdict, v.reasons) for g, v in rec.verdicts.items()),
            tuple(a.describe() for a in rec.actions),
        )
        changed = signature != self._last_signature
        if changed or rec.events:
            for guard, verdict in rec.verdicts.items():
                self.record(
                    {
                        "kind": "decision",
                        "guard": guard,
                        "verdict": verdict.verdict,
                        "ok": verdict.ok,
                        "gate": guard in self.reconciler.gates,
                        "reasons": list(verdict.reasons),
                        "events": [e for g, e in rec.events if g == guard],
                        "actions": [a.describe() for a in rec.actions if a.guard == guard],
                        "mode": self.cfg.mode,
                        "woken_by": list(woken_by)[:8],
                        "kernel": snap.kernel,
                        "evidence": verdict.evidence,
                    }
                )
            self._last_signature = signature
        if changed:  # observe mode: the same undone action is recorded once, not per pass
            for o in planned:
                self.record(action_record(o))
        outcomes += planned

        self.memory = memory
        self._save_memory(memory)
        self._keep_sriov_snapshot(memory)
        if self.labels is not None:  # a record for the cluster: never held against a gate
            problem = self.labels.publish(node_labels(rec.verdicts, self.cfg.labels.prefix))
            if problem is not None:
                self._pass_problems.append(problem)
        if self.npd is not None:  # likewise
            problem = self.npd.publish(rec.verdicts)
            if problem is not None:
                self._pass_problems.append(problem)
        try:
            self.state.write_status(self.status_document(snap, rec.verdicts, outcomes))
        except (OSError, NodeagentError) as exc:
            self._bookkeeping_failed("status write failed", exc, vouch=False)

        # Publish last, and only from a pass whose bookkeeping held: a gate file says
        # "a recent, completed pass decided open". An event since the observation makes
        # the decision stale: it vouches for nothing (an open file of an earlier pass goes
        # too), and the next pass, at once since the event is pending, decides again.
        # Asked again between the gate file's fsync and its rename: the window in which a
        # change can slip past is the few microseconds of those two calls.
        def fresh() -> bool:
            return self._fresh(snap)

        published: list[str] = []
        if not self._can_vouch or not fresh():
            self._withdraw(self.reconciler.gates)
        else:
            published = self._publish(
                [g for g in self.reconciler.gates if rec.verdicts[g].ok], fresh
            )
        # What the loop renews between passes (gatefile.py: the lease), and against what.
        self._published, self._published_snap = published, snap
        # The hold follows the published gate: a held load goes on only when `wait` would,
        # or when the guard says no wait can help (a load the kernel refuses either way).
        peermem = rec.verdicts.get("peermem")
        release = (
            peermem is not None
            and bool(peermem.evidence.get("release_held"))
            and self._can_vouch
            and fresh()
        )
        self._set_hold_gate("peermem" in published or release)
        self._record_holds()
        with self._pass_done:
            self.passes += 1
            self._pass_done.notify_all()
        return PassResult(
            snap,
            dict(rec.verdicts),
            tuple(outcomes),
            rec.wake_at,
            woken_by=tuple(woken_by),
            started=now,
        )

    # -- gate files: publish, renew, withdraw (loudly) -----------------------------

    def _publish(
        self, gates: Sequence[str], still_fresh: Callable[[], bool] | None = None
    ) -> list[str]:
        """Write open gates' leases; the ones published. One not published (gone stale while
        written, or the write failed) was withdrawn by ``publish``; withdrawn once more here
        so a file that cannot go is tracked and said loudly."""
        fresh = still_fresh or self._still_fresh
        published, problems = self.gates.publish(dict.fromkeys(gates, True), self.clock(), fresh)
        for p in problems:
            log.error(p)
        if len(published) < len(gates):
            self._withdraw([g for g in gates if g not in published])
        return published

    def _fresh(self, snap: NodeSnapshot) -> bool:
        """Does the decision taken from ``snap`` still stand: no event since, markers as seen?"""
        return not self._event_pending() and self.observer.markers_unchanged(snap)

    def _still_fresh(self) -> bool:
        snap = self._published_snap
        return snap is not None and self._fresh(snap)

    def renew_leases(self) -> None:
        """The loop's heartbeat between passes: renew the open gates' leases while the last
        decision still stands (no event since its observation, markers unchanged), retry a
        withdrawal that failed. A loop that is stuck renews nothing: the leases run out."""
        if self._stuck_gates:
            self._withdraw([g for g in self._stuck_gates if g not in self._published])
        if not self._published:
            return
        if not self._can_vouch or not self._still_fresh():
            self._withdraw(self.reconciler.gates)
            self._published = []
            return
        self._published = self._publish(self._published)

    def _withdraw(self, gates: Iterable[str]) -> list[str]:
        """Remove gates' files. One that cannot be removed is said loudly (stderr, the journal,
        a metric, /readyz) and retried on every heartbeat; readers see it closed anyway
        when its lease runs out."""
        gates = list(gates)
        problems: list[str] = []
        for g in gates:
            (p,) = self.gates.withdraw([g]) or (None,)
            if g in self._published and p is None:
                self._published = [x for x in self._published if x != g]
            was = self._stuck_gates.get(g)
            if p is None:
                if was is not None:
                    del self._stuck_gates[g]
                    log.warning("gate %s: its file is withdrawn now", g)
                    self.record({"kind": "gate-withdrawal", "gate": g, "ok": True})
                continue
            problems.append(p)
            if was != p:
                self._stuck_gates[g] = p
                log.error("%s; readers see it closed when its lease ends", p)
                self.record(
                    {
                        "kind": "gate-withdrawal",
                        "gate": g,
                        "ok": False,
                        "problem": f"{p}; readers see it closed within {LEASE_S:g}s "
                        "(its lease), and the agent retries every second",
                    }
                )
        return problems

    def _set_hold_gate(self, is_open: bool) -> None:
        if self.hold is not None and is_open != self._hold_gate_open:
            self._hold_gate_open = is_open
            self.hold.wake()

    def _record_holds(self) -> None:
        """Every held open that ended since the last pass, as a timeline record."""
        if self.hold is None:
            return
        scanner = self.hold_containers
        while scanner is not None and scanner.reports:
            self.record(scanner.reports.popleft())
        while self.hold.reports:
            r = self.hold.reports.popleft()
            self.record(
                {
                    "kind": "held-open",
                    "guard": "peermem",
                    "pid": r.pid,
                    "opener": r.opener,
                    "path": r.path,
                    "seconds": round(r.seconds, 3),
                    "ended": r.ended,
                }
            )

    def _start_hold(self) -> None:
        """Mark the filesystems of [peermem] hold_roots and start the responder (run())."""
        pol = self.cfg.policy("peermem")
        if self.cfg.mode != "enforce" or pol.hold_loads != "fanotify":
            return
        host = self.hold_host
        try:
            group = host.group()
        except OSError as exc:
            log.warning("peermem.hold_loads: %s", exc)
            self.record({"kind": "state-problem", "problem": f"peermem.hold_loads: {exc}"})
            return
        roots = [(r, str(self.host.path(r))) for r in pol.hold_roots]
        self.hold, self.hold_marked, problems = start_hold(
            group,
            group.mark_filesystem,
            roots,
            gate_open=lambda: self._hold_gate_open,
            budget_s=pol.hold_budget_s,
            host_pids=host.host_pids(),
            containers=bool(pol.hold_containers),
            on_report=lambda: self.plans_ended.poke("held open ended"),  # a pipe write
            host=host,
        )
        for p in problems:
            log.warning(p)
            self.record({"kind": "state-problem", "problem": p})
        if self.hold is None:
            return
        self.hold_since = self.clock()
        self.record(
            {
                "kind": "hold-started",
                "marked": self.hold_marked,
                "containers": list(pol.hold_containers),
            }
        )
        if pol.hold_containers:
            self.hold_containers = RootScanner(
                group.mark_filesystem,
                group.marked_devices,
                pol.hold_containers,
                interval_s=pol.hold_scan_s,
                on_report=lambda: self.plans_ended.poke("container root"),
                proc=host.proc,
                dev_of=host.dev_of,
                fs_type=host.fs_type,
                clock=host.clock,
            )
            if host.threaded:
                self.hold_containers.start()
            else:
                self.hold_containers.prepare()

    def _event_pending(self) -> bool:
        """Did anything that wakes the loop arrive since this pass drained its sources?"""
        try:
            return pending(self._wake_sources or [self.poke])
        except (OSError, ValueError):  # a source closed under us: assume the worst
            return True

    def _take_finished(self, now: float) -> tuple[list[FinishedPlan], list[ActionOutcome]]:
        """What the workers finished, absorbed into guard memory; (plans, their outcomes)."""
        finished = self.workers.take_finished()
        outcomes = [o for f in finished for o in f.outcomes]
        if outcomes:
            self.memory = self.reconciler.absorb(self.memory, outcomes, now)
        return finished, outcomes

    def _record_finished(self, finished: Sequence[FinishedPlan]) -> None:
        for f in finished:
            if f.superseded:
                self.record(superseded_record(f))
            for o in f.outcomes:
                self.record(action_record(o))

    def _absorb_finished(self) -> list[ActionOutcome]:
        """Outcomes the workers handed back outside a pass (``--once``, stop) reach memory."""
        finished, outcomes = self._take_finished(self.clock())
        if outcomes:
            self._record_finished(finished)
            self._save_memory(self.memory)
        return outcomes

    def _keep_sriov_snapshot(self, memory: AgentMemory) -> None:
        """Bookkeeping after the pass's actions: the VF snapshot file follows the guard's memory."""
        for report in self.sriov_store.reports:
            log.warning(report)
            self.record({"kind": "state-problem", "problem": report})
        self.sriov_store.reports.clear()
        sriov = memory.get("sriov")
        if not isinstance(sriov, SriovMemory):
            return
        try:
            self.sriov_store.save({pci: m.saved for pci, m in sriov.pfs.items()})
        except (OSError, NodeagentError) as exc:  # a record: it does not hold any gate
            self._bookkeeping_failed("SR-IOV snapshot write failed", exc, vouch=True)

    def _save_memory(self, memory: AgentMemory) -> None:
        doc, refused = self.reconciler.memory_to_save(memory, self._saved_memory)
        for guard, problem in refused.items():
            log.error(problem)
            self._pass_problems.append(problem)
            if guard in self.reconciler.gates:
                self._can_vouch = False  # a gate's memory the next start would not have
        if doc == self._saved_memory and self.state.memory_intact():
            return
        try:
            self.state.save_memory(doc)
            self._saved_memory = doc
        except (OSError, NodeagentError) as exc:
            self._bookkeeping_failed("memory save failed", exc, vouch=False)

    def _bookkeeping_failed(self, what: str, exc: Exception, *, vouch: bool) -> None:
        """Log and report; ``vouch=False``: this pass may not publish an open gate.

        Without its memory on disk a restarted agent could take a stale ready flag
        for a fresh one; without status the operator cannot see why. The timeline is
        a record only: its failure is reported, not held against the gate.
        """
        problem = f"{what}: {getattr(exc, 'strerror', None) or exc}"
        log.error(problem)
        self._pass_problems.append(problem)
        self._can_vouch = self._can_vouch and vouch

    def status_document(
        self,
        snap: NodeSnapshot,
        verdicts: Mapping[str, Verdict],
        outcomes: Sequence[ActionOutcome],
    ) -> dict[str, Any]:
        abandoned = self.workers.abandoned()
        return bounded(
            {
                "version": __version__,
                "time": self.wall(),  # readers compare it with their own wall clock
                "mode": self.cfg.mode,
                "kernel": snap.kernel,
                "resync_seconds": self.cfg.resync_seconds,  # status tells a dead agent by it
                "pid": os.getpid(),
                "problems": [
                    *snap.problems,
                    *self._pass_problems,
                    *(f"step still running after its timeout: {s}" for s in abandoned),
                ],
                # Steps the guards' workers have begun and not yet handed back.
                "plans_in_flight": self.workers.in_flight(),
                "hold": None
                if self.hold is None
                else {
                    "marked": self.hold_marked,
                    "since": self.hold_since,
                    "gate_open": self._hold_gate_open,
                    "held": [
                        {"pid": p, "opener": o, "path": f, "seconds": round(t, 3)}
                        for p, o, f, t in self.hold.held()
                    ],
                    "counts": dict(self.hold.counts),
                    "container_roots": [
                        {
                            "dev": r.dev_text(),
                            "pid": r.pid,
                            "rule": r.rule,
                            "command": r.command,
                            "noticed_ms": round(r.noticed_s * 1000, 1),
                        }
                        for r in (self.hold_containers.roots() if self.hold_containers else [])
                    ],
                },
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

    def wait_for_passes(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` passes have completed (for tests and the simulator)."""
        with self._pass_done:
            return self._pass_done.wait_for(lambda: self.passes >= count, timeout)

    # -- the loop -------------------------------------------------------------

    def watched_dirs(self) -> list[str]:
        """Derived from the guards' declared needs (marker files' parents, listed dirs)."""
        return self.observer.needs.watch_dirs()

    def _remove_orphaned_temps(self) -> None:
        """What a killed write left behind (``write_atomic``'s temp files) in the agent's own
        directories; ``run`` holds the single-agent lock, so no live writer's file goes."""
        paths = self.cfg.paths
        for d in {paths.state_dir, paths.timeline_dir, paths.sriov_snapshot.rpartition("/")[0]}:
            removed = self.host.remove_orphaned_temps(d) if d else []
            if removed:
                log.info("removed what killed writes left in %s: %s", d, removed)

    def _stop_actions(self) -> None:
        """What guards undo when the agent stops (e.g. a hold file), enforce mode only.

        Workers start nothing new; what they finished reaches memory first, so the
        stop actions and the next agent know what was done.
        """
        if not self.workers.close(STOP_WAIT_S):
            log.warning("steps still running at stop: %s", self.workers.in_flight())
        self._absorb_finished()
        if self.cfg.mode != "enforce":
            return
        for plan in self.reconciler.on_stop(self.memory).values():
            for o in self.workers.run_now(plan):
                self.record(action_record(o))

    def close(self) -> None:
        """Release an agent driven by ``run_pass`` (``run`` releases its own at the end)."""
        self.workers.close(0.0)
        self.poke.close()
        self.plans_ended.close()

    def stop(self) -> None:
        self.stopping.set()
        self.poke.poke("stop")

    def run_once(self, woken_by: Sequence[str] = ("once",)) -> PassResult:
        """One pass, its plans carried out and their outcomes recorded (``run --once``);
        the result carries those outcomes."""
        result = self.run_pass(woken_by)
        done = self.finish_plans(self.cfg.step_timeout_seconds + 1.0)
        return replace(result, outcomes=(*result.outcomes, *done))

    def finish_plans(self, timeout: float) -> list[ActionOutcome]:
        """Wait up to ``timeout`` for the workers, then absorb what they finished."""
        self.workers.wait_idle(timeout)
        with self.pass_context():
            return self._absorb_finished()

    def run(self, once: bool = False) -> None:
        self._remove_orphaned_temps()
        if once:
            self.run_once()
            return
        root = self.host.root
        watch = FileWatch(root, [self.host.path(d) for d in self.watched_dirs()])
        sources: list[WakeSource] = [self.poke, watch, *self.extra_sources]
        if self.cfg.uevents:
            try:
                sources.append(UeventSource())
            except Exception as exc:  # no libudev, no netlink permission: inotify + resync remain
                log.warning("kernel uevents unavailable (%s); relying on inotify and resync", exc)
        waker = Waker([*sources, self.plans_ended])
        self._wake_sources = [*sources]
        self.record({"kind": "start", "mode": self.cfg.mode, "host_root": str(root)})
        self._start_hold()  # before the first pass: its decision opens or keeps closed
        try:
            woken_by = ["start"]
            next_resync = self.clock() + self.cfg.resync_seconds
            wake_at: float | None = None
            while not self.stopping.is_set():
                try:
                    wake_at = self.run_pass(woken_by).wake_at
                    watch.refresh()
                except Exception as exc:  # one bad pass must not take the node's agent down
                    log.exception("pass failed: %s", exc)
                    self.record({"kind": "pass-error", "error": f"{type(exc).__name__}: {exc}"})
                    wake_at = self.clock() + min(5.0, self.cfg.resync_seconds)
                now = self.clock()
                if now >= next_resync:
                    next_resync = now + self.cfg.resync_seconds
                # Between passes the loop beats every RENEW_S while a gate is open or a
                # withdrawal failed: the lease proves the loop, not a plan or a thread.
                while True:
                    deadline = next_resync if wake_at is None else min(next_resync, wake_at)
                    beat = bool(self._published or self._stuck_gates or self.npd)
                    wait = max(0.0, deadline - now)
                    woken_by = waker.wait(min(wait, RENEW_S) if beat else wait)
                    now = self.clock()
                    if woken_by or self.stopping.is_set() or now >= deadline:
                        break
                    with self.pass_context():
                        self.renew_leases()
                        if self.npd is not None:
                            self.npd.beat()
        finally:
            if self.hold_containers is not None:
                self.hold_containers.stop()
            if self.hold is not None:
                self.hold.stop()  # every held open is allowed and reported
                self._record_holds()
            watch.close()
            self._stop_actions()
            if self.labels is not None:
                self.labels.remove()  # a stale "ok" label is worse than none
            if self.npd is not None:
                self.npd.stop()  # no heartbeat: NPD's conditions read Unknown, not a stale OK
            close_ops = getattr(self.sriov_ops, "close", None)
            if close_ops is not None:
                close_ops()  # netlink sockets; one still in a hung call closes when it returns
            self.record({"kind": "stop"})
            self.poke.close()
            self.plans_ended.close()
