"""Run every guard over one snapshot; feed action outcomes back to their guards.

Pure, like the guards: the loop (nodeagent/loop/) supplies snapshots and
carries out each guard's plan. The guards come from the one list in
``guards/registry.py``; nothing here knows what a guard is about.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.core import applicability
from nodeagent.core.actions import Action, ActionOutcome, Plan
from nodeagent.core.guard import Guard, Verdict
from nodeagent.core.needs import Needs
from nodeagent.core.snapshot import NodeSnapshot

AgentMemory = Mapping[str, Any]  # guard name -> that guard's memory value


@dataclass(frozen=True)
class Reconciliation:
    verdicts: Mapping[str, Verdict]
    # Guards with something to do this pass (or a plan to let finish), in guard order.
    plans: Mapping[str, Plan]
    memory: AgentMemory
    events: tuple[tuple[str, str], ...]  # (guard, event)
    wake_at: float | None

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(a for plan in self.plans.values() for a in plan.steps)


class Reconciler:
    def __init__(self, guards: Sequence[Guard[Any]]) -> None:
        names = [g.name for g in guards]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate guard names: {names}")
        self.guards = {g.name: g for g in guards}

    @property
    def gates(self) -> tuple[str, ...]:
        """The guards that publish a gate file."""
        return tuple(name for name, g in self.guards.items() if g.gate)

    def needs(self) -> Needs:
        """What the guards need observed; a guard turned off needs nothing."""
        return Needs.union(g.needs() for g in self.guards.values() if applicability.observed(g))

    def initial_memory(self) -> AgentMemory:
        return {name: g.initial_memory() for name, g in self.guards.items()}

    def decide(self, snap: NodeSnapshot, memory: AgentMemory) -> Reconciliation:
        verdicts: dict[str, Verdict] = {}
        plans: dict[str, Plan] = {}
        new_memory: dict[str, Any] = {}
        events: list[tuple[str, str]] = []
        wake: list[float] = []
        for name, guard in self.guards.items():
            mem = memory.get(name)
            if mem is None:
                mem = guard.initial_memory()
            # A guard turned off, or with nothing to guard here, does not decide.
            d = applicability.decision(guard, snap, mem) or guard.decide(snap, mem)
            verdicts[name] = d.verdict
            if d.actions or d.lets_finish:  # an empty plan that lets the running one finish
                plans[name] = d.plan
            new_memory[name] = d.memory
            events.extend((name, e) for e in d.events)
            if d.wake_at is not None:
                wake.append(d.wake_at)
        return Reconciliation(
            verdicts=verdicts,
            plans=plans,
            memory=new_memory,
            events=tuple(events),
            wake_at=min(wake) if wake else None,
        )

    def absorb(
        self, memory: AgentMemory, outcomes: Sequence[ActionOutcome], now: float
    ) -> AgentMemory:
        out = dict(memory)
        for outcome in outcomes:
            guard = self.guards.get(outcome.action.guard)
            if guard is not None:
                out[guard.name] = guard.absorb(out[guard.name], outcome, now)
        return out

    def on_stop(self, memory: AgentMemory) -> dict[str, Plan]:
        plans = {}
        for name, guard in self.guards.items():
            steps = guard.on_stop(memory.get(name, guard.initial_memory()))
            if steps:
                plans[name] = Plan(name, steps)
        return plans

    def memory_to_json(self, memory: AgentMemory) -> dict[str, Any]:
        return {name: g.memory_to_json(memory[name]) for name, g in self.guards.items()}

    def memory_to_save(
        self, memory: AgentMemory, last: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The memory document to write, each changed part read back first with its guard's
        own reader: a part the next start would refuse (and start that guard fresh) is not
        written; ``last`` (what was written before) keeps that guard's part. Returns the
        document and, per guard refused, one line saying why."""
        doc: dict[str, Any] = {}
        problems: dict[str, str] = {}
        for name, g in self.guards.items():
            part = g.memory_to_json(memory[name])
            if last is not None and last.get(name) == part:
                doc[name] = part
                continue
            try:
                g.memory_from_json(json.loads(json.dumps(part, default=str)))
            except Exception as exc:  # any refusal, as memory_from_json handles it on start
                problems[name] = (
                    f"{name} memory not saved: a restart would refuse it ({exc}); "
                    "the last one saved is kept"
                )
                if last is not None and name in last:
                    doc[name] = last[name]
                continue
            doc[name] = part
        return doc, problems

    def memory_from_json(self, data: Mapping[str, Any]) -> tuple[AgentMemory, list[str]]:
        """Memory per guard; a guard whose saved memory is bad starts fresh (reported)."""
        memory: dict[str, Any] = {}
        problems: list[str] = []
        for name, guard in self.guards.items():
            raw = data.get(name)
            if raw is None:
                memory[name] = guard.initial_memory()
                continue
            try:
                if not isinstance(raw, Mapping):
                    raise ValueError(f"{name} memory is not an object")
                memory[name] = guard.memory_from_json(raw)
            except ValueError as exc:
                problems.append(str(exc))
                memory[name] = guard.initial_memory()
            except Exception as exc:  # a parser that missed a shape: still bad memory, not a crash
                problems.append(f"{name} memory is malformed: {type(exc).__name__}: {exc}")
                memory[name] = guard.initial_memory()
        return memory, problems
