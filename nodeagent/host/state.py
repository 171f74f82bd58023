"""The agent's own state under <root>/run/nodeagent: guard memory, status, gate files.

All written atomically. A corrupt or symlinked state file is moved aside with a
one-line warning and the agent starts from fresh memory: a level-triggered
pass rebuilds everything else from the node itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from nodeagent.core.reconcile import AgentMemory, Reconciler
from nodeagent.host.fs import HostRoot

STATE_VERSION = 1


class StateStore:
    def __init__(self, host: HostRoot, state_dir: str) -> None:
        self.host = host
        self.dir = state_dir
        self.memory_rel = f"{state_dir}/state.json"
        self.status_rel = f"{state_dir}/status.json"

    def gate_rel(self, guard: str) -> str:
        return f"{self.dir}/{guard}.gate"

    def load_memory(
        self, reconciler: Reconciler, *, read_only: bool = False
    ) -> tuple[AgentMemory, list[str]]:
        """The persisted guard memory; a bad file is moved aside (unless ``read_only``)."""
        set_aside = self._describe if read_only else self._set_aside
        fact = self.host.file_fact(self.memory_rel)
        if not fact.present:
            if fact.problem:
                return reconciler.initial_memory(), [set_aside(f"state file {fact.problem}")]
            return reconciler.initial_memory(), []
        try:
            data = json.loads(self.host.read_bytes(self.memory_rel, 1 << 20))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError(f"not a version-{STATE_VERSION} state object")
            guards = data.get("guards")
            if not isinstance(guards, dict):
                raise ValueError("'guards' is not an object")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            return reconciler.initial_memory(), [set_aside(f"state file is corrupt: {exc}")]
        memory, problems = reconciler.memory_from_json(guards)
        return memory, [f"{self.memory_rel}: {p}; that guard starts fresh" for p in problems]

    def _describe(self, why: str) -> str:
        return f"{self.memory_rel}: {why}; using fresh memory"

    def _set_aside(self, why: str) -> str:
        src = self.host.path(self.memory_rel)
        dst = src.with_name(src.name + ".corrupt")
        try:
            os.replace(src, dst)
            where = f"moved to {dst.name}"
        except OSError as exc:
            where = f"could not move it aside: {exc.strerror}"
        return f"{self.memory_rel}: {why}; {where}; starting from fresh memory"

    def save_memory(self, guards: Mapping[str, Any]) -> None:
        """``guards``: the reconciler's ``memory_to_json`` document."""
        doc = {"version": STATE_VERSION, "guards": guards}
        self.host.write_atomic(self.memory_rel, _dumps(doc))

    def publish(self, status: Mapping[str, Any], gates: Mapping[str, bool]) -> None:
        """Write status.json, and a ``<guard>.gate`` file exactly while that gate is open."""
        self.host.write_atomic(self.status_rel, _dumps(status))
        for guard, is_open in gates.items():
            rel = self.gate_rel(guard)
            if is_open:
                if not self.host.file_fact(rel).present:
                    self.host.write_atomic(
                        rel, _dumps({"guard": guard, "since": status.get("time")})
                    )
            else:
                self.host.remove(rel)

    def read_status(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.host.read_bytes(self.status_rel, 1 << 22))
        except FileNotFoundError:
            return None
        return data if isinstance(data, dict) else None


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode()
