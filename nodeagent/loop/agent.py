"""The run loop: wake -> pass -> wait, its wake sources, and the stop order.

Level-triggered: a wake-up only says "look again"; each pass reads the whole
node, so a missed event, an agent restart or a crash costs one pass. What a
pass does, in what order, is ``passes.py``; when the next one comes is its
``WakeSchedule``; what the agent is built from is ``wiring.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nodeagent.config import Config
from nodeagent.core.actions import ActionOutcome
from nodeagent.core.reconcile import AgentMemory
from nodeagent.guards.side import GuardSide
from nodeagent.host.events import FileWatch, Poke, UeventSource, Waker, WakeSource
from nodeagent.host.fs import HostRoot
from nodeagent.loop.passes import Passes, PassResult, WakeSchedule
from nodeagent.loop.records import action_record

log = logging.getLogger("nodeagent")

# At stop, steps in flight get this long to end before the stop actions run (SIGTERM's
# grace for the whole stop: host/events.py, STOP_GRACE_S).
STOP_WAIT_S = 1.0
# After a wake-up, how long the pass waits for a file just created in a watched directory
# to be closed by its writer (``FileWatch.settle``): a condition, not a delay.
SETTLE_S = 0.002


class Agent:
    """Built by ``wiring.build_agent``; ``nodeagent/agent.py`` builds one from keywords."""

    def __init__(
        self,
        cfg: Config,
        passes: Passes,
        *,
        host: HostRoot,
        poke: Poke,
        plans_ended: Poke,
        wake_sources: Sequence[WakeSource],
        watched: list[WakeSource],
    ) -> None:
        self.cfg = cfg
        self.pass_runner = passes
        self.host = host
        self.poke = poke
        # A worker's plan ended: wakes the loop to absorb it. Not a node event: its effects
        # on the node arrive as inotify or uevents of their own.
        self.plans_ended = plans_ended
        self.extra_sources = list(wake_sources)
        # What may wake the loop; anything pending here after a pass's observation makes
        # that pass's decision stale (run() fills it: inotify, uevents, the extra sources).
        self.watched = watched
        self.stopping = threading.Event()
        # Set while the loop waits for an event (no pass, no beat running): for benches and
        # tests that need "the loop idle" before they act.
        self.waiting = threading.Event()
        # Heartbeats between passes (``renew_leases``), counted for tests and benches.
        self.beats = 0
        # Set by a SIGTERM that found a load held with its gate closed: the loop goes on
        # until no side holds one or this moment passes (``stop_on_signal``).
        self.drain_until: float | None = None
        # The pass's collaborators, named here for the run loop, tests and tools.
        self.clock = passes.clock
        self.reconciler = passes.reconciler
        self.observer = passes.observer
        self.workers = passes.workers
        self.books = passes.books
        self.gates = passes.gates
        self.sides = passes.sides
        self.exporters = passes.exporters
        self.pass_context = passes.pass_context

    # -- what tests, tools and the simulator read -------------------------------

    @property
    def memory(self) -> AgentMemory:
        return self.pass_runner.memory

    @property
    def passes(self) -> int:
        return self.pass_runner.count

    def side(self, name: str) -> GuardSide | None:
        """A guard's host side (``guards/side.py``), if it has one."""
        return self.sides.get(name)

    def record(self, rec: dict[str, Any]) -> None:
        self.books.record(rec)

    def watched_dirs(self) -> list[str]:
        """Derived from the guards' declared needs (marker files' parents, listed dirs)."""
        return self.observer.needs.watch_dirs()

    def wait_for_passes(self, count: int, timeout: float) -> bool:
        """Block until at least ``count`` passes have completed (for tests and the simulator)."""
        return self.pass_runner.wait_for(count, timeout)

    # -- passes -------------------------------------------------------------------

    def run_pass(self, woken_by: Sequence[str] = ()) -> PassResult:
        return self.pass_runner.run(woken_by)

    def renew_leases(self) -> None:
        """The heartbeat: the gates' files, then what sides keep in step with them."""
        self.gates.renew(self.books.can_vouch)

        def vouches() -> bool:
            return self.books.can_vouch and self.gates.still_fresh()

        for name, side in self.sides.items():
            side.beat(name in self.gates.published, vouches)

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
            return self.pass_runner.absorb_finished()

    # -- the loop -------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        self.poke.poke("stop")

    def stop_on_signal(self) -> float:
        """SIGTERM: stop now, or first drain: while a side holds a load with its gate
        closed (the hold), a stop would let it go with the gate closed, the very race the
        agent prevents (a rollout of nodeagent during MOFED's restart: issue 52). The loop
        goes on (passes, leases, the responder) until no side holds one or the longest
        side's bound passes; returns that bound in seconds (0: stopping now)."""
        drain = max((side.drain_seconds() for side in self.sides.values()), default=0.0)
        if drain <= 0 or self.stopping.is_set():
            self.stop()
            return 0.0
        self.drain_until = self.clock() + drain
        log.warning(
            "stop asked while a load is held with its gate closed: draining for up to %gs "
            "(until the gate opens or the hold's budget ends; a second signal stops now)",
            drain,
        )
        self.record({"kind": "draining", "seconds": drain})
        self.poke.poke("drain")
        return drain

    def _drained(self, now: float) -> bool:
        """Draining, and nothing is left to drain (or its time is up)."""
        if self.drain_until is None:
            return False
        return now >= self.drain_until or not any(s.draining() for s in self.sides.values())

    def close(self) -> None:
        """Release an agent driven by ``run_pass`` (``run`` releases its own at the end)."""
        self.workers.close(0.0)
        self.observer.close()  # the .ko descriptors its parse cache keeps
        self.poke.close()
        self.plans_ended.close()

    def run(self, once: bool = False) -> None:
        self._remove_orphaned_temps()
        if once:
            self.run_once()
            return
        root = self.host.root
        watch = FileWatch(
            root,
            [self.host.path(d) for d in self.watched_dirs()],
            self._explained_events(),
            opens={self.host.path(rel): rel for rel in self.observer.needs.opens},
            clock=self.clock,
        )
        self.observer.opened_at = watch.opened_at
        sources: list[WakeSource] = [self.poke, watch, *self.extra_sources]
        if self.cfg.uevents:
            try:
                sources.append(UeventSource())
            except Exception as exc:  # no libudev, no netlink permission: inotify + resync remain
                log.warning("kernel uevents unavailable (%s); relying on inotify and resync", exc)
        waker = Waker([*sources, self.plans_ended])
        self.watched[:] = sources
        self.record({"kind": "start", "mode": self.cfg.mode, "host_root": str(root)})
        for side in self.sides.values():
            side.start()  # before the first pass: its decision opens or keeps closed
        try:
            self._loop(waker, watch)
        finally:
            self._stop(watch)

    def _explained_events(self) -> Callable[[Path], bool]:
        """An event a pass need not take as a change since its observation: in a directory
        watched only for marker files (no listing, no declared watch, no text read there),
        either on a marker (whose identity the freshness check compares again) or on a
        name nobody reads (a writer's temp file)."""
        needs = self.observer.needs
        parents = {self.host.path(f).parent for f in needs.files}
        read_whole = {self.host.path(d) for d in (*needs.listings, *needs.watch)}
        texts = {self.host.path(t) for t in needs.texts}
        markers_only = frozenset(parents - read_whole - {t.parent for t in texts})
        # Nor a name on the way to anything a pass reads: a watched directory (created now,
        # its contents unseen), a driver tree's modules (MOFED's tree lives under the
        # directory of its ready flag: a rename of its lib/ must make a decision stale).
        trees = {t for d in needs.disk for t in d.trees} | set(needs.chain_trees)
        read = {*read_whole, *parents, *texts} | {
            self.host.path(f"{t}/lib/modules" if t else "lib/modules") for t in trees
        }
        on_the_way = frozenset(a for d in read for a in (d, *d.parents))

        def explained(path: Path) -> bool:
            return path.parent in markers_only and path not in on_the_way

        return explained

    def _loop(self, waker: Waker, watch: FileWatch) -> None:
        woken_by = ["start"]
        schedule = WakeSchedule(self.clock(), self.cfg.resync_seconds)
        while not self.stopping.is_set():
            try:
                schedule.passed(self.run_pass(woken_by).wake_at)
                watch.refresh()
            except Exception as exc:  # one bad pass must not take the node's agent down
                log.exception("pass failed: %s", exc)
                self.record({"kind": "pass-error", "error": f"{type(exc).__name__}: {exc}"})
                schedule.failed(self.clock())
            now = self.clock()
            schedule.after(now)
            if self._drained(now):  # a pass let the held load go (the gate opened)
                self.stop()
                break
            # Between passes the loop beats every RENEW_S while a gate is open, a withdrawal
            # failed or an exporter keeps a heartbeat: the lease proves the loop, not a thread.
            # A beat renews and writes heartbeats, nothing else: only an event or a pass
            # that came due (the resync, a guard's wake_at) makes a pass.
            while True:
                beat = (
                    self.gates.needs_beat()
                    or self.exporters.needs_beat()
                    or any(side.needs_beat() for side in self.sides.values())
                )
                deadline, wait = schedule.next_wake(now, beat)
                if self.drain_until is not None:
                    wait = max(0.0, min(wait, self.drain_until - now))
                self.waiting.set()
                try:
                    woken_by = waker.wait(wait)
                finally:
                    self.waiting.clear()
                if woken_by:  # a file just created: its writer closes it first
                    woken_by += watch.settle(SETTLE_S)
                now = self.clock()
                if self._drained(now):
                    self.stop()
                if woken_by or self.stopping.is_set():
                    break
                if now >= deadline:
                    woken_by = [schedule.due(now)]
                    break
                if beat:
                    with self.pass_context():
                        self.renew_leases()
                        self.exporters.beat()
                    self.beats += 1

    def _stop(self, watch: FileWatch) -> None:
        """The stop order: sides let go (every held open allowed), the watch closes, the
        guards' stop actions run, exporters withdraw what they published, sides release,
        then the last record."""
        for side in self.sides.values():
            side.stop()
        watch.close()
        self._stop_actions()
        self.exporters.stop()  # a stale "ok" label is worse than none; no heartbeat: Unknown
        for side in self.sides.values():
            side.close()
        self.record({"kind": "stop"})
        self.observer.close()  # the .ko descriptors its parse cache keeps
        self.poke.close()
        self.plans_ended.close()

    def _stop_actions(self) -> None:
        """What guards undo when the agent stops (e.g. a hold file), enforce mode only.

        Workers start nothing new; what they finished reaches memory first, so the
        stop actions and the next agent know what was done.
        """
        if not self.workers.close(STOP_WAIT_S):
            log.warning("steps still running at stop: %s", self.workers.in_flight())
        self.pass_runner.absorb_finished()
        if self.cfg.mode != "enforce":
            return
        for plan in self.reconciler.on_stop(self.memory).values():
            for o in self.workers.run_now(plan):
                self.record(action_record(o))

    def _remove_orphaned_temps(self) -> None:
        """What a killed write left behind (``write_atomic``'s temp files) in the agent's own
        directories; ``run`` holds the single-agent lock, so no live writer's file goes."""
        paths = self.cfg.paths
        # Each directory once: the file names that are ours there, or None (all are).
        own: dict[str, set[str] | None] = {paths.state_dir: None, paths.timeline_dir: None}
        writes = [w for side in self.sides.values() for w in side.writes().items()]
        for d, names in [*writes, *self.exporters.writes()]:
            mine = own.get(d, set())
            own[d] = None if mine is None or names is None else mine | set(names)
        for d, only in own.items():
            removed = self.host.remove_orphaned_temps(d, only) if d else []
            if removed:
                log.info("removed what killed writes left in %s: %s", d, removed)
