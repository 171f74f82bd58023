"""Waiting in tests: on a condition, with a deadline generous enough for a busy machine.

A test waits for what it needs (a file written, a count reached, a thread
entered), never for a fixed time. The deadline is a hang detector: long enough
that load never crosses it (``scripts/flakes.sh`` runs the suite with two busy
processes per core), short enough that a real hang fails in under a minute
instead of stalling the run. Timing figures belong in ``bench/``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# What a test waits for something that takes milliseconds on a quiet machine.
WAIT = 30.0
POLL = 0.01


def until(pred: Callable[[], T], what: str, timeout: float = WAIT) -> T:
    """Poll ``pred`` until it is truthy and return its value; fail naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < end, f"{what} (waited {timeout:g} s)"
        time.sleep(POLL)


class SpyLock:
    """A lock, telling when ``who`` found it held (or took it): to put another thread's
    call at an exact point of a locked section (a wake pipe's drain)."""

    def __init__(self, inner: Any, who: threading.Thread, told: threading.Event) -> None:
        self.inner, self.who, self.told = inner, who, told

    def acquire(self) -> bool:
        if threading.current_thread() is self.who:
            if self.inner.acquire(blocking=False):
                return True
            self.told.set()  # it waits for the drain
        return bool(self.inner.acquire())

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> SpyLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def poke_mid_drain(pipe: Any, poke: Callable[[], None], monkeypatch: Any) -> list[str]:
    """``pipe.drain()`` with ``poke`` run by another thread at exactly the point between
    the drain's read of the pipe (found empty) and its take of the reasons, or blocked
    there on the pipe's lock; what the drain took."""
    import os

    told = threading.Event()  # the poker found the lock held, or poked
    poker = threading.Thread(target=lambda: (poke(), told.set()))
    pipe._lock = SpyLock(pipe._lock, poker, told)
    real_read = os.read

    def read(fd: int, n: int) -> bytes:
        try:
            return real_read(fd, n)
        except BlockingIOError:  # the drain read the pipe empty: the poke comes now
            if fd == pipe.fileno() and poker.ident is None:
                poker.start()
                told.wait()
            raise

    monkeypatch.setattr(os, "read", read)
    try:
        taken: list[str] = pipe.drain()
    finally:
        monkeypatch.setattr(os, "read", real_read)
    poker.join()
    return taken
