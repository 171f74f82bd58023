"""The peermem guard's host side: the fanotify hold of anyone's ``nvidia-peermem`` load.

With ``[peermem] hold_loads = "fanotify"`` in enforce mode, the hold marks
the filesystems of ``hold_roots`` (and the driver containers' roots as they
start) before the first pass, and holds every open of the peermem module file
there until the guard's gate opens. It follows the gate the loop published:
closed in the protective step of a pass whose verdict is not ok, open at the
end of a pass that published the gate, or whose verdict says no wait can help
(``release_held``: a load the kernel refuses either way). What it held is
recorded at the end of every pass and at stop. See docs/design.md, "The hold".

The responder runs in a process of its own (``host/responder_apart.py``), so a
stalled agent stalls no open: the gate reaches it as a lease this side writes at
each change and renews at each heartbeat (``beat``). If that process dies, the
agent's copy of the group is closed at once (the kernel lets what was pending
go) and the next pass starts a new group, process and marks, at most
``RESTARTS_MAX`` times in ``RESTART_WINDOW_S``. Every responder, the first
included, starts off the loop thread (its wait for the process to answer may
take ``READY_TIMEOUT_S``, and no pass may wait on it): the side holds nothing
meanwhile (status ``"state": "starting"``), and a later pass adopts it once it
answered. A start that failed is tried again with backoff (``START_RETRY_S``
doubling to ``START_RETRY_MAX_S``; ``"state": "retrying: <why>"``); past the
restart window's limit the hold is off until the agent restarts (``"state":
"off after N restarts: <why>"``). Whenever the hold is configured and not
holding, every pass says so as a problem of its status.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodeagent.core.guard import Verdict, backoff_delay
from nodeagent.guards.side import GuardSide, SideContext
from nodeagent.host.hold_telemetry import HOLD_TELEMETRY

if TYPE_CHECKING:
    from nodeagent.host.containers import RootScanner
    from nodeagent.host.hold import DescriptorBudget, HoldGroup, HoldHost, HoldResponder
    from nodeagent.host.responder_apart import ResponderProcess

log = logging.getLogger("nodeagent")

RESTARTS_MAX = 5  # new responders after a death, within the window; then the hold stays off
RESTART_WINDOW_S = 600.0
# A start that failed (the kernel refused a group, the responder never answered, nothing
# could be marked) is tried again this long after, doubled at each failure in a row up to
# START_RETRY_MAX_S, never given up: a hold configured and not holding is a problem said
# at every pass meanwhile (``problems``).
START_RETRY_S = 1.0
START_RETRY_MAX_S = 60.0
# In the state directory while a hold runs, removed at a clean stop: found at start, the
# last agent ended while holding (killed: nothing could keep its held opens waiting).
RUNNING_FILE = "hold.running"
# How long stop waits for a new responder still starting to be killed and closed (its
# process is killed at once: this is its reaping and its descriptors closing).
CANCEL_TIMEOUT_S = 5.0

# start_hold's answer: (responder, marked, problems).
Started = tuple["HoldResponder | None", list[str], list[str]]


class _Replacement:
    """A new responder started off the loop thread: the starter thread runs ``start_hold``
    (the process, its wait to answer, the marks) and leaves what it returned here; the loop
    thread takes it in a later pass (``take``), or cancels it at stop (``cancel``). After a
    cancel, whichever of the two sees the result stops it, never both."""

    def __init__(self, wake: Callable[[str], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._cancelled = False
        self._result: Started | None = None
        self._process: ResponderProcess | None = None  # the process starting, to abort
        self.group: HoldGroup | None = None
        self.host: HoldHost | None = None
        self.thread: threading.Thread | None = None

    def begin(self, group: HoldGroup, host: HoldHost, run: Callable[[], Started]) -> None:
        self.group, self.host = group, host
        self.thread = threading.Thread(
            target=self._run, args=(run,), name="hold-starter", daemon=True
        )
        self.thread.start()

    @property
    def pid(self) -> int | None:
        """The new responder's process, once spawned."""
        process = self._process
        return process.pid if process is not None else None

    def track(self, process: ResponderProcess) -> None:
        """The starter thread, before the process starts: kept for ``cancel``."""
        with self._lock:
            if self._cancelled:
                raise OSError("the agent stopped before a new responder started")
            self._process = process

    def take(self) -> Started | None:
        """What ``start_hold`` returned; None while it runs."""
        with self._lock:
            return self._result

    def cancel(self, timeout: float) -> bool:
        """The agent stops: a process still starting is killed, one started is stopped
        (every descriptor closed); False when the starter did not end in ``timeout``."""
        with self._lock:
            self._cancelled = True
            result, process = self._result, self._process
        if result is not None:  # ended before the cancel: the starter stops nothing
            if result[0] is not None:
                result[0].stop()
        elif process is not None:
            process.abort()  # start() raises at once; a start past its answer: see _run
        if self.thread is not None:
            self.thread.join(timeout)
            return not self.thread.is_alive()
        return True

    def _run(self, run: Callable[[], Started]) -> None:
        try:
            result = run()
        except Exception as exc:  # a bug: said as a problem, never a silent dead thread
            result = (
                None,
                [],
                [
                    f"peermem.hold_loads: a new responder did not start ({type(exc).__name__}: "
                    f"{exc}); not holding any load"
                ],
            )
        with self._lock:
            self._result = result
            cancelled = self._cancelled
        if cancelled and result[0] is not None:
            result[0].stop()  # the loop thread will not take it
        self._wake("hold restarted" if result[0] is not None else "hold restart failed")


