"""The peermem guard's host side: the fanotify hold of anyone's ``nvidia-peermem`` load.

With ``[peermem] hold_loads = "fanotify"`` in enforce mode, the hold marks
the filesystems of ``hold_roots`` (and the driver containers' roots as they
start) before the first pass, and holds every open of the peermem module file
there until the guard's gate opens. It follows the gate the loop published:
closed in the protective step of a pass whose verdict is not ok, open at the
end of a pass that published the gate, or whose verdict says no wait can help
(``release_held``: a load the kernel refuses either way). What it held is
recorded at the end of every pass and at stop. See docs/design.md, "The hold".

The responder runs in a process of its own (``process.py``), so a
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

from nodeagent.core.guard import Verdict
from nodeagent.core.snapshot import HeldFileKey, HeldModule
from nodeagent.guards.peermem.heldfiles import HELD_FILES_MAX, VERDICT_CODES, held_modules
from nodeagent.guards.peermem.restarts import (
    CANCEL_TIMEOUT_S,
    RESTART_WINDOW_S,
    RESTARTS_MAX,
    Replacement,
    ResponderState,
)
from nodeagent.guards.peermem.side_start import RUNNING_FILE, HoldStarts
from nodeagent.guards.peermem.status import (
    held_count,
    record_holds,
    running_status,
    starting_status,
)
from nodeagent.guards.peermem.telemetry import HOLD_TELEMETRY
from nodeagent.guards.side import GuardSide, SideContext

if TYPE_CHECKING:
    from nodeagent.guards.peermem.roots import RootScanner
    from nodeagent.guards.peermem.start import HoldGroup, HoldResponder

log = logging.getLogger("nodeagent")


class PeermemHold(HoldStarts, GuardSide):
    status_key = "hold"
    telemetry = (HOLD_TELEMETRY,)  # held opens by how they ended, container roots marked

    def __init__(self, ctx: SideContext) -> None:
        super().__init__(ctx)
        self.hold: HoldResponder | None = None
        self.marked: list[str] = []
        self.containers: RootScanner | None = None  # driver containers' roots, as they start
        self.since: float | None = None
        self.gate_open = False  # what the responder reads: never a file, never a lock
        # The verdicts on held nvidia-peermem files it reads too (heldfiles.GO, REBUILD,
        # WAIT; a file not listed goes by the gate), from the last pass that vouched; and
        # each file's reason,
        # for the record of its open when it ends, and status.
        self.verdicts: dict[HeldFileKey, int] = {}
        # The gate checked no file (its root not mounted): a held nvidia-peermem file waits
        # for its own verdict, gate or not (an open of one is held to be judged).
        self.judge_all = False
        self.reasons: dict[HeldFileKey, str] = {}
        self.held_judged: list[dict[str, Any]] = []
        self.unlimited_queue = True  # the group's queue (bounded: an overflow lets opens go)
        self.release = False  # the last pass let held loads go without a gate (release_held)
        self.restarts: list[float] = []  # when a dead responder was replaced (the window's)
        self.replacement: Replacement | None = None  # a new responder starting, off the loop
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

    def readers(self) -> dict[str, Callable[[], Any]]:
        """The files its responder holds, for the snapshot: the gate judges those bytes."""
        return {"held": self._read_held} if self.configured else {}

    def _read_held(self) -> tuple[tuple[HeldModule, ...], list[str]]:
        hold = self.hold
        if hold is None or not hold.alive():
            return (), []
        return held_modules(hold.held_files())

    def writes(self) -> dict[str, tuple[str, ...]]:
        return {self.ctx.paths.state_dir: (RUNNING_FILE,)}

    @property
    def phase(self) -> ResponderState:
        """Where the responder is, and so the hold."""
        if self.off is not None:
            return ResponderState.OFF
        if self.hold is not None:
            return ResponderState.RUNNING if self.hold.alive() else ResponderState.STOPPED
        if self.retry_at is not None and self.last_failure:
            return ResponderState.RETRYING
        if self.replacement is not None:
            return ResponderState.STARTING
        return ResponderState.NOT_STARTED

    @property
    def state(self) -> str:
        """One phrase: starting, running, retrying: <why>, off after N restarts: <why>."""
        phase = self.phase
        if phase is ResponderState.OFF:
            return self.off or phase.value
        if phase is ResponderState.STOPPED:
            return f"{phase.value}: its responder no longer answers"
        if phase is ResponderState.RETRYING:
            return f"{phase.value}: {self.last_failure}"
        return phase.value

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
            and held_count(self.hold) > 0
        )

    def drain_seconds(self) -> float:
        """At most the hold's budget: each held open ends by then whatever the gate."""
        return float(self.ctx.policy.hold_budget_s) if self.draining() else 0.0

    def after_publish(self, verdict: Verdict, published: bool, vouches: Callable[[], bool]) -> None:
        """A held load goes on only when ``wait`` would, or when the guard says no wait can
        help (a load the kernel refuses either way)."""
        vouched = vouches()
        self.release = bool(verdict.evidence.get("release_held")) and vouched
        judge_all = bool((verdict.evidence.get("abi") or {}).get("deferred"))
        self._follow(published or self.release, self._verdicts_of(verdict, vouched), judge_all)
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
        return self.hold is not None and (self.gate_open or bool(self.verdicts))

    def beat(self, published: bool, vouches: Callable[[], bool]) -> None:
        """Renew the responder's lease while the decision that opened it stands; a loop
        that stops beating lets it run out (loads wait, other opens go)."""
        if self.hold is None or not (self.gate_open or self.verdicts):
            return
        vouched = vouches()
        again = published or (self.release and vouched)
        self._follow(again, self.verdicts if vouched else {}, self.judge_all)

    def status(self) -> Any:
        if self.hold is None:
            if not self.configured:
                return None
            return starting_status(
                self.state,
                start_failures=self.start_failures,
                gate_open=self.gate_open,
                unlimited_queue=self.unlimited_queue,
                starting=self.replacement is not None,
                restarts=len(self.restarts),
            )
        status = running_status(
            self.hold,
            self.containers,
            state=self.state,
            marked=self.marked,
            since=self.since,
            gate_open=self.gate_open,
            unlimited_queue=self.unlimited_queue,
            restarts=len(self.restarts),
        )
        # Each nvidia-peermem file held now, judged: path, verdict (go, wait, rebuild), why.
        status["held_files"] = [
            {k: e[k] for k in ("path", "verdict", "reason")} for e in self.held_judged
        ]
        return status

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

    def _verdicts_of(self, verdict: Verdict, vouched: bool) -> dict[HeldFileKey, int]:
        """The guard's verdicts on the files held (``evidence.held``), as the responder
        reads them: only from a pass that vouches, as the gate is; each reason kept."""
        judged = verdict.evidence.get("held") or []
        self.held_judged = list(judged)
        out: dict[HeldFileKey, int] = {}
        for entry in judged:
            file = entry["file"]
            key: HeldFileKey = (file[0], file[1], file[2], file[3])
            self.reasons[key] = entry["reason"]
            code = VERDICT_CODES.get(entry["verdict"])
            if code is not None and vouched:
                out[key] = code
        if len(self.reasons) > 4 * HELD_FILES_MAX:  # (kept a while for the ends' records)
            self.reasons = dict(list(self.reasons.items())[-HELD_FILES_MAX:])
        return out

    def _follow(
        self,
        is_open: bool,
        verdicts: dict[HeldFileKey, int] | None = None,
        judge_all: bool | None = None,
    ) -> None:
        """Tell the responder the gate and the verdicts on held files: at a change, and
        while either stands at every pass and beat (the process apart reads a lease that
        runs out without them). Without one (a new one starting), they are kept for it:
        adopted, it is told them then."""
        verdicts = verdicts or {}
        judge = self.judge_all if judge_all is None else judge_all
        if self.hold is None:
            self.gate_open, self.verdicts, self.judge_all = is_open, verdicts, judge
            return
        if not (is_open or self.gate_open or verdicts or self.verdicts):
            self.judge_all = judge
            return  # closed, and it was: nothing to tell
        # Narrowing (the gate closing, a verdict withdrawn), the responder's lease first:
        # whoever sees the flags narrowed finds the lease so (a load started then is held).
        # Widening, the flags first: a thread responder reads them when follow wakes it.
        narrowing = (
            (self.gate_open and not is_open)
            or (judge and not self.judge_all)
            or any(verdicts.get(k) != v for k, v in self.verdicts.items())
        )
        if narrowing:
            self.hold.follow(is_open, verdicts, judge)
            self.gate_open, self.verdicts, self.judge_all = is_open, verdicts, judge
        else:
            self.gate_open, self.verdicts, self.judge_all = is_open, verdicts, judge
            self.hold.follow(is_open, verdicts, judge)

    def _replace_dead_responder(self) -> None:
        """A responder process that died: its pending opens went when the agent closed its
        copy of the group; start a new group, process and marks (at most ``RESTARTS_MAX``
        times in ``RESTART_WINDOW_S``), recording what the old one said first."""
        died = self.hold.died if self.hold is not None else None
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

    def _record_holds(self) -> None:
        """Every held open that ended since the last pass, as a timeline record."""
        if self.hold is not None:
            self.reports_lost_said = record_holds(
                self.hold,
                self.containers,
                self.ctx.record,
                self.ctx.name,
                self.reports_lost_said,
                why_of=self.reasons.get,
            )
