"""How the hold's side starts: the responder (off the loop thread, or adopted from a dead
agent), the roots marked and marked again, a failed start retried with backoff, and the
file that says a hold runs. A part of ``PeermemHold`` (``side.py``), apart for its size."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from nodeagent.core.guard import backoff_delay
from nodeagent.core.snapshot import HeldFileKey
from nodeagent.guards.peermem.lease import HeldVerdicts
from nodeagent.guards.peermem.restarts import Replacement, Started
from nodeagent.guards.side import SideContext

if TYPE_CHECKING:
    from nodeagent.guards.peermem.budget import DescriptorBudget
    from nodeagent.guards.peermem.process import ResponderProcess
    from nodeagent.guards.peermem.roots import RootScanner
    from nodeagent.guards.peermem.start import HoldGroup, HoldHost, HoldResponder

log = logging.getLogger("nodeagent")

# A start that failed (the kernel refused a group, the responder never answered, nothing
# could be marked) is tried again this long after, doubled at each failure in a row up to
# START_RETRY_MAX_S, never given up: a hold configured and not holding is a problem said
# at every pass meanwhile (``problems``).
START_RETRY_S = 1.0
START_RETRY_MAX_S = 60.0
# In the state directory while a hold runs, removed at a clean stop: found at start, the
# last agent ended while holding (killed: nothing could keep its held opens waiting).
RUNNING_FILE = "hold.running"


class HoldStarts:
    """``PeermemHold``'s starting half: the state it shares is ``PeermemHold``'s own
    (set in its ``__init__``), declared here for the type checker."""

    ctx: SideContext
    hold: HoldResponder | None
    marked: list[str]
    containers: RootScanner | None
    since: float | None
    gate_open: bool
    verdicts: dict[HeldFileKey, int]
    judge_all: bool
    unlimited_queue: bool
    replacement: Replacement | None
    start_failures: int
    last_failure: str | None
    retry_at: float | None
    _retry_timer: threading.Timer | None
    unclean_end: bool | None
    group: HoldGroup | None
    mark_failures: int
    mark_at: float | None

    @property
    def _state_path(self) -> str:
        return str(self.ctx.host.path(self.ctx.paths.state_dir))

    def _adopt_left_responder(self) -> bool:
        """The responder the last agent left when it died without a stop (its pod alive: the
        supervisor started this agent): adopted, it holds on and answers this agent; what it
        holds goes on when this agent's gate opens (issue 52). True once it is the hold.
        Bounded: a local socket and the responder's answer (``ADOPT_TIMEOUT_S``), only
        when its file is there."""
        from nodeagent.guards.peermem.start import HoldHost, adopt, start_hold
        from nodeagent.host.fanotify import FanotifyGroup

        pol, ctx = self.ctx.policy, self.ctx
        host = ctx.port or HoldHost(group=FanotifyGroup)
        if not (host.apart and host.group is FanotifyGroup):
            return False
        try:
            process = adopt(
                self._state_path,
                budget_s=pol.hold_budget_s,
                on_report=lambda: ctx.wake("held open ended"),
                proc=host.proc,
            )
        except OSError as exc:
            problem = (
                f"peermem.hold_loads: the responder a dead agent left could not be adopted "
                f"({exc}); starting a new one (a killed one let what it held go)"
            )
            log.warning("%s", problem)
            ctx.record({"kind": "state-problem", "problem": problem})
            return False
        if process is None:
            return False
        group = process.group

        def apart(budget: DescriptorBudget) -> ResponderProcess:
            process.descriptors = budget
            return process

        started = start_hold(
            group,
            group.mark_filesystem,  # (marked already: marking again changes nothing)
            [(r, str(ctx.host.path(r))) for r in pol.hold_roots],
            gate_open=lambda: self.gate_open,
            verdicts=lambda: HeldVerdicts(self.verdicts, self.judge_all),
            budget_s=pol.hold_budget_s,
            host_pids=host.host_pids(),
            containers=bool(pol.hold_containers),
            on_report=lambda: ctx.wake("held open ended"),
            host=host,
            apart=apart,
        )
        if not self._adopt(group, host, started):
            return False
        said = process.adopted_from or {}
        self.unclean_end = False  # nothing went: it held on
        ctx.record(
            {
                "kind": "hold-adopted",
                "guard": ctx.name,
                "responder_pid": process.pid,
                "held_count": said.get("held_count"),
                "held": said.get("held", []),
                "orphaned_s": said.get("orphaned_s"),
                "meaning": "the last agent died without a stop while its pod lived; its "
                "responder held on (its gate closed) and this agent adopted it: what it "
                "holds goes on when this agent's gate opens",
            }
        )
        log.warning(
            "peermem hold: adopted the responder %s the last agent left (%s held)",
            process.pid,
            said.get("held_count"),
        )
        return True

    @property
    def _running_rel(self) -> str:
        return f"{self.ctx.paths.state_dir}/{RUNNING_FILE}"

    def _look_for_an_unclean_end(self) -> None:
        """The last agent held and was killed (SIGKILL, OOM: its stop never ran): the
        kernel let whatever it held go, gate or not. Said in one record at the first pass
        (``after_publish``); what went through meanwhile the guard's decision sees now."""
        try:
            self.unclean_end = self.ctx.host.file_fact(self._running_rel).present
        except (OSError, ValueError):
            self.unclean_end = None

    def _say_running(self, running: bool) -> None:
        from nodeagent.errors import NodeagentError

        try:
            if running:
                self.ctx.host.write_atomic(self._running_rel, b"", durable=False)
            else:
                self.ctx.host.remove(self._running_rel)
        except (OSError, NodeagentError) as exc:
            log.warning("peermem hold: %s: %s", self._running_rel, exc)

    def _start_apart(self) -> None:
        """A new group, process and marks, started off the loop thread (``Replacement``);
        a group the kernel refuses is a failed start (tried again)."""
        replacement = Replacement(self.ctx.wake)
        prepared = self._prepare(track=replacement.track)
        if prepared is None:
            self._start_failed("the kernel refused a fanotify group")
            return
        replacement.begin(*prepared)
        self.replacement = replacement

    def _start_failed(self, why: str) -> None:
        """Try again after the backoff: a timer wakes the loop when it is due."""
        self.start_failures += 1
        self.last_failure = why
        delay = backoff_delay(self.start_failures, START_RETRY_S, START_RETRY_MAX_S)
        self.retry_at = self.ctx.clock() + delay
        timer = threading.Timer(delay, self.ctx.wake, args=("hold start due",))
        timer.daemon = True
        timer.start()
        self._retry_timer = timer

    def _retry_if_due(self) -> None:
        if self.retry_at is None or self.ctx.clock() < self.retry_at:
            return
        self.retry_at, self._retry_timer = None, None
        self._start_apart()

    def _cancel_retry(self) -> None:
        timer, self._retry_timer, self.retry_at = self._retry_timer, None, None
        if timer is not None:
            timer.cancel()

    def _prepare(
        self, track: Callable[[ResponderProcess], None] = lambda responder: None
    ) -> tuple[HoldGroup, HoldHost, Callable[[], Started]] | None:
        """A new group (problems recorded), and how to start the hold on it: ``run``, which
        waits for the responder process to answer (``track``: given it before it starts);
        None when the kernel refuses a group."""
        from nodeagent.guards.peermem.start import HoldHost, start_hold
        from nodeagent.host.fanotify import FanotifyGroup

        pol, ctx = self.ctx.policy, self.ctx
        host = ctx.port or HoldHost(group=FanotifyGroup)
        try:
            group = host.group()
        except OSError as exc:
            log.warning("peermem.hold_loads: %s", exc)
            ctx.record({"kind": "state-problem", "problem": f"peermem.hold_loads: {exc}"})
            return None
        # A group without an unlimited queue holds until its queue overflows: weaker, said.
        self.unlimited_queue = group.unlimited_queue
        queue_problem = group.queue_problem
        if queue_problem:
            log.warning("%s", queue_problem)
            ctx.record({"kind": "state-problem", "problem": queue_problem})
        roots = [(r, str(ctx.host.path(r))) for r in pol.hold_roots]

        def on_report() -> None:
            ctx.wake("held open ended")  # a pipe write: safe from the responder's threads

        apart = None  # the responder in a process of its own: the kernel's group only
        if host.threaded and host.apart and isinstance(group, FanotifyGroup):
            from nodeagent.guards.peermem.start import spawner

            apart = spawner(
                group,
                budget_s=pol.hold_budget_s,
                on_report=on_report,
                proc=host.proc,
                track=track,
                adopt_dir=self._state_path,
            )
        host_pids = host.host_pids()

        def run() -> Started:
            try:
                return start_hold(
                    group,
                    group.mark_filesystem,
                    roots,
                    gate_open=lambda: self.gate_open,
                    verdicts=lambda: HeldVerdicts(self.verdicts, self.judge_all),
                    budget_s=pol.hold_budget_s,
                    host_pids=host_pids,
                    containers=bool(pol.hold_containers),
                    on_report=on_report,
                    host=host,
                    apart=apart,
                )
            except Exception:
                group.close()  # (start_hold closes it on every failure it foresees)
                raise

        return group, host, run

    def _adopt(self, group: HoldGroup, host: HoldHost, started: Started) -> bool:
        """On the loop thread: what ``start_hold`` returned, its problems recorded, becomes
        the side's hold, told the gate now; False when it holds nothing."""
        from nodeagent.guards.peermem.roots import RootScanner

        pol, ctx = self.ctx.policy, self.ctx
        hold, marked, problems = started
        for p in problems:
            log.warning(p)
            ctx.record({"kind": "state-problem", "problem": p})
        if hold is None:
            return False
        self.hold, self.marked, self.group = hold, marked, group
        self._say_running(True)
        self.mark_failures, self.mark_at = 0, None
        if any(name not in marked for name in pol.hold_roots):  # tried again (_mark_roots)
            self._mark_failed()
        # A new responder starts closed: tell it the gate, and the verdicts on held files.
        self.hold.follow(self.gate_open, self.verdicts, self.judge_all)
        self.since = ctx.clock()
        budget = self.hold.descriptors
        ctx.record(
            {
                "kind": "hold-started",
                "marked": self.marked,
                "containers": list(pol.hold_containers),
                **({"descriptors": budget.status()} if budget is not None else {}),
            }
        )
        if pol.hold_containers:
            self.containers = RootScanner(
                group.open_root,
                group.marked_devices,
                pol.hold_containers,
                interval_s=pol.hold_scan_s,
                on_report=lambda: ctx.wake("container root"),
                proc=host.proc,
                dev_of=host.dev_of,
                may_load=host.may_load,
                clock=host.clock,
            )
            if host.threaded:
                self.containers.start()
            else:
                self.containers.prepare()
        return True

    def _mark_failed(self) -> None:
        self.mark_failures += 1
        delay = backoff_delay(self.mark_failures, START_RETRY_S, START_RETRY_MAX_S)
        self.mark_at = self.ctx.clock() + delay

    def _mark_roots(self) -> None:
        """Mark the hold_roots not marked yet, once their retry is due (a pass at least
        every resync looks); each one marked is recorded, each failure said once more."""
        if self.hold is None or self.group is None or self.mark_at is None:
            return
        if self.ctx.clock() < self.mark_at:
            return
        from nodeagent.guards.peermem.start import mark_root

        still: list[str] = []
        for name in self.ctx.policy.hold_roots:
            if name in self.marked:
                continue
            why = mark_root(self.group.mark_filesystem, name, str(self.ctx.host.path(name)))
            if why is not None:
                still.append(why)
                continue
            self.marked = [*self.marked, name]
            self.ctx.record({"kind": "hold-root-marked", "root": name})
        if still:
            problem = f"peermem.hold_roots not marked yet, tried again: {'; '.join(still)}"
            log.warning("%s", problem)
            self.ctx.record({"kind": "state-problem", "problem": problem})
            self._mark_failed()
        else:
            self.mark_failures, self.mark_at = 0, None
