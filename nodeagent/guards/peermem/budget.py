"""The hold's descriptors: the caps on opens held at once, and the budget that fits them
under ``RLIMIT_NOFILE`` (raised to its hard limit) with a reserve for the rest of the
agent."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

from nodeagent.guards.peermem.reports import BURST_QUIET_S
from nodeagent.host.fanotify import READ_EVENTS

# Caps on opens held at once (each keeps an event descriptor in the agent until answered):
# per opener's container, and in all. Constants for now, not policy: a new policy field
# needs docs/configuration.md. 64 is far above a driver container's handful of loads.
HELD_PER_CONTAINER = 64
HELD_TOTAL = 256
# Descriptors kept for the agent's own writes, endpoints' connections and /proc reads, on
# top of what the hold may have at once (held opens and one read's events).
FD_RESERVE = 256


@dataclass(frozen=True)
class DescriptorBudget:
    """The agent's descriptors as the hold planned them at start: ``limit`` (the soft
    ``RLIMIT_NOFILE``, raised to ``hard``), ``reserve`` kept for the rest of the agent,
    and the caps on held opens that fit in what is left with one read's events."""

    limit: int
    hard: int
    reserve: int
    held_total: int
    held_per_container: int
    read_events: int = READ_EVENTS

    def status(self) -> dict[str, int]:
        return {
            "limit": self.limit,
            "hard": self.hard,
            "reserve": self.reserve,
            "held_total": self.held_total,
            "held_per_container": self.held_per_container,
            "per_read": self.read_events,
        }


def descriptor_budget(
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> tuple[DescriptorBudget, list[str]]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and fit the caps on held opens
    in it, keeping ``FD_RESERVE`` for the rest of the agent; (budget, problems)."""
    problems: list[str] = []
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            problems.append(
                f"peermem.hold_loads: cannot raise the descriptor limit from {soft} to {hard}: "
                f"{exc}"
            )
    room = max(0, soft - FD_RESERVE - READ_EVENTS)
    total = min(HELD_TOTAL, room)
    if total < HELD_TOTAL:
        problems.append(
            f"peermem.hold_loads: a descriptor limit of {soft} (hard {hard}) leaves room for "
            f"{total} held opens, not {HELD_TOTAL}; past that, loads go on at once"
        )
    budget = DescriptorBudget(
        limit=soft,
        hard=hard,
        reserve=FD_RESERVE,
        held_total=total,
        held_per_container=min(HELD_PER_CONTAINER, total),
    )
    return budget, problems


def open_descriptors() -> int:
    """How many descriptors this process has open now (-1: unreadable)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


@dataclass(frozen=True)
class Caps:
    """The caps on opens held at once (each keeps a descriptor): past either, an open is
    allowed at once and said, once per burst (a burst ends ``burst_quiet_s`` after its
    last); ``descriptors``: the budget the caps fit in, for status."""

    held_per_container: int = HELD_PER_CONTAINER
    held_total: int = HELD_TOTAL
    burst_quiet_s: float = BURST_QUIET_S
    descriptors: DescriptorBudget | None = None
