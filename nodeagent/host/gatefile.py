"""Gate files: ``<root>/run/nodeagent/<guard>.gate``, the promise ``nodeagent wait`` reads.

A gate file is a **lease**: it says the gate is open until a moment at most
``LEASE_S`` ahead, on the kernel's boot-time clock (``CLOCK_BOOTTIME``: one
clock for every process on the node, never stepped), and the agent's loop
renews it every ``RENEW_S`` while the decision stays open. A loop that is
stuck, stopped or dead stops renewing, and a file the agent can no longer
withdraw (immutable, a read-only or replaced state dir) expires on its own:
no reader sees open longer than ``LEASE_S`` after the agent's last sign of
life. The agent keeps the promise with an order:

1. right after the decision, every closed gate's file is withdrawn, before
   memory, status, timeline or any action;
2. only when the pass's bookkeeping succeeded (status written), nothing
   that wakes the loop arrived after the pass's observation and every marker
   file (MOFED's ready flag, its blacklist) still stats as observed, are the
   open gates' files (re)written, last;
3. a pass that fails in any way, or whose observation an event made stale,
   withdraws every gate file (the next pass, at once, decides again).

The file holds ``{"version", "guard", "confirmed_at" (wall time, for
people), "lease_until" (boot-time seconds), "boot_id", "pid"}``. Readers
trust only what they can check themselves: the lease must be from this boot
(``/proc/sys/kernel/random/boot_id``), not yet expired on their own boot-time
clock, and no longer than ``LEASE_S`` from now; anything else (an older
agent's file without a lease, absurd numbers, a symlink, a directory, a FIFO,
bad JSON) reads as closed, with a reason. The wall clock plays no part, so
stepping it changes nothing.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from nodeagent.errors import NodeagentError
from nodeagent.host.fs import MARKER_MAX, HostRoot, reason
from nodeagent.host.state import dumps, strict_json

LEASE_S = 3.0  # how long an open gate file vouches for the decision without a renewal
RENEW_S = 1.0  # how often the agent's loop renews an open gate's lease
LEASE_SLACK_S = 0.5  # a reader's tolerance for a lease a little longer than LEASE_S
STALE_INTERVALS = 3  # status: a pass older than this many resync intervals is stale
FUTURE_TOLERANCE_S = 5.0  # clocks slewed by NTP; a step back larger than this is noticed
GATE_VERSION = 2
BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class GateReading:
    is_open: bool
    reason: str  # one line: why open (how long the lease holds) or why closed
    confirmed_at: float | None = None


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def lease_clock() -> float:
    """Seconds on the kernel's boot-time clock: shared by every process, never stepped."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_BOOT_ID: list[str] = []  # this boot's id, once read: it cannot change under a process


def boot_id() -> str:
    if _BOOT_ID:
        return _BOOT_ID[0]
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            found = f.read(64).strip()
    except OSError:
        return ""
    if found:
        _BOOT_ID.append(found)
    return found


def stale_reason(confirmed_at: float, resync_seconds: float, now: float) -> str | None:
    """Why a pass confirmed at ``confirmed_at`` (wall time) no longer vouches for anything,
    or None (``status``: is the agent reconciling?)."""
    age = now - confirmed_at
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


def lease_reason(
    lease_until: float, file_boot: str, now_boot: float, my_boot: str
) -> tuple[bool, str]:
    """(open?, why) for a lease, judged on the reader's own clock and boot."""
    if not my_boot or file_boot != my_boot:
        return False, "closed: the lease is from another boot (or the boot id is unreadable)"
    left = lease_until - now_boot
    if left <= 0:
        return False, (
            f"closed: the lease expired {-left:.1f}s ago (the agent has not renewed it: "
            "stopped, stuck, or unable to write its state dir)"
        )
    if left > LEASE_S + LEASE_SLACK_S:
        return False, (
            f"closed: the lease claims {left:.0f}s more, longer than any the agent gives "
            f"({LEASE_S:g}s); not trusted"
        )
    return True, f"open (lease valid {left:.1f}s more)"


