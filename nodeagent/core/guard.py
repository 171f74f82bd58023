"""The shape every guard has: ``needs()`` and ``decide(snapshot, memory) -> GuardDecision``.

A guard is pure: it declares what it needs observed, reads a ``NodeSnapshot``
and its own memory (what it saw on earlier passes) and returns a verdict with
reasons, the actions it wants (run as one plan, with a strategy), and its next
memory. Outcomes of actions come back through ``absorb``. Memory round-trips
through JSON so the agent can persist it and a restarted agent resumes where
the last one stopped. How to add one: docs/design.md, "Adding a guard".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from nodeagent.core.actions import Action, ActionOutcome, Plan, Strategy
from nodeagent.core.needs import Needs
from nodeagent.core.snapshot import EMPTY, NodeSnapshot

M = TypeVar("M")


@dataclass(frozen=True)
class Verdict:
    guard: str
    verdict: str  # the guard's own word: open/closed, clear/blocking/in-use/holding ...
    ok: bool  # nothing for an operator to act on (``nodeagent check`` exits 0 when all are)
    reasons: tuple[str, ...]  # one per failed condition, in operator words
    evidence: Mapping[str, Any] = field(default_factory=lambda: EMPTY)
    # What a verdict rests on that an operator should know, reasons or none (an open gate
    # that could not check something, and why that is expected there).
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        doc = {
            "verdict": self.verdict,
            "ok": self.ok,
            "reasons": list(self.reasons),
            "evidence": self.evidence,
        }
        if self.notes:
            doc["notes"] = list(self.notes)
        return doc


@dataclass(frozen=True)
class GuardDecision(Generic[M]):
    verdict: Verdict
    actions: tuple[Action, ...]
    memory: M
    events: tuple[str, ...] = ()  # transitions worth a timeline line ("MOFED restart began: ...")
    wake_at: float | None = None  # the guard wants another pass by then (e.g. a retry backoff)
    strategy: Strategy = "sequence"
    bound: int = 1
    urgent: bool = False  # a protective plan: see Plan.urgent
    lets_finish: bool = False  # no actions, and the running plan stands: see Plan.lets_finish

    @property
    def plan(self) -> Plan:
        return Plan(
            self.verdict.guard,
            self.actions,
            self.strategy,
            self.bound,
            self.urgent,
            self.lets_finish and not self.actions,
        )


class Guard(Protocol[M]):
    name: str
    gate: bool  # publishes run/nodeagent/<name>.gate while ok (others only report)

    def needs(self) -> Needs: ...

    def initial_memory(self) -> M: ...

    def decide(self, snap: NodeSnapshot, memory: M) -> GuardDecision[M]: ...

    def absorb(self, memory: M, outcome: ActionOutcome, now: float) -> M: ...

    def on_stop(self, memory: M) -> tuple[Action, ...]:
        """What to undo when the agent stops (enforce mode), e.g. remove a hold file."""
        ...

    def memory_to_json(self, memory: M) -> dict[str, Any]: ...

    def memory_from_json(self, data: Mapping[str, Any]) -> M:
        """Raise ValueError with a one-line reason when ``data`` is not valid memory.

        Strict: every field of its JSON type, read with a field table (core/fields.py),
        counts and times checked with ``is_count``/``is_finite`` (a string "nan" or 1.5
        failures is bad memory).
        """
        ...


def is_count(x: object) -> bool:
    """A JSON count in saved memory: an int (not a bool), 0 <= x < 2**63."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


def is_finite(x: object) -> bool:
    """A JSON time in saved memory: an int or float (not a bool), finite."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Exponential backoff after ``failures`` consecutive failures (>= 1)."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * (2 ** min(failures - 1, 30))))
