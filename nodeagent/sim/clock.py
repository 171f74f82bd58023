"""The simulator's virtual clock: one deterministic scheduler for every actor.

Time is seed-time: seconds of the incident as the seeds tell it. It only moves
when the scheduler pops the next event, so a run is a pure function of its
inputs (scenario, seed) however fast or slow the machine is.

Three kinds of participants:

- **callbacks** (``call_at``/``call_later``) run in the scheduler's thread:
  what the simulated kernel does asynchronously (a VF netdev appearing);
- **actors** (``spawn``) are threads that run one at a time: the scheduler
  resumes one, and waits until it sleeps again (``sleep`` parks it until its
  wake-up time) or ends. They read like the shell scripts they model;
- **foreign threads** (the real agent) run on their own; when one of them calls
  ``sleep`` (e.g. inside a simulated ``insmod`` while the module initialises)
  it blocks until virtual time reaches its wake-up.

``world`` is held while a callback or an actor step runs, and the simulator's
agent harness holds it for each whole reconcile pass, so a pass never sees a
half-made step. After every step the scheduler calls ``settle`` (set by the
harness) to wait until the agent has reacted. ``pace`` (optional) sleeps wall
time so seed-time passes at ``--speed``.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Actor", "Scheduler", "SimError", "SimStopped"]


class SimError(Exception):
    """The simulation itself went wrong (an actor crashed with a bug, a wait never settled)."""


class SimStopped(BaseException):
    """Raised inside an actor's ``sleep`` when the run ends: unwinds the actor (like SystemExit)."""


@dataclass(order=True)
class _Event:
    t: float
    prio: int
    seq: int
    kind: str = field(compare=False)  # "call" | "resume" | "release"
    fn: Callable[[], None] | None = field(compare=False, default=None)
    actor: Actor | None = field(compare=False, default=None)
    epoch: int = field(compare=False, default=0)
    token: _Release | None = field(compare=False, default=None)


class _Release:
    """Hand-over with a foreign thread blocked in ``sleep``: go, then wait until it resumed."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.resumed = threading.Event()


class _WorldLock:
    """A lock that knows its owner thread (so a sleeping pass can let go of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> _WorldLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        self._lock.acquire()
        self.owner = threading.get_ident()

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def held_by_me(self) -> bool:
        return self.owner == threading.get_ident()


class Actor:
    """A thread that runs only when the scheduler resumes it."""

    def __init__(self, sched: Scheduler, name: str, body: Callable[[], object]) -> None:
        self.sched = sched
        self.name = name
        self.body = body
        self.done = False
        self.error: BaseException | None = None
        self.epoch = 0
        self._pending: BaseException | None = None
        self._go = threading.Semaphore(0)
        self._parked = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)

    def _main(self) -> None:
        self._go.acquire()
        try:
            self._raise_pending()
            self.body()
        except SimStopped:
            pass
        except BaseException as exc:  # a bug in an actor: reported by the scheduler
            self.error = exc
        finally:
            self.done = True
            self._parked.release()

    def _raise_pending(self) -> None:
        if self._pending is not None:
            exc, self._pending = self._pending, None
            raise exc

    def _sleep(self, seconds: float) -> None:
        self.epoch += 1
        if seconds != float("inf"):
            self.sched._push(self.sched.now() + seconds, 0, "resume", actor=self, epoch=self.epoch)
        self._parked.release()
        self._go.acquire()
        self._raise_pending()

    def interrupt(self, exc: BaseException) -> None:
        """Raise ``exc`` in the actor at its current ``sleep`` (now, in virtual time)."""
        if self.done:
            return
        self._pending = exc
        self.epoch += 1
        self.sched._push(self.sched.now(), 0, "resume", actor=self, epoch=self.epoch)


