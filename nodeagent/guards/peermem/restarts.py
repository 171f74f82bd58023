"""A dead responder replaced: how many times in a window before the hold stays off, and a
new one started off the loop thread (``Replacement``), adopted by a later pass."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodeagent.guards.peermem.process import ResponderProcess
    from nodeagent.guards.peermem.start import HoldGroup, HoldHost, HoldResponder


class ResponderState(enum.Enum):
    """Where the hold's responder is (``PeermemHold.phase``); its value opens the status
    phrase (``state``), which says why where there is a why."""

    NOT_STARTED = "not started"
    STARTING = "starting"  # off the loop thread; a later pass adopts it
    RUNNING = "running"
    STOPPED = "stopped"  # it no longer answers (a pass replaces it)
    RETRYING = "retrying"  # a start failed: tried again with backoff
    OFF = "off"  # off after RESTARTS_MAX restarts in the window, until the agent restarts


RESTARTS_MAX = 5  # new responders after a death, within the window; then the hold stays off
RESTART_WINDOW_S = 600.0
# How long stop waits for a new responder still starting to be killed and closed (its
# process is killed at once: this is its reaping and its descriptors closing).
CANCEL_TIMEOUT_S = 5.0

# start_hold's answer: (responder, marked, problems).
Started = tuple["HoldResponder | None", list[str], list[str]]


class Replacement:
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
