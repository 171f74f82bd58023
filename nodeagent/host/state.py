"""The agent's own state under <root>/run/nodeagent: guard memory and status.

All written atomically, never through a symlink. Saved memory is parsed
strictly: JSON with finite numbers only, a version-1 object, each guard's
fields type-checked by that guard. A bad file is moved aside as
``state.json.bad-<time>`` (once: the next load finds no bad file), reported
as one line, and the guard(s) whose memory was bad start fresh; a
level-triggered pass rebuilds everything else from the node itself.

The gate files live in ``gatefile.py``; the agent's lock in ``agentlock.py``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.core.reconcile import AgentMemory, Reconciler
from nodeagent.core.snapshot import FileId
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import STATE_MAX, STATUS_MAX, HostRoot

STATE_VERSION = 1


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise ValueError(f"{text} is not a finite number")
    return value


def strict_json(raw: bytes) -> Any:
    """JSON with finite numbers only (no NaN, Infinity, 1e999). Raises ValueError."""
    return json.loads(
        raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float
    )


class StateStore:
    def __init__(
        self, host: HostRoot, state_dir: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.host = host
        self.dir = state_dir
        self.clock = clock
        self.memory_rel = f"{state_dir}/state.json"
        self.status_rel = f"{state_dir}/status.json"
        self._written: FileId | None = None  # identity of the last memory file written

    def load_memory(
        self, reconciler: Reconciler, *, read_only: bool = False
    ) -> tuple[AgentMemory, list[str]]:
        """The persisted guard memory; a bad file is moved aside (unless ``read_only``).

        Returns the memory (fresh for any guard whose saved memory was bad)
        and one line per problem.
        """
        fact = self.host.file_fact(self.memory_rel)
        if not fact.present:
            if fact.problem:
                return reconciler.initial_memory(), [
                    self._report(f"state file {fact.problem}", read_only)
                ]
            return reconciler.initial_memory(), []
        try:
            data = strict_json(self.host.read_bytes(self.memory_rel, STATE_MAX))
            version = data.get("version") if isinstance(data, dict) else None
            if type(version) is int and version > STATE_VERSION:
                # A downgrade: the newer agent's memory is kept aside (an upgrade back finds
                # it there), not read as this version's.
                problem = self._report(
                    f"state file was written by a newer nodeagent (state version {version}; "
                    f"this one reads version {STATE_VERSION}: a downgrade)",
                    read_only,
                )
                return reconciler.initial_memory(), [problem]
            if not isinstance(data, dict) or version != STATE_VERSION:
                raise ValueError(f"not a version-{STATE_VERSION} state object")
            guards = data.get("guards")
            if not isinstance(guards, dict):
                raise ValueError("'guards' is not an object")
        except FileNotFoundError:
            return reconciler.initial_memory(), []
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            problem = self._report(f"state file is corrupt: {why}", read_only)
            return reconciler.initial_memory(), [problem]
        memory, problems = reconciler.memory_from_json(guards)
        if not problems:
            return memory, []
        where = self._report("; ".join(problems), read_only, fresh="that guard starts fresh")
        return memory, [where]

    def _report(self, why: str, read_only: bool, fresh: str = "starting from fresh memory") -> str:
        if read_only:
            return f"{self.memory_rel}: {why}; {fresh}"
        return f"{self.memory_rel}: {why}; {self._set_aside()}; {fresh}"

    def _set_aside(self) -> str:
        """Move the bad file to ``state.json.bad-<UTC time>`` so it is reported once, not lost."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        dst = f"{self.memory_rel.rpartition('/')[2]}.bad-{stamp}"
        try:
            self.host.set_aside(self.memory_rel, dst)
        except (OSError, NodeagentError) as exc:
            return f"could not move it aside: {getattr(exc, 'strerror', None) or exc}"
        return f"moved to {dst}"

    def save_memory(self, guards: Mapping[str, Any]) -> None:
        """``guards``: the reconciler's ``memory_to_json`` document."""
        doc = {"version": STATE_VERSION, "guards": guards}
        self._written = None
        self.host.write_atomic(self.memory_rel, dumps(doc))
        self._written = self.host.file_fact(self.memory_rel).ident

    def memory_intact(self) -> bool:
        """The file this store last wrote is still there, untouched (one stat).

        Lets the agent skip rewriting unchanged memory without trusting a file
        that was since removed or replaced (then it is written again).
        """
        written = self._written
        return written is not None and self.host.file_fact(self.memory_rel).ident == written

    def write_status(self, status: Mapping[str, Any]) -> None:
        self.host.write_atomic(self.status_rel, dumps(status))

    def read_status(self) -> Any:
        """The status document as parsed (any JSON shape), or None when there is none.

        Raises OSError or ValueError (one line) when it cannot be read or parsed.
        """
        try:
            raw = self.host.read_bytes(self.status_rel, STATUS_MAX)
        except FileNotFoundError:
            return None
        return strict_json(raw)


def dumps(doc: Any) -> bytes:
    """One top-level key per line, each value compact: readable with ``cat`` and ``grep``,
    and written by the C encoder (``indent`` selects the pure-Python one, ten times
    slower; status is rewritten at every pass, between the ready flag and the gate)."""
    if not isinstance(doc, dict) or not doc:
        return (json.dumps(doc, sort_keys=True, default=str) + "\n").encode()
    enc = json.JSONEncoder(sort_keys=True, default=str).encode
    lines = ",\n".join(f" {enc(str(k))}: {enc(doc[k])}" for k in sorted(doc, key=str))
    return ("{\n" + lines + "\n}\n").encode()