class Scheduler:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self._qlock = threading.Lock()
        self.world = _WorldLock()
        self.settle: Callable[[], None] = lambda: None
        self.pace: Callable[[float], None] | None = None
        self._actors: dict[int, Actor] = {}
        self._loop_thread: int | None = None
        self._closing = False
        self._blocked_foreign = 0
        self._blocked_lock = threading.Lock()

    # -- time -----------------------------------------------------------------

    def now(self) -> float:
        return self._now

    @property
    def foreign_blocked(self) -> int:
        """How many foreign threads are blocked in ``sleep`` right now."""
        return self._blocked_foreign

    # -- scheduling -----------------------------------------------------------

    def _push(self, t: float, prio: int, kind: str, **kw: object) -> None:
        with self._qlock:
            heapq.heappush(self._heap, _Event(t, prio, next(self._seq), kind, **kw))  # type: ignore[arg-type]

    def call_at(self, t: float, fn: Callable[[], None], *, late: bool = False) -> None:
        """Run ``fn`` in the scheduler thread at virtual time ``t`` (``late``: after the
        other events due at the same time)."""
        self._push(max(t, self._now), 1 if late else 0, "call", fn=fn)

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.call_at(self._now + max(0.0, delay), fn)

    def spawn(self, name: str, body: Callable[[], object], delay: float = 0.0) -> Actor:
        actor = Actor(self, name, body)
        actor.thread.start()
        self._actors[actor.thread.ident or 0] = actor
        actor.epoch += 1
        self._push(self._now + delay, 0, "resume", actor=actor, epoch=actor.epoch)
        return actor

    def wake(self, actor: Actor) -> None:
        """Resume ``actor`` now from the ``sleep`` it is in (what it waited on happened)."""
        if actor.done:
            return
        actor.epoch += 1
        self._push(self._now, 0, "resume", actor=actor, epoch=actor.epoch)

    def current_actor(self) -> Actor | None:
        return self._actors.get(threading.get_ident())

    def sleep(self, seconds: float) -> None:
        """Block the calling participant for ``seconds`` of virtual time."""
        if seconds < 0:
            seconds = 0.0
        actor = self.current_actor()
        if actor is not None:
            if self._closing:
                raise SimStopped
            actor._sleep(seconds)
            return
        me = threading.get_ident()
        if me == self._loop_thread:
            raise SimError("a scheduler callback may not sleep")
        if self._closing or seconds == 0:
            return
        if self._loop_thread is None:
            # No loop running (a test driving the kernel directly): run it inline.
            self.run(self._now + seconds)
            return
        token = _Release()
        held = self.world.held_by_me()
        with self._blocked_lock:
            self._blocked_foreign += 1
        self._push(self._now + seconds, 0, "release", token=token)
        if held:
            self.world.release()
        try:
            token.go.wait()
        finally:
            if held:
                self.world.acquire()
            with self._blocked_lock:
                self._blocked_foreign -= 1
            token.resumed.set()

    # -- the loop -------------------------------------------------------------

    def _peek(self) -> float | None:
        with self._qlock:
            return self._heap[0].t if self._heap else None

    def run(self, until: float) -> None:
        """Process every event due up to ``until``; virtual time ends at ``until``."""
        if self._loop_thread is not None and self._loop_thread != threading.get_ident():
            raise SimError("the scheduler is already running in another thread")
        outer = self._loop_thread is None
        self._loop_thread = threading.get_ident()
        try:
            while True:
                t = self._peek()
                if t is None or t > until:
                    break
                if self.pace is not None:
                    self.pace(t)
                with self._qlock:
                    ev = heapq.heappop(self._heap)
                self._dispatch(ev)
                self.settle()
            with self.world:
                self._now = max(self._now, until)
        finally:
            if outer:
                self._loop_thread = None

    def _dispatch(self, ev: _Event) -> None:
        if ev.kind == "release":
            with self.world:
                self._now = max(self._now, ev.t)
            assert ev.token is not None
            ev.token.go.set()
            # Deterministic hand-over: the released thread holds the world again
            # (or runs on) before anything else happens.
            if not ev.token.resumed.wait(30.0):
                raise SimError("a thread released from sleep did not resume within 30 s")
            return
        with self.world:
            self._now = max(self._now, ev.t)
            if ev.kind == "call":
                assert ev.fn is not None
                ev.fn()
            elif ev.kind == "resume":
                actor = ev.actor
                assert actor is not None
                if actor.done or ev.epoch != actor.epoch:
                    return  # superseded by an interrupt, or already finished
                actor._go.release()
                actor._parked.acquire()
                if actor.error is not None:
                    err, actor.error = actor.error, None
                    raise SimError(f"actor {actor.name} failed: {err!r}") from err

    def close(self, timeout: float = 5.0) -> None:
        """End the run: unwind every actor, release every blocked foreign thread."""
        self._closing = True
        with self._qlock:
            pending, self._heap = self._heap, []
        for ev in pending:
            if ev.kind == "release" and ev.token is not None:
                ev.token.go.set()
        deadline = time.monotonic() + timeout
        for actor in list(self._actors.values()):
            if not actor.done:
                actor._pending = SimStopped()
                actor._go.release()
            actor.thread.join(max(0.0, deadline - time.monotonic()))
