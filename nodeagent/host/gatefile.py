"""Gate files: ``<root>/run/nodeagent/<guard>.gate``, the promise ``nodeagent wait`` reads.

A gate file exists only while the last completed pass decided that gate open
*and* that pass is recent. The agent keeps the promise with an order:

1. right after the decision, every closed gate's file is withdrawn, before
   memory, status, timeline or any action;
2. only when the pass's bookkeeping succeeded (status written), nothing
   that wakes the loop arrived after the pass's observation and every marker
   file (MOFED's ready flag, its blacklist) still stats as observed, are the
   open gates' files (re)written, last, carrying the time of the confirming
   pass;
3. a pass that fails in any way, or whose observation an event made stale,
   withdraws every gate file (the next pass, at once, decides again).

The file holds ``{"guard", "confirmed_at", "resync_seconds", "pid"}``. A dead
agent cannot withdraw anything, so readers (``wait``, ``status``) treat a
gate confirmed more than ``STALE_INTERVALS`` resync intervals ago as closed,
and say since when the agent has not reconciled; one confirmed in the future
(the clock stepped back) is closed too, until the next pass confirms it again.
Anything else at that path (a symlink, a directory, a FIFO, bad JSON) reads as
closed, with a reason.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from nodeagent.errors import NodeagentError
from nodeagent.host.fs import MARKER_MAX, HostRoot
from nodeagent.host.state import dumps, strict_json

STALE_INTERVALS = 3
FUTURE_TOLERANCE_S = 5.0  # clocks slewed by NTP; a step back larger than this is noticed
GATE_VERSION = 1


@dataclass(frozen=True)
class GateReading:
    is_open: bool
    reason: str  # one line: why open (how recent) or why closed
    confirmed_at: float | None = None


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def stale_reason(confirmed_at: float, resync_seconds: float, now: float) -> str | None:
    """Why a pass confirmed at ``confirmed_at`` no longer vouches for anything, or None."""
    age = now - confirmed_at
    # A pass confirmed in the future vouches for nothing: the clock moved back (or
    # the file was not the agent's), and its age would stay negative for as long.
    if age < -max(FUTURE_TOLERANCE_S, resync_seconds):
        return (
            f"confirmed at {when(confirmed_at)}, {-age:.0f}s in the future "
            "(the clock moved back?); the next pass confirms it again"
        )
    if age > STALE_INTERVALS * resync_seconds:
        return (
            f"agent not reconciling since {when(confirmed_at)} ({age:.0f}s ago; "
            f"more than {STALE_INTERVALS} resync intervals of {resync_seconds:g}s)"
        )
    return None


class GateFiles:
    def __init__(self, host: HostRoot, state_dir: str) -> None:
        self.host = host
        self.dir = state_dir

    def rel(self, guard: str) -> str:
        return f"{self.dir}/{guard}.gate"

    # -- the agent's side ------------------------------------------------------

    def withdraw(self, guards: Iterable[str]) -> list[str]:
        """Remove these gates' files; returns one line per gate that could not be withdrawn."""
        problems = []
        for guard in guards:
            try:
                self.host.remove(self.rel(guard))
            except (OSError, NodeagentError) as exc:
                problems.append(f"cannot withdraw {self.rel(guard)}: {_why(exc)}")
        return problems

    def confirm(
        self,
        guard: str,
        confirmed_at: float,
        resync_seconds: float,
        still_fresh: Callable[[], bool] | None = None,
    ) -> bool:
        """(Re)write an open gate's file for the pass that confirmed it. Raises on failure.

        ``still_fresh`` is asked right before the rename: False (the decision went stale
        while the file was written) writes nothing and returns False."""
        doc = {
            "version": GATE_VERSION,
            "guard": guard,
            "confirmed_at": confirmed_at,
            "resync_seconds": resync_seconds,
            "pid": os.getpid(),
        }
        return self.host.write_atomic(self.rel(guard), dumps(doc), commit=still_fresh)

    def publish(
        self,
        open_gates: Mapping[str, bool],
        confirmed_at: float,
        resync_seconds: float,
        still_fresh: Callable[[], bool] | None = None,
    ) -> list[str]:
        """Confirm the open gates (closed ones were withdrawn already); fail closed per gate,
        and withdraw a gate whose decision went stale while its file was being written."""
        problems: list[str] = []
        for guard, is_open in open_gates.items():
            if not is_open:
                continue
            try:
                if not self.confirm(guard, confirmed_at, resync_seconds, still_fresh):
                    problems.extend(self.withdraw([guard]))
            except (OSError, NodeagentError) as exc:
                problems.append(f"cannot publish {self.rel(guard)}: {_why(exc)}")
                problems.extend(self.withdraw([guard]))
        return problems

    # -- readers (wait, status) ----------------------------------------------------

    def read(self, guard: str, now: float) -> GateReading:
        rel = self.rel(guard)
        try:
            raw = self.host.read_bytes(rel, MARKER_MAX)
        except FileNotFoundError:
            return GateReading(False, f"closed: no gate file at {rel}")
        except OSError as exc:
            return GateReading(False, f"closed: {rel} unreadable ({_why(exc)})")
        try:
            doc = strict_json(raw)
            confirmed = doc["confirmed_at"]
            resync = doc["resync_seconds"]
            if not all(_finite(x) for x in (confirmed, resync)) or resync <= 0:
                raise ValueError("confirmed_at/resync_seconds are not finite positive numbers")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
            return GateReading(False, f"closed: {rel} is not a gate file the agent wrote ({exc})")
        stale = stale_reason(float(confirmed), float(resync), now)
        if stale is not None:
            return GateReading(False, f"closed: {stale}", float(confirmed))
        return GateReading(
            True, f"open (confirmed {max(0.0, now - confirmed):.0f}s ago)", float(confirmed)
        )


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
