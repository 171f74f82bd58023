"""The files node-problem-detector's plugin reads (see core/conditions.py): written here.

Under ``<state dir>/npd/``, each atomically (a reader never sees half a file):
one per guard, rewritten when its verdict, ``ok`` or message changes; the
heartbeat, renewed by the loop every ``RENEW_S`` (with the gate leases) and
removed at a clean stop, so a stopped agent reads as Unknown, never as OK;
an event's file each time one happens. Times are the kernel's boot-time
clock (``/proc/uptime`` in the plugin's container: the same clock, no wall
clock step moves them). A write that fails is a problem named on the pass;
nothing here holds a gate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from nodeagent.core.conditions import (
    condition_message,
    condition_text,
    event_of,
    event_text,
    heartbeat_text,
)
from nodeagent.core.guard import Verdict
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot, reason
from nodeagent.host.gatefile import boot_id, lease_clock

log = logging.getLogger("nodeagent.npd")


class NpdFiles:
    def __init__(
        self,
        host: HostRoot,
        state_dir: str,
        clock: Callable[[], float] = lease_clock,
        boot: Callable[[], str] = boot_id,
    ) -> None:
        self.host = host
        self.dir = f"{state_dir}/npd"
        self.clock = clock
        self.boot = boot()
        self._shown: dict[str, tuple[str, bool, str]] = {}  # guard -> what its file says
        self._problem: str | None = None

    def publish(self, verdicts: Mapping[str, Verdict]) -> str | None:
        """Each guard's condition file, where it changed; then the heartbeat."""
        try:
            for guard, v in verdicts.items():
                shown = (v.verdict, v.ok, condition_message(v))
                if self._shown.get(guard) == shown and self._intact(guard):
                    continue
                text = condition_text(v, self.clock(), self.boot)
                self.host.write_atomic(f"{self.dir}/{guard}", text.encode())
                self._shown[guard] = shown
            self._beat()
        except (OSError, NodeagentError) as exc:
            self._shown.clear()  # written again, whole, once it can be
            return self._say(f"node-problem-detector files not written ({self.dir}: {reason(exc)})")
        return self._say(None)

    def beat(self) -> str | None:
        """The loop's heartbeat between passes."""
        try:
            self._beat()
        except (OSError, NodeagentError) as exc:
            return self._say(f"node-problem-detector heartbeat not written: {reason(exc)}")
        return self._say(None)

    def on_record(self, rec: Mapping[str, Any]) -> None:
        """A record that is a Warning event: its file, with when it happened."""
        event = event_of(rec)
        if event is None:
            return
        kind, message = event
        try:
            text = event_text(self.clock(), self.boot, message)
            self.host.write_atomic(f"{self.dir}/events/{kind}", text.encode())
        except (OSError, NodeagentError) as exc:
            self._say(f"node-problem-detector event {kind} not written: {reason(exc)}")

    def stop(self) -> None:
        """At a clean stop: no heartbeat, so the plugin says Unknown, not a stale OK."""
        with contextlib.suppress(OSError, NodeagentError):
            self.host.remove(f"{self.dir}/heartbeat")

    def _beat(self) -> None:
        text = heartbeat_text(self.clock(), self.boot)
        self.host.write_atomic(f"{self.dir}/heartbeat", text.encode())

    def _intact(self, guard: str) -> bool:
        return self.host.file_fact(f"{self.dir}/{guard}").present

    def _say(self, problem: str | None) -> str | None:
        if problem != self._problem:
            if problem is not None:
                log.error("%s", problem)
            self._problem = problem
        return problem
