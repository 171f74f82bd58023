"""A toy guard, in a file of its own: what adding a guard takes (docs/design.md).

It watches one marker file, ``etc/toy/bell``. While the bell is there its
verdict is ``ringing`` (not ok, its gate closed) and it asks, once, for one action
of a kind of its own, ``Ring``, carried out by its host side's executor. It
counts the rings it performed in its memory and in a metric family of its
own, and its host side adds a part to ``status.json``. The test that plugs it
in adds one entry to the guard list and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.core.actions import ActionOutcome
from nodeagent.core.guard import GuardDecision, Verdict
from nodeagent.core.needs import Needs
from nodeagent.core.paths import HostPaths
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.core.telemetry import MetricFamily, Sample
from nodeagent.guards.side import GuardSide

BELL = "etc/toy/bell"
RUNG = "etc/toy/rung"


@dataclass(frozen=True)
class ToyPolicy:
    loud: bool = True


def parse_policy(table: Mapping[str, Any], current: ToyPolicy) -> ToyPolicy:
    return ToyPolicy(loud=bool(table.get("loud", current.loud)))


@dataclass(frozen=True)
class Ring:
    """An action no shared executor knows: only the toy's host side carries it out."""

    guard: str
    reason: str
    module: None = None

    def describe(self) -> str:
        return "ring the toy bell"


@dataclass(frozen=True)
class ToyMemory:
    rings: int = 0


class ToyGuard:
    name = "toy"
    gate = True
    verdict_words = ("quiet", "ringing")
    metric_families = (
        MetricFamily("nodeagent_toy_rings_total", "counter", "Rings the toy guard performed"),
    )

    def __init__(self, policy: ToyPolicy, paths: HostPaths) -> None:
        self.policy = policy

    def needs(self) -> Needs:
        return Needs(files=frozenset({BELL}))

    def initial_memory(self) -> ToyMemory:
        return ToyMemory()

    def decide(self, snap: NodeSnapshot, memory: ToyMemory) -> GuardDecision[ToyMemory]:
        if not snap.file(BELL).present:
            return GuardDecision(Verdict(self.name, "quiet", True, ()), (), memory)
        verdict = Verdict(self.name, "ringing", False, ("the toy bell is there",))
        if memory.rings:  # rung already: once is enough
            return GuardDecision(verdict, (), memory)
        return GuardDecision(verdict, (Ring(self.name, "the bell is there"),), memory)  # type: ignore[arg-type]

    def absorb(self, memory: ToyMemory, outcome: ActionOutcome, now: float) -> ToyMemory:
        return ToyMemory(memory.rings + (1 if outcome.ok and outcome.performed else 0))

    def on_stop(self, memory: ToyMemory) -> tuple[Any, ...]:
        return ()

    def memory_to_json(self, memory: ToyMemory) -> dict[str, Any]:
        return {"rings": memory.rings}

    def memory_from_json(self, data: Mapping[str, Any]) -> ToyMemory:
        rings = data.get("rings", 0)
        if not isinstance(rings, int) or isinstance(rings, bool) or rings < 0:
            raise ValueError(f"rings is {rings!r}, not a count")
        return ToyMemory(rings)

    def metric_samples(
        self, verdict: Verdict, outcomes: Sequence[ActionOutcome]
    ) -> Iterable[Sample]:
        return [Sample("nodeagent_toy_rings_total") for o in outcomes if o.ok and o.performed]


class ToySide(GuardSide):
    """Its host side: an executor for ``Ring``, where it writes, and a part of status.json."""

    status_key = "toy"

    def writes(self) -> Mapping[str, Collection[str] | None]:
        return {"etc/toy": None}  # every file there is its own

    def executors(self) -> Sequence[Callable[[Any], Any]]:
        side = self

        class RingExecutor:
            def __init__(self, hands: Any) -> None:
                self.host = hands.host

            def handlers(self) -> Mapping[type, Callable[[Any], None]]:
                return {Ring: self.ring}

            def ring(self, action: Ring) -> None:
                side.rung += 1
                self.host.write_atomic(RUNG, f"{side.rung}\n".encode())

        return (RingExecutor,)

    rung = 0

    def status(self) -> Any:
        return {"rung": self.rung}
