"""The shape every guard has: ``decide(snapshot, memory) -> GuardDecision``.

A guard is pure: it reads a ``NodeSnapshot`` and its own memory (what it saw
on earlier passes) and returns a verdict with reasons, the actions it wants,
and its next memory. Outcomes of actions come back through ``absorb``. Memory
round-trips through JSON so the agent can persist it and a restarted agent
resumes where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from nodeagent.core.actions import Action, ActionOutcome
from nodeagent.core.snapshot import EMPTY, NodeSnapshot

M = TypeVar("M")

VerdictName = Literal["open", "closed"]


@dataclass(frozen=True)
class Verdict:
    guard: str
    verdict: VerdictName
    reasons: tuple[str, ...]  # one per failed condition, in operator words
    evidence: Mapping[str, Any] = field(default_factory=lambda: EMPTY)

    @property
    def is_open(self) -> bool:
        return self.verdict == "open"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": list(self.reasons), "evidence": self.evidence}


@dataclass(frozen=True)
class GuardDecision(Generic[M]):
    verdict: Verdict
    actions: tuple[Action, ...]
    memory: M
    events: tuple[str, ...] = ()  # transitions worth a timeline line ("MOFED restart began: ...")
    wake_at: float | None = None  # the guard wants another pass by then (e.g. a retry backoff)


class Guard(Protocol[M]):
    name: str

    def initial_memory(self) -> M: ...

    def decide(self, snap: NodeSnapshot, memory: M) -> GuardDecision[M]: ...

    def absorb(self, memory: M, outcome: ActionOutcome, now: float) -> M: ...

    def memory_to_json(self, memory: M) -> dict[str, Any]: ...

    def memory_from_json(self, data: Mapping[str, Any]) -> M:
        """Raise ValueError with a one-line reason when ``data`` is not valid memory."""
        ...


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Exponential backoff after ``failures`` consecutive failures (>= 1)."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * (2 ** min(failures - 1, 30))))
