"""What the hold tells: one held open once it ended (``HoldReport``), and a burst of one
kind of trouble gathered into one notice (an overflow, opens past a cap, an error it
survived: one notice per burst, never one per event)."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HoldReport:
    """One held open, once it ended: who, which file, how long, how it ended."""

    pid: int
    opener: str
    path: str
    seconds: float
    # "gate opened" | "rebuild" | "budget expired" | "responder stopped" | "opener gone"
    ended: str
    # The held file (st_dev, st_ino, size, mtime_ns), where the responder read it: its
    # verdict's reason is the agent's (``heldfiles.py``).
    file: tuple[int, int, int, int] | None = None

    @classmethod
    def from_message(
        cls, msg: dict[str, Any], file: tuple[int, int, int, int] | None
    ) -> HoldReport:
        """As the responder apart sent it (KeyError, TypeError, ValueError if malformed)."""
        pid, opener, path = int(msg["pid"]), str(msg["opener"]), str(msg["path"])
        return cls(pid, opener, path, float(msg["seconds"]), str(msg["ended"]), file)


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

    def add(self, now: float, detail: dict[str, Any]) -> None:
        """One more occurrence: numbers are added up over the burst, flags or-ed."""
        self.last = now
        self.count += 1
        for k, v in detail.items():
            if isinstance(v, bool):
                self.detail[k] = self.detail.get(k, False) or v
            else:
                self.detail[k] = self.detail.get(k, 0) + v

    def notice(self, held_per_container: int, held_total: int) -> dict[str, Any]:
        """Its timeline record, once it is over (the caps: the responder's)."""
        out: dict[str, Any] = {"kind": self.kind, "count": self.count}
        out["seconds"] = self.last - self.began
        out.update(self.detail)
        out["meaning"] = burst_meaning(self, held_per_container, held_total)
        return out


# After an EMFILE/ENFILE the responder waits this long (or for a wake-up) before reading
# the group again: each failed read costs the kernel one event (it denies it).
FAULT_BACKOFF_S = 0.1


def fault_name(exc: BaseException) -> str:
    """A bounded word for an error: ``EMFILE``, ``ENFILE``, ``OSError`` or the class name."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return errno.errorcode[exc.errno]
    return type(exc).__name__


def burst_meaning(b: Burst, held_per_container: int, held_total: int) -> str:
    """What a burst's notice says it means (the caps: the responder's)."""
    if b.kind == "hold-overflow":
        return OVERFLOW_MEANING + (
            " while the gate was closed"
            if b.detail.get("gate_closed")
            else "; the gate was open at each overflow, so none would have been held"
        )
    if b.kind == "hold-over-cap":
        return (
            f"module loaders' opens past the hold's caps ({held_per_container} held "
            f"per container, {held_total} in all) were allowed at once, gate "
            "closed: a flood of loads; each held open keeps a descriptor of the agent's"
        )
    return "the responder survived an error and went on" + (
        f" (out of descriptors: reads waited {FAULT_BACKOFF_S:g} s; the kernel "
        "denies an open it cannot give a descriptor for)"
        if b.detail.get("fault") in ("EMFILE", "ENFILE")
        else "; an event it was answering was allowed"
    )
