"""Guard plans carried out off the loop: one worker per guard, steps with timeouts.

The loop observes and decides every pass in milliseconds and never waits on a
plan (controller-runtime gives each controller its own workqueue; this is that,
per guard). Every rule about running a plan is here:

- ``submit`` hands a guard's latest decision to its worker. The same steps as
  the plan in hand, or steps all of the running plan's, change nothing: a pass
  that decided from an observation taken while a step was in flight (or before
  the steps already done took effect) must not restart it.
- Other steps (none included) **supersede** the running plan at its next safe
  point: no step is started after that, the step in flight ends on its own.
  The superseded run is handed back with what it did and did not do. An empty
  decision that **lets it finish** (``Plan.lets_finish``: its premise still
  holds) supersedes nothing.
- Steps all of a plan that **ended but whose end no pass has taken** start
  nothing: that pass began before the end, maybe saw the node before the steps
  took effect (a module half-made: a load decided twice). The end wakes a pass.
- An **urgent** plan (a protective action: unloading an idle ``nvidia_peermem``
  when a MOFED restart begins) starts at once on a lane of its own, never
  behind a step in flight.
- Every step has a **timeout**. A step that outlives it is abandoned: its
  thread is left to finish (a libkmod call cannot be interrupted), a backend
  that can stop early is told the deadline (``host/deadline.py``: a
  ``modprobe`` is killed), and it is reported as failed, by name; the worker
  moves on.
- Outcomes go back through ``take_finished``; the loop absorbs them into guard
  memory on a later pass. A worker never writes memory.

``threaded=False`` (the simulator) keeps every rule but runs what was submitted
when ``run_pending`` is called, in the caller's thread (a parallel plan's steps
too, one after another), so virtual time decides the order.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from nodeagent.core.actions import Action, ActionOutcome, Plan
from nodeagent.host.deadline import set_step_deadline

log = logging.getLogger("nodeagent.worker")

Perform = Callable[[Action], ActionOutcome]
# A step's own thread gets this long past its timeout to report (a killed modprobe's
# ETIMEDOUT) before the worker stops waiting for it.
REPORT_GRACE_S = 0.5
DETACH_POLL_S = 0.05  # a running parallel plan looks this often whether it was superseded


class _Threads:
    """Daemon threads kept for reuse: once warm, a step starts without a thread start.

    (A thread start waits for the new thread to run, a GIL hand-off that costs up
    to a switch interval on a busy process. Not concurrent.futures: its threads
    are joined at exit, and an abandoned step may never return.)
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task and not yet claimed

    def run(self, task: Callable[[], None]) -> None:
        with self._lock:
            claimed = self._idle > 0
            self._idle -= claimed
        if not claimed:
            threading.Thread(target=self._loop, name="step", daemon=True).start()
        self._tasks.put(task)

    def _loop(self) -> None:
        while True:
            self._tasks.get()()
            with self._lock:
                self._idle += 1


class StepRunner:
    """One step, bounded by its timeout; abandoned (not awaited) when it outlives it."""

    def __init__(
        self, perform: Perform, timeout_s: Callable[[Action], float], threaded: bool = True
    ) -> None:
        self.perform = perform
        self.timeout_s = timeout_s
        self.threaded = threaded
        self._lock = threading.Lock()
        self._threads = _Threads()
        self.abandoned: list[str] = []  # steps still running after their timeout

    def __call__(self, action: Action) -> ActionOutcome:
        if not self.threaded:
            return _guarded(self.perform, action)
        timeout = self.timeout_s(action)
        box: list[ActionOutcome] = []
        done = threading.Event()

        def body() -> None:
            set_step_deadline(time.monotonic() + timeout)
            try:
                box.append(_guarded(self.perform, action))
            finally:
                set_step_deadline(None)
                done.set()
                with self._lock:
                    if action.describe() in self.abandoned:
                        self.abandoned.remove(action.describe())
                        log.warning("abandoned step ended late: %s", action.describe())

        self._threads.run(body)
        if done.wait(timeout + REPORT_GRACE_S):
            if box:
                return box[0]
            return ActionOutcome(action=action, ok=False, error=f"{action.describe()}: step died")
        with self._lock:
            self.abandoned.append(action.describe())
        return ActionOutcome(
            action=action,
            ok=False,
            errno=errno.ETIMEDOUT,
            error=f"{action.describe()}: timed out after {timeout:g} s; abandoned, "
            "left to finish on its own",
        )


