"""Waiting in tests: on a condition, with a deadline generous enough for a busy machine.

A test waits for what it needs (a file written, a count reached, a thread
entered), never for a fixed time. The deadline is a hang detector: long enough
that load never crosses it (``scripts/flakes.sh`` runs the suite with two busy
processes per core), short enough that a real hang fails in under a minute
instead of stalling the run. Timing figures belong in ``bench/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
