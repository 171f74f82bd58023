"""The files node-problem-detector's plugin reads (see core/conditions.py): written here.

Under ``<state dir>/npd/``, each atomically (a reader never sees half a file):
one per guard, rewritten when its verdict, ``ok`` or message changes; the
heartbeat, renewed by the loop every ``RENEW_S`` (with the gate leases) and
removed at a clean stop, so a stopped agent reads as Unknown, never as OK;
an event's file each time one happens. Times are the kernel's boot-time
clock (``/proc/uptime`` in the plugin's container: the same clock, no wall
clock step moves them). A write that fails is a problem named on the pass;
nothing here holds a gate.

No file vouches for what it cannot: a guard's file that cannot be written is
removed (its old verdict is not shown as current; the plugin reads Unknown,
and whatever stood in its place, a symlink or a FIFO, is gone for the next
write); one that can be neither written nor removed withholds the heartbeat
(every condition reads Unknown); each guard's file is written whatever
another's did; and the loop's heartbeat starts only with this run's first
publish (the files a previous run left in the same boot are not made fresh by
a loop whose passes fail).
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
        self._published = False  # no heartbeat before this run's files are written
        self._stale: set[str] = set()  # guards whose old file could be neither written nor removed

    def publish(self, verdicts: Mapping[str, Verdict]) -> str | None:
        """Each guard's condition file, where it changed; then the heartbeat."""
        failed: dict[str, list[str]] = {}  # why -> the files not written for it
        for guard, v in verdicts.items():
            shown = (v.verdict, v.ok, condition_message(v))
            if self._shown.get(guard) == shown and self._intact(guard):
                continue
            try:
                text = condition_text(v, self.clock(), self.boot)
                self.host.write_atomic(f"{self.dir}/{guard}", text.encode())
            except (OSError, NodeagentError) as exc:
                self._shown.pop(guard, None)  # written again, whole, once it can be
                if not self._withdraw(guard):
                    self._stale.add(guard)
                failed.setdefault(reason(exc), []).append(guard)
                continue
            self._shown[guard] = shown
            self._stale.discard(guard)
        self._published = True
        try:
            self._beat()
        except (OSError, NodeagentError) as exc:
            failed.setdefault(reason(exc), []).append("heartbeat")
        if failed:
            why = "; ".join(f"{', '.join(names)}: {r}" for r, names in failed.items())
            return self._say(f"node-problem-detector files not written ({self.dir}: {why})")
        return self._say(None)

    def beat(self) -> str | None:
        """The loop's heartbeat between passes (once this run has published its files)."""
        if not self._published:
            return self._problem
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
        try:
            if self._stale:  # a fresh heartbeat would vouch for their old verdicts
                stale = ", ".join(sorted(self._stale))
                raise NodeagentError(f"withheld: {stale} could be neither written nor removed")
            text = heartbeat_text(self.clock(), self.boot)
            # Not fsynced: stamped with the boot (void after a reboot), renewed every beat.
            self.host.write_atomic(f"{self.dir}/heartbeat", text.encode(), durable=False)
        except (OSError, NodeagentError):
            self._withdraw("heartbeat")  # not renewed: none rather than one going stale
            raise

    def _withdraw(self, name: str) -> bool:
        """Remove a file that could not be written (never followed; a directory stays), so
        the plugin reads Unknown, not the last verdict as if it were current. True when
        no regular file of that name is left."""
        rel = f"{self.dir}/{name}"
        with contextlib.suppress(OSError, NodeagentError):
            self.host.remove(rel)
        return not self.host.file_fact(rel).present

    def _intact(self, guard: str) -> bool:
        return self.host.file_fact(f"{self.dir}/{guard}").present

    def _say(self, problem: str | None) -> str | None:
        if problem != self._problem:
            if problem is not None:
                log.error("%s", problem)
            self._problem = problem
        return problem