def _guarded(perform: Perform, action: Action) -> ActionOutcome:
    try:
        return perform(action)
    except Exception as exc:  # an executor bug must not kill the worker
        return ActionOutcome(
            action=action, ok=False, error=f"{action.describe()}: {type(exc).__name__}: {exc}"
        )


def execute_plan(
    plan: Plan,
    run_step: Perform,
    stopped: Callable[[], bool] = lambda: False,
    detach: Callable[[Action, Future[ActionOutcome | None]], None] | None = None,
    threads: bool = True,
) -> tuple[list[ActionOutcome], tuple[Action, ...]]:
    """Run ``plan`` by its strategy; (outcomes of the steps that ran, steps never started).

    ``sequence`` stops at the first failure (later steps depend on earlier ones);
    ``parallel`` runs every step, at most ``bound`` at once. Both stop starting
    steps once ``stopped()`` (a newer decision superseded the plan). With ``detach``,
    a superseded parallel plan does not wait for its steps in flight (one VF's hung
    write): each is handed to ``detach`` with its future, and the plan ends at once.
    ``threads=False`` (the simulator) runs a parallel plan's steps one after another
    in the caller's thread, still each regardless of the others' failures: steps in
    threads of their own would touch the simulated node in an order the OS decides.
    """
    steps = plan.steps
    if plan.strategy == "sequence" or plan.bound <= 1 or len(steps) <= 1 or not threads:
        out: list[ActionOutcome] = []
        for i, step in enumerate(steps):
            if stopped():
                return out, steps[i:]
            outcome = run_step(step)
            out.append(outcome)
            if not outcome.ok and plan.strategy == "sequence":
                return out, steps[i + 1 :]
        return out, ()

    def one(step: Action) -> ActionOutcome | None:
        return None if stopped() else run_step(step)

    if detach is None:
        with ThreadPoolExecutor(max_workers=plan.bound, thread_name_prefix="plan") as pool:
            results = list(pool.map(one, steps))
        ran = [o for o in results if o is not None]
        return ran, tuple(s for s, o in zip(steps, results, strict=True) if o is None)

    pool = ThreadPoolExecutor(max_workers=plan.bound, thread_name_prefix="plan")
    futures = [pool.submit(one, s) for s in steps]
    while (running := [f for f in futures if not f.done()]) and not stopped():
        # Only the steps not yet done: a done one would end every wait at once (a spin).
        wait(running, timeout=DETACH_POLL_S, return_when=FIRST_COMPLETED)
    pool.shutdown(wait=False, cancel_futures=True)
    ended: list[ActionOutcome] = []
    not_done: list[Action] = []
    for s, f in zip(steps, futures, strict=True):
        if f.cancelled():
            not_done.append(s)
        elif f.done():
            result = f.result()
            if result is None:
                not_done.append(s)
            else:
                ended.append(result)
        else:
            detach(s, f)  # in flight: its outcome comes back when it ends
    return ended, tuple(not_done)


@dataclass(frozen=True)
class FinishedPlan:
    """A plan handed back to the loop: what it did, what it did not, and why it stopped."""

    plan: Plan
    outcomes: tuple[ActionOutcome, ...]
    not_done: tuple[Action, ...] = ()
    superseded: bool = False  # a newer decision replaced it before it ended


@dataclass(eq=False)  # runs are told apart by identity
class _Run:
    plan: Plan
    decided_at: float | None = None
    superseded: bool = False
    started: set[int] = field(default_factory=set)  # indexes of steps begun
    ended: set[int] = field(default_factory=set)  # ... and of those that returned

    def continues_with(self, steps: tuple[Action, ...]) -> bool:
        """``steps`` is what this run still does: its steps from the one in flight on."""
        # Steps the running plan does or did, and nothing else: a pass that observed
        # while they took effect decides what is left, or some of it again (the storage
        # guard's removal seen mid-way). A sequence stops at its first failure, so each
        # step before the one in flight is done; one it has not reached that the newer
        # decision leaves out (a module now in use) is refused by the kernel then.
        return bool(steps) and set(steps) <= set(self.plan.steps)