class GateFiles:
    def __init__(
        self,
        host: HostRoot,
        state_dir: str,
        clock: Callable[[], float] = lease_clock,
        boot: Callable[[], str] = boot_id,
        before_withdraw: Callable[[str], None] = lambda guard: None,
    ) -> None:
        """``clock``, ``boot``: the boot-time clock and boot id (a test gives its own).
        ``before_withdraw(guard)``: called before that gate's file is removed, on every
        path that removes it (a closed verdict, a stale or failed publish, a beat that no
        longer vouches): what stands between loaders and the kernel (the hold) closes
        first."""
        self.host = host
        self.dir = state_dir
        self.clock = clock
        self.boot = boot
        self.before_withdraw = before_withdraw

    def rel(self, guard: str) -> str:
        return f"{self.dir}/{guard}.gate"

    # -- the agent's side ------------------------------------------------------

    def withdraw(self, guards: Iterable[str]) -> list[str]:
        """Remove these gates' files; returns one line per gate that could not be withdrawn."""
        problems = []
        for guard in guards:
            self.before_withdraw(guard)
            try:
                self.host.remove(self.rel(guard))
            except (OSError, NodeagentError) as exc:
                problems.append(f"cannot withdraw {self.rel(guard)}: {reason(exc)}")
        return problems

    def confirm(
        self,
        guard: str,
        confirmed_at: float,
        still_fresh: Callable[[], bool] | None = None,
    ) -> bool:
        """(Re)write an open gate's file with a new lease. Raises on failure.

        ``still_fresh`` is asked right before the rename: False (the decision went stale
        while the file was written) writes nothing and returns False. The lease is taken
        before the write, so a slow write shortens it, never lengthens it."""
        doc = {
            "version": GATE_VERSION,
            "guard": guard,
            "confirmed_at": confirmed_at,
            "lease_until": self.clock() + LEASE_S,
            "boot_id": self.boot(),
            "pid": os.getpid(),
        }
        # Not fsynced: a lease is void after a reboot (another boot_id), and it is renewed
        # every RENEW_S (an fsync each time was most of a beat's CPU on a disk).
        return self.host.write_atomic(
            self.rel(guard), dumps(doc), commit=still_fresh, durable=False
        )

    def publish(
        self,
        open_gates: Mapping[str, bool],
        confirmed_at: float,
        still_fresh: Callable[[], bool] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Confirm the open gates (closed ones were withdrawn already); fail closed per gate,
        and withdraw a gate whose decision went stale while its file was being written.
        (the gates published, the problems): a gate withdrawn as stale is not published
        though nothing went wrong."""
        published: list[str] = []
        problems: list[str] = []
        for guard, is_open in open_gates.items():
            if not is_open:
                continue
            try:
                if self.confirm(guard, confirmed_at, still_fresh):
                    published.append(guard)
                else:
                    problems.extend(self.withdraw([guard]))
            except (OSError, NodeagentError) as exc:
                problems.append(f"cannot publish {self.rel(guard)}: {reason(exc)}")
                problems.extend(self.withdraw([guard]))
        return published, problems

    # -- readers (wait, status) ----------------------------------------------------

    def read(
        self, guard: str, now_boot: float | None = None, my_boot: str | None = None
    ) -> GateReading:
        """The gate as a reader must take it: open only on a live lease (see the module)."""
        now_boot = self.clock() if now_boot is None else now_boot
        my_boot = self.boot() if my_boot is None else my_boot
        rel = self.rel(guard)
        try:
            raw = self.host.read_bytes(rel, MARKER_MAX)
        except FileNotFoundError:
            return GateReading(False, f"closed: no gate file at {rel}")
        except OSError as exc:
            return GateReading(False, f"closed: {rel} unreadable ({reason(exc)})")
        try:
            doc = strict_json(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("version") != GATE_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {GATE_VERSION}")
            confirmed, until, boot = doc["confirmed_at"], doc["lease_until"], doc["boot_id"]
            if not (_finite(confirmed) and _finite(until) and isinstance(boot, str)):
                raise ValueError("confirmed_at/lease_until/boot_id are not what the agent writes")
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
            return GateReading(False, f"closed: {rel} is not a gate file the agent wrote ({exc})")
        is_open, why = lease_reason(float(until), boot, now_boot, my_boot)
        return GateReading(is_open, why, float(confirmed))


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
