"""What the hold tells: one held open once it ended (``HoldReport``), and a burst of one
kind of trouble gathered into one notice (an overflow, opens past a cap, an error it
survived: one notice per burst, never one per event)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HoldReport:
    """One held open, once it ended: who, which file, how long, how it ended."""

    pid: int
    opener: str
    path: str
    seconds: float
    ended: str  # "gate opened" | "budget expired" | "responder stopped" | "opener gone"


# A burst of one kind of trouble (an overflow, ...) ends after this long without another:
# one notice per burst, with its count, never one per event.
BURST_QUIET_S = 2.0

OVERFLOW_MEANING = (
    "the kernel's fanotify queue overflowed: it dropped permission events and allowed "
    "those opens unanswered, so a held-class open (a load of nvidia-peermem.ko or of an "
    "inbox RDMA module) may have gone through"
)


@dataclass
class Burst:
    """Occurrences of one kind gathered until ``BURST_QUIET_S`` passes without another."""

    began: float
    last: float
    kind: str = ""  # the notice's record kind
    count: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
