"""The deadline of the step the calling thread is running (set by the plan worker).

A backend that can stop early reads it: ``ModprobeTools`` gives a subprocess no
more than what is left, so a hung ``modprobe`` is killed when its step times
out. A backend that cannot (libkmod in C) is abandoned by the worker instead.
"""

from __future__ import annotations

import threading
import time

_local = threading.local()


def set_step_deadline(deadline: float | None) -> None:
    """``deadline``: a ``time.monotonic()`` value, or None (no step running)."""
    _local.deadline = deadline


def step_time_left(default: float) -> float:
    """Seconds left before the current step's deadline (``default`` when none is set)."""
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return default
    return max(0.0, min(default, deadline - time.monotonic()))