class PeermemHold(GuardSide):
    status_key = "hold"
    telemetry = (HOLD_TELEMETRY,)  # held opens by how they ended, container roots marked

    def __init__(self, ctx: SideContext) -> None:
        super().__init__(ctx)
        self.hold: HoldResponder | None = None
        self.marked: list[str] = []
        self.containers: RootScanner | None = None  # driver containers' roots, as they start
        self.since: float | None = None
        self.gate_open = False  # what the responder reads: never a file, never a lock
        self.unlimited_queue = True  # the group's queue (bounded: an overflow lets opens go)
        self.release = False  # the last pass let held loads go without a gate (release_held)
        self.restarts: list[float] = []  # when a dead responder was replaced (the window's)
        self.replacement: _Replacement | None = None  # a new responder starting, off the loop
        # Starts that failed in a row (the backoff's exponent), the last one's reason, and
        # when the next is due (a timer wakes the loop then).
        self.start_failures = 0
        self.last_failure: str | None = None
        self.retry_at: float | None = None
        self._retry_timer: threading.Timer | None = None
        self.off: str | None = None  # why the hold stays off until the agent restarts
        self.reports_lost_said = 0  # of the responder's lost reports, those recorded
        self.unclean_end: bool | None = None  # the last agent ended while holding (at start)
        # hold_roots not marked (absent yet, ENOSPC on max_user_marks...): tried again at
        # a pass from mark_at, START_RETRY_S doubling to START_RETRY_MAX_S.
        self.group: HoldGroup | None = None
        self.mark_failures = 0
        self.mark_at: float | None = None

    # -- the loop's hooks -------------------------------------------------------

    @property
    def configured(self) -> bool:
        return self.ctx.enforce and self.ctx.policy.hold_loads == "fanotify"

    def start(self) -> None:
        """Mark the filesystems of hold_roots and start the responder, off the loop thread:
        the first pass and its protective steps wait on nothing; a later pass adopts it.
        A stepped host (the simulator: ``threaded=False``) starts it here, before the first
        pass. Imports inside: a tool that never holds (``check``) loads no fanotify or
        /proc code."""
        if not self.configured:
            return
        self._look_for_an_unclean_end()
        host = self.ctx.port
        if host is not None and not host.threaded:
            prepared = self._prepare()
            if prepared is not None:
                group, host, run = prepared
                self._adopt(group, host, run())
            return
        if self._adopt_left_responder():
            return
        self._start_apart()

    @property
    def _state_path(self) -> str:
        return str(self.ctx.host.path(self.ctx.paths.state_dir))

    def _adopt_left_responder(self) -> bool:
        """The responder the last agent left when it died without a stop (its pod alive: the
        supervisor started this agent): adopted, it holds on and answers this agent; what it
        holds goes on when this agent's gate opens (issue 52). True once it is the hold.
        Bounded: a local socket and the responder's answer (``ADOPT_TIMEOUT_S``), only
        when its file is there."""
        from nodeagent.host.fanotify import FanotifyGroup
        from nodeagent.host.hold import HoldHost, start_hold
        from nodeagent.host.responder_apart import adopt

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

    def writes(self) -> dict[str, tuple[str, ...]]:
        return {self.ctx.paths.state_dir: (RUNNING_FILE,)}

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
        """A new group, process and marks, started off the loop thread (``_Replacement``);
        a group the kernel refuses is a failed start (tried again)."""
        replacement = _Replacement(self.ctx.wake)
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

    @property
    def state(self) -> str:
        """One phrase: starting, running, retrying: <why>, off after N restarts: <why>."""
        if self.off is not None:
            return self.off
        if self.hold is not None and self.hold.alive():
            return "running"
        if self.hold is not None:
            return "stopped: its responder no longer answers"
        if self.retry_at is not None and self.last_failure:
            return f"retrying: {self.last_failure}"
        if self.replacement is not None:
            return "starting"
        return "not started"

    def problems(self) -> list[str]:
        """Configured and not holding, or a root not marked: said at every pass meanwhile."""
        if not self.configured:
            return []
        if self.hold is None or not self.hold.alive():
            return [f"peermem.hold_loads is configured and not holding any load: {self.state}"]
        unmarked = [r for r in self.ctx.policy.hold_roots if r not in self.marked]
        if unmarked:
            return [
                f"peermem.hold_roots {', '.join(unmarked)} not marked (tried again): a load "
                "through it is not held"
            ]
        return []

    def _prepare(
        self, track: Callable[[ResponderProcess], None] = lambda responder: None
    ) -> tuple[HoldGroup, HoldHost, Callable[[], Started]] | None:
        """A new group (problems recorded), and how to start the hold on it: ``run``, which
        waits for the responder process to answer (``track``: given it before it starts);
        None when the kernel refuses a group."""
        from nodeagent.host.fanotify import FanotifyGroup
        from nodeagent.host.hold import HoldHost, start_hold

        pol, ctx = self.ctx.policy, self.ctx
        host = ctx.port or HoldHost(group=FanotifyGroup)
        try:
            group = host.group()
        except OSError as exc:
            log.warning("peermem.hold_loads: %s", exc)
            ctx.record({"kind": "state-problem", "problem": f"peermem.hold_loads: {exc}"})
            return None
        # A group without an unlimited queue holds until its queue overflows: weaker, said.
        self.unlimited_queue = getattr(group, "unlimited_queue", True)
        queue_problem = getattr(group, "queue_problem", None)
        if queue_problem:
            log.warning("%s", queue_problem)
            ctx.record({"kind": "state-problem", "problem": queue_problem})
        roots = [(r, str(ctx.host.path(r))) for r in pol.hold_roots]

        def on_report() -> None:
            ctx.wake("held open ended")  # a pipe write: safe from the responder's threads

        apart = None  # the responder in a process of its own: the kernel's group only
        if host.threaded and host.apart and isinstance(group, FanotifyGroup):
            from nodeagent.host.responder_apart import spawner

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
        from nodeagent.host.containers import RootScanner

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
        self.hold.follow(self.gate_open)  # a new responder starts closed: tell it the gate
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

    def protect(self, verdict: Verdict) -> None:
        if not verdict.ok:
            self._follow(False)

    def gate_closing(self) -> None:
        self._follow(False)

    def draining(self) -> bool:
        """A load held with the gate closed: a stop now would let it go (issue 52)."""
        return (
            self.hold is not None
            and self.hold.alive()
            and not self.gate_open
            and self._held_count() > 0
        )

    def drain_seconds(self) -> float:
        """At most the hold's budget: each held open ends by then whatever the gate."""
        return float(self.ctx.policy.hold_budget_s) if self.draining() else 0.0

    def after_publish(self, verdict: Verdict, published: bool, vouches: Callable[[], bool]) -> None:
        """A held load goes on only when ``wait`` would, or when the guard says no wait can
        help (a load the kernel refuses either way)."""
        self.release = bool(verdict.evidence.get("release_held")) and vouches()
        self._follow(published or self.release)
        if self.unclean_end:
            self.unclean_end = False
            self.ctx.record(
                {
                    "kind": "hold-ended-unclean",
                    "guard": self.ctx.name,
                    "gate_open_now": published,
                    "meaning": "the last agent was killed while it held loads (its stop "
                    "never ran): the kernel let every held open go, gate or not, so a load "
                    "of nvidia-peermem may have gone on with the gate closed; this agent's "
                    "decisions say what it found (a peermem loaded with the gate closed is "
                    "unloaded, and loaded back once the gate opens)",
                }
            )
        self._adopt_replacement()
        self._record_holds()
        self._replace_dead_responder()
        self._retry_if_due()
        self._mark_roots()

    def needs_beat(self) -> bool:
        return self.hold is not None and self.gate_open

    def beat(self, published: bool, vouches: Callable[[], bool]) -> None:
        """Renew the responder's lease while the decision that opened it stands; a loop
        that stops beating lets it run out (loads wait, other opens go)."""
        if self.hold is None or not self.gate_open:
            return
        self._follow(published or (self.release and vouches()))

    def status(self) -> Any:
        if self.hold is None:
            return self._starting_status() if self.configured else None
        return {
            "state": self.state,
            "marked": self.marked,
            "since": self.since,
            "gate_open": self.gate_open,
            "queue": "unlimited" if self.unlimited_queue else "bounded",
            "held": [
                {"pid": p, "opener": o, "path": f, "seconds": round(t, 3)}
                for p, o, f, t in self.hold.held()
            ],
            "held_count": self._held_count(),  # exact: "held" may list only some
            "counts": dict(self.hold.counts),
            "responder": "answering" if self.hold.alive() else "stopped",
            # Its own process (pid), or a thread of the agent's (None); replaced after deaths.
            "responder_pid": getattr(self.hold, "pid", None),
            "responder_restarts": len(self.restarts),
            # The responder a dead agent left, adopted by this one (issue 52).
            "responder_adopted": getattr(self.hold, "adopted_from", None) is not None,
            # Non-target files filtered in the kernel after their first open: how
            # (evictable, pinned, off), how many; None for a responder without them.
            "ignore_marks": self._ignore_status(),
            # Descriptors: the limit (raised to the hard one at start), the reserve kept for
            # the rest of the agent, the caps on held opens fitted in what is left, in use now.
            "descriptors": self._descriptors(),
            "container_roots": [
                {
                    "dev": r.dev_text(),
                    "pid": r.pid,
                    "rule": r.rule,
                    "command": r.command,
                    "noticed_ms": round(r.noticed_s * 1000, 1),
                }
                for r in (self.containers.roots() if self.containers else [])
            ],
            # Matches of the rules left unmarked, and why (e.g. no CAP_SYS_MODULE).
            "not_marked": [
                {"pid": pid, "command": command, "why": why}
                for pid, command, why in (list(self.containers.refused) if self.containers else [])
            ],
            # How starts are noticed: "exec events", or "polling /proc every 0.1 s: <why>".
            "container_scan": self.containers.status() if self.containers else None,
        }

    def stop(self) -> None:
        self._cancel_retry()
        self._cancel_replacement()
        if self.containers is not None:
            self.containers.stop()
        if self.hold is not None:
            self.hold.stop()  # every held open is allowed and reported
            self._record_holds()
            self._say_running(False)

    def close(self) -> None:
        self._cancel_retry()
        self._cancel_replacement()  # (done by stop already)

    # -- its own --------------------------------------------------------------

    def _follow(self, is_open: bool) -> None:
        """Tell the responder the gate: at a change, and while open at every pass and beat
        (the process apart reads a lease that runs out without them). Without one (a new
        one starting), the gate is kept for it: adopted, it is told the gate then."""
        if self.hold is None:
            self.gate_open = is_open
            return
        if not (is_open or self.gate_open):
            return  # closed, and it was: nothing to tell
        # Closing, the responder's lease first: whoever sees gate_open False finds it closed
        # (a load started then is held). Opening, the flag first: a thread responder reads it
        # when follow wakes it.
        if is_open:
            self.gate_open = True
            self.hold.follow(True)
        else:
            self.hold.follow(False)
            self.gate_open = False

    def _replace_dead_responder(self) -> None:
        """A responder process that died: its pending opens went when the agent closed its
        copy of the group; start a new group, process and marks (at most ``RESTARTS_MAX``
        times in ``RESTART_WINDOW_S``), recording what the old one said first."""
        died = getattr(self.hold, "died", None)
        if self.hold is None or died is None:
            return
        self._record_holds()  # its death notice, and what it said before
        self._let_go("responder died")
        self._replace(died)

    def _replace(self, died: str) -> None:
        """Start a new responder off the loop thread after a death, counted in the window;
        past ``RESTARTS_MAX`` there, the hold stays off, said once (and by ``state``)."""
        now = self.ctx.clock()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= RESTARTS_MAX:
            self.off = f"off after {len(self.restarts)} restarts: the responder process {died}"
            problem = (
                f"peermem.hold_loads: the responder process died {len(self.restarts) + 1} "
                f"times in {RESTART_WINDOW_S:g}s (last: {died}); not holding any load "
                "until the agent restarts"
            )
            log.error("%s", problem)
            self.ctx.record({"kind": "state-problem", "problem": problem})
            return
        self.restarts.append(now)
        log.warning("peermem hold: the responder process %s; starting a new responder", died)
        self._start_apart()
        self.ctx.wake("hold restarting")  # a pass now: its status says it is starting

    def _adopt_replacement(self) -> None:
        """A new responder that answered becomes the hold (told this pass's gate); one that
        did not is a failed start, tried again after the backoff."""
        replacement = self.replacement
        started = replacement.take() if replacement is not None else None
        if replacement is None or started is None:
            return  # none, or still starting
        self.replacement = None
        assert replacement.group is not None and replacement.host is not None
        if self._adopt(replacement.group, replacement.host, started):
            self.start_failures, self.last_failure = 0, None
            return
        last = started[2][-1] if started[2] else "nothing said"
        why = last.removeprefix("peermem.hold_loads: ").removesuffix("; not holding any load")
        self._start_failed(why)

    def _cancel_replacement(self) -> None:
        replacement, self.replacement = self.replacement, None
        if replacement is not None and not replacement.cancel(CANCEL_TIMEOUT_S):
            log.warning("peermem hold: a new responder still starting after %gs", CANCEL_TIMEOUT_S)

    def _starting_status(self) -> dict[str, Any]:
        """Configured and not holding (starting, retrying, off): nothing marked, nothing
        held, and the state says why."""
        return {
            "state": self.state,
            "start_failures": self.start_failures,
            "marked": [],
            "since": None,
            "gate_open": self.gate_open,
            "queue": "unlimited" if self.unlimited_queue else "bounded",
            "held": [],
            "counts": {},
            "responder": "starting" if self.replacement is not None else "none",
            "responder_pid": None,
            "responder_restarts": len(self.restarts),
            "responder_adopted": False,
            "ignore_marks": None,
            "descriptors": None,
            "container_roots": [],
            "not_marked": [],
            "container_scan": None,
        }

    def _let_go(self, why: str) -> None:
        """Stop the scanner and the responder (every held open allowed, reported); each
        container root marked is said gone (the gauge follows), then the side holds none."""
        self.stop()
        for r in self.containers.roots() if self.containers is not None else []:
            self.ctx.record(
                {"kind": "hold-root-gone", "pid": r.pid, "dev": r.dev_text(), "why": why}
            )
        self.hold, self.containers, self.marked = None, None, []
        self.reports_lost_said = 0  # (a new responder counts from 0)

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
        from nodeagent.host.hold import mark_root

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

    def _held_count(self) -> int:
        """Exact, where the responder lists only some (apart: ``held_count``)."""
        if self.hold is None:
            return 0
        count = getattr(self.hold, "held_count", None)
        return int(count()) if count is not None else len(self.hold.held())

    def _ignore_status(self) -> dict[str, Any] | None:
        status = getattr(self.hold, "ignore_status", None)
        return status() if status is not None else None

    def _descriptors(self) -> dict[str, int] | None:
        budget = self.hold.descriptors if self.hold is not None else None
        if budget is None:
            return None
        from nodeagent.host.hold import open_descriptors

        out = budget.status()
        out["in_use"] = open_descriptors()
        responder_fds = getattr(self.hold, "descriptors_in_use", None)
        if responder_fds is not None:  # apart: held opens' descriptors are its own
            out["responder_in_use"] = responder_fds()
        out["held_now"] = self._held_count()
        return out

    def _record_holds(self) -> None:
        """Every held open that ended since the last pass, as a timeline record."""
        if self.hold is None:
            return
        scanner = self.containers
        while scanner is not None and scanner.reports:
            self.ctx.record(scanner.reports.popleft())
        # Bursts: an overflow (a held-class open may have gone), opens past a cap, a fault.
        while self.hold.notices:
            notice = self.hold.notices.popleft()
            log.warning("peermem hold: %s (%s times)", notice.get("meaning"), notice.get("count"))
            self.ctx.record({**notice, "guard": self.ctx.name})
        lost = int(getattr(self.hold, "reports_lost", 0))
        if lost > self.reports_lost_said:
            self.ctx.record(
                {
                    "kind": "hold-reports-lost",
                    "guard": self.ctx.name,
                    "count": lost - self.reports_lost_said,
                    "meaning": "held opens ended while the agent's loop did not read their "
                    "reports for long (stopped or starved): these are not in the timeline; "
                    "the hold's counts (status) still include them",
                }
            )
            self.reports_lost_said = lost
        while self.hold.reports:
            r = self.hold.reports.popleft()
            self.ctx.record(
                {
                    "kind": "held-open",
                    "guard": self.ctx.name,
                    "pid": r.pid,
                    "opener": r.opener,
                    "path": r.path,
                    "seconds": round(r.seconds, 3),
                    "ended": r.ended,
                }
            )
