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
``RESTARTS_MAX`` times in ``RESTART_WINDOW_S``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodeagent.core.guard import Verdict
from nodeagent.guards.side import GuardSide, SideContext
from nodeagent.host.hold_telemetry import HOLD_TELEMETRY

if TYPE_CHECKING:
    from nodeagent.host.containers import RootScanner
    from nodeagent.host.hold import HoldResponder

log = logging.getLogger("nodeagent")

RESTARTS_MAX = 5  # new responders after a death, within the window; then the hold stays off
RESTART_WINDOW_S = 600.0


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

    # -- the loop's hooks -------------------------------------------------------

    def start(self) -> None:
        """Mark the filesystems of hold_roots and start the responder (before the first pass).
        Imports inside: a tool that never holds (``check``) loads no fanotify or /proc code."""
        pol, ctx = self.ctx.policy, self.ctx
        if not ctx.enforce or pol.hold_loads != "fanotify":
            return
        self._start_hold()

    def _start_hold(self) -> None:
        from nodeagent.host.containers import RootScanner
        from nodeagent.host.fanotify import FanotifyGroup
        from nodeagent.host.hold import HoldHost, start_hold

        pol, ctx = self.ctx.policy, self.ctx
        host = ctx.ports.hold_host or HoldHost(group=FanotifyGroup)
        try:
            group = host.group()
        except OSError as exc:
            log.warning("peermem.hold_loads: %s", exc)
            ctx.record({"kind": "state-problem", "problem": f"peermem.hold_loads: {exc}"})
            return
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
            )
        self.hold, self.marked, problems = start_hold(
            group,
            group.mark_filesystem,
            roots,
            gate_open=lambda: self.gate_open,
            budget_s=pol.hold_budget_s,
            host_pids=host.host_pids(),
            containers=bool(pol.hold_containers),
            on_report=on_report,
            host=host,
            apart=apart,
        )
        for p in problems:
            log.warning(p)
            ctx.record({"kind": "state-problem", "problem": p})
        if self.hold is None:
            return
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

    def protect(self, verdict: Verdict) -> None:
        if not verdict.ok:
            self._follow(False)

    def after_publish(self, verdict: Verdict, published: bool, vouches: Callable[[], bool]) -> None:
        """A held load goes on only when ``wait`` would, or when the guard says no wait can
        help (a load the kernel refuses either way)."""
        self.release = bool(verdict.evidence.get("release_held")) and vouches()
        self._follow(published or self.release)
        self._record_holds()
        self._replace_dead_responder()

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
            return None
        return {
            "marked": self.marked,
            "since": self.since,
            "gate_open": self.gate_open,
            "queue": "unlimited" if self.unlimited_queue else "bounded",
            "held": [
                {"pid": p, "opener": o, "path": f, "seconds": round(t, 3)}
                for p, o, f, t in self.hold.held()
            ],
            "counts": dict(self.hold.counts),
            "responder": "answering" if self.hold.alive() else "stopped",
            # Its own process (pid), or a thread of the agent's (None); replaced after deaths.
            "responder_pid": getattr(self.hold, "pid", None),
            "responder_restarts": len(self.restarts),
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
        }

    def stop(self) -> None:
        if self.containers is not None:
            self.containers.stop()
        if self.hold is not None:
            self.hold.stop()  # every held open is allowed and reported
            self._record_holds()

    # -- its own --------------------------------------------------------------

    def _follow(self, is_open: bool) -> None:
        """Tell the responder the gate: at a change, and while open at every pass and beat
        (the process apart reads a lease that runs out without them)."""
        if self.hold is None or not (is_open or self.gate_open):
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
        now = self.ctx.clock()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= RESTARTS_MAX:
            problem = (
                f"peermem.hold_loads: the responder process died {len(self.restarts) + 1} times "
                f"in {RESTART_WINDOW_S:g}s (last: {died}); not holding any load until the agent "
                "restarts"
            )
            log.error("%s", problem)
            self.ctx.record({"kind": "state-problem", "problem": problem})
            return
        self.restarts.append(now)
        log.warning("peermem hold: the responder process %s; starting a new one", died)
        self._start_hold()
        self.ctx.wake("hold restarted")  # a pass now: its status shows the new responder

    def _let_go(self, why: str) -> None:
        """Stop the scanner and the responder (every held open allowed, reported); each
        container root marked is said gone (the gauge follows), then the side holds none."""
        self.stop()
        for r in self.containers.roots() if self.containers is not None else []:
            self.ctx.record(
                {"kind": "hold-root-gone", "pid": r.pid, "dev": r.dev_text(), "why": why}
            )
        self.hold, self.containers, self.marked = None, None, []

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
        out["held_now"] = len(self.hold.held()) if self.hold is not None else 0
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