class GuardWorker:
    """The worker of one guard: at most one plan at a time, plus urgent ones at once."""

    def __init__(
        self, guard: str, run_step: Perform, on_done: Callable[[str], None], threaded: bool
    ) -> None:
        self.guard = guard
        self.run_step = run_step
        self.on_done = on_done
        self.threaded = threaded
        self._cv = threading.Condition()
        self._wanted: tuple[Action, ...] | None = None  # the latest decision's steps
        self._queued: _Run | None = None  # the next plan, not begun
        self._current: _Run | None = None
        self._urgent: list[_Run] = []
        self._urgent_queued: list[_Run] = []
        self._finished: list[FinishedPlan] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        # Steps of a superseded parallel plan still running (a hung VF write): nothing
        # waits on them; no later plan starts the same step again while one runs.
        self._detached: list[Action] = []

    # -- the loop's side -------------------------------------------------------

    def submit(self, plan: Plan, decided_at: float | None = None) -> None:
        """The guard's decision of this pass (``plan.steps`` empty: nothing to do now)."""
        with self._cv:
            if plan.steps == self._wanted or (plan.steps == () and self._wanted is None):
                return
            if self._current is not None and self._current.continues_with(plan.steps):
                self._wanted = plan.steps
                return
            if plan.lets_finish and (self._current is not None or self._queued is not None):
                return  # nothing new, and what runs still stands
            if self._current is None and self._queued is None and self._ended_with(plan.steps):
                return  # decided before that end was taken (see the rules above)
            self._wanted = plan.steps
            if self._current is not None:
                self._current.superseded = True
            self._queued = None
            if plan.urgent and plan.steps:
                if not any(r.plan.steps == plan.steps for r in self._urgent):
                    run = _Run(plan, decided_at)
                    self._urgent.append(run)
                    self._urgent_queued.append(run)
            elif plan.steps:
                self._queued = _Run(plan, decided_at)
            self._ensure_thread()
            self._cv.notify_all()

    def _ended_with(self, steps: tuple[Action, ...]) -> bool:
        """Under the lock: a plan that did ``steps`` (all of them) ended, not yet taken."""
        return bool(steps) and any(set(steps) <= set(f.plan.steps) for f in self._finished)

    def take_finished(self) -> list[FinishedPlan]:
        with self._cv:
            out, self._finished = self._finished, []
            if self._lanes_idle():
                self._wanted = None  # absorbed: the same decision again is a new attempt
            return out

    def busy(self) -> bool:
        with self._cv:
            return not self._idle() or bool(self._finished)

    def in_flight(self) -> list[str]:
        with self._cv:
            runs = [*self._urgent, *([self._current] if self._current else [])]
            return [
                f"{s.describe()}{' (urgent)' if r.plan.urgent else ''}"
                for r in runs
                for i, s in enumerate(r.plan.steps)
                if i in r.started and i not in r.ended
            ] + [f"{s.describe()} (of a superseded plan)" for s in self._detached]

    def _lanes_idle(self) -> bool:
        """No plan queued or running (a detached step may still run: it holds no lane)."""
        return (
            self._current is None
            and self._queued is None
            and not self._urgent
            and not self._urgent_queued
        )

    def _idle(self) -> bool:
        return self._lanes_idle() and not self._detached

    # -- running ---------------------------------------------------------------

    def _ensure_thread(self) -> None:
        """Both lanes' threads, started with the guard's first plan and kept: the urgent
        lane never pays a thread start when a MOFED restart begins."""
        if self.threaded and self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name=f"worker-{self.guard}", daemon=True
            )
            self._thread.start()
            threading.Thread(
                target=self._urgent_main, name=f"urgent-{self.guard}", daemon=True
            ).start()

    def _main(self) -> None:
        while True:
            with self._cv:
                while self._queued is None and not self._closing:
                    self._cv.wait()
                if self._queued is None:
                    return
                run, self._queued, self._current = self._queued, None, self._queued
                self._skip_detached(run)
            self._execute(run)

    def _skip_detached(self, run: _Run) -> None:
        """Under the lock: a step still running from a superseded plan is not started twice."""
        if self._detached and any(s in self._detached for s in run.plan.steps):
            steps = tuple(s for s in run.plan.steps if s not in self._detached)
            run.plan = replace(run.plan, steps=steps)

    def _detach_step(self, step: Action, future: Future[ActionOutcome | None]) -> None:
        with self._cv:
            self._detached.append(step)
        future.add_done_callback(lambda f: self._late(step, f))

    def _late(self, step: Action, future: Future[ActionOutcome | None]) -> None:
        """A detached step ended: its outcome goes to the loop like any plan's."""
        result = None if future.cancelled() or future.exception() else future.result()
        with self._cv:
            self._detached.remove(step)
            if result is not None:
                plan = Plan(self.guard, (step,), "parallel")
                self._finished.append(FinishedPlan(plan, (result,)))
            self._cv.notify_all()
        self.on_done(self.guard)

    def _urgent_main(self) -> None:
        while True:
            with self._cv:
                while not self._urgent_queued and not self._closing:
                    self._cv.wait()
                if not self._urgent_queued:
                    return
                run = self._urgent_queued.pop(0)
            self._execute(run)

    def run_pending(self) -> None:
        """Stepped mode: run what was submitted, urgent first, in this thread."""
        while True:
            with self._cv:
                if self._urgent_queued:
                    run = self._urgent_queued.pop(0)
                elif self._queued is not None:
                    run, self._queued, self._current = self._queued, None, self._queued
                else:
                    return
            self._execute(run)

    def _detach(self, run: _Run) -> None:
        """Under the lock: ``run`` no longer occupies its lane."""
        if self._current is run:
            self._current = None
        if run in self._urgent:
            self._urgent.remove(run)

    def _execute(self, run: _Run) -> None:
        def stopped() -> bool:
            return run.superseded or self._closing

        def step(action: Action) -> ActionOutcome:
            i = run.plan.steps.index(action)
            with self._cv:
                run.started.add(i)
            try:
                # Its outcome comes back a pass later: it says which pass decided it.
                return replace(self.run_step(action), decided_at=run.decided_at)
            finally:
                with self._cv:
                    run.ended.add(i)

        detach = self._detach_step if self.threaded else None
        outcomes, not_done = execute_plan(run.plan, step, stopped, detach, self.threaded)
        superseded = run.superseded and bool(not_done)
        with self._cv:
            self._detach(run)
            self._finished.append(FinishedPlan(run.plan, tuple(outcomes), not_done, superseded))
            self._cv.notify_all()
        self.on_done(self.guard)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until nothing is queued or running (finished may wait)."""
        with self._cv:
            return self._cv.wait_for(self._idle, max(0.0, timeout))

    def close(self, timeout: float) -> bool:
        """Start nothing new; wait up to ``timeout`` for steps in flight. True: all ended."""
        with self._cv:
            self._closing = True
            self._queued = None
            for run in self._urgent_queued:  # not begun: nothing to wait for
                self._urgent.remove(run)
            self._urgent_queued.clear()
            self._cv.notify_all()
            return self._cv.wait_for(
                lambda: self._current is None and not self._urgent and not self._detached,
                max(0.0, timeout),
            )


class PlanWorkers:
    """Every guard's worker; the loop submits each pass's plans and takes what finished."""

    def __init__(
        self,
        guards: Iterable[str],
        perform: Perform,
        *,
        step_timeout_s: Callable[[Action], float],
        on_done: Callable[[str], None] = lambda _g: None,
        threaded: bool = True,
    ) -> None:
        self.threaded = threaded
        self.steps = StepRunner(perform, step_timeout_s, threaded)
        self.workers = {g: GuardWorker(g, self.steps, on_done, threaded) for g in guards}

    def submit(
        self,
        plans: Mapping[str, Plan],
        *,
        only_urgent: bool = False,
        decided_at: float | None = None,
    ) -> None:
        """This pass's decisions: a guard without a plan decided to do nothing now."""
        for guard, worker in self.workers.items():
            plan = plans.get(guard) or Plan(guard, ())
            if only_urgent and not plan.urgent:
                continue
            worker.submit(plan, decided_at)

    def take_finished(self) -> list[FinishedPlan]:
        return [f for w in self.workers.values() for f in w.take_finished()]

    def run_pending(self) -> None:
        for w in self.workers.values():
            w.run_pending()

    def busy(self) -> bool:
        """Something queued, running, or finished and not yet taken by a pass."""
        return any(w.busy() for w in self.workers.values())

    def in_flight(self) -> dict[str, list[str]]:
        return {g: steps for g, w in self.workers.items() if (steps := w.in_flight())}

    def abandoned(self) -> list[str]:
        with self.steps._lock:
            return list(self.steps.abandoned)

    def run_now(self, plan: Plan) -> list[ActionOutcome]:
        """Run one plan in this thread, its steps still bounded (the stop actions)."""
        outcomes, _ = execute_plan(plan, self.steps, threads=self.threaded)
        return outcomes

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.wait_idle(deadline - time.monotonic()) for w in self.workers.values())

    def close(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(w.close(deadline - time.monotonic()) for w in self.workers.values())
