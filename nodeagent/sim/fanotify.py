"""The fanotify permission contract, as the simulated kernel keeps it.

What the real kernel does (``../shared/research/fanotify-hold.md``), and so
what this does:

- a group marks a *filesystem* (``FAN_MARK_FILESYSTEM``): a superblock of the
  simulated kernel (``SimKernel.superblocks``): the host's root filesystem, or
  the overlay a container runtime mounts for each start of a container, so a
  second start is a new superblock, unmarked;
- each open on a marked superblock is one event, and the opener waits (in
  virtual time) until every group marking it answers; an answer of deny fails
  the open with ``EPERM``;
- a group that is closed (its listener died) allows everything still waiting;
- a superblock that goes (the container's overlay unmounted) takes its marks
  with it.

``SimFanotify`` is an ``EventSource`` with the shipped group's marking API
(``HoldGroup``), so the agent's own ``Responder`` and ``RootScanner`` run
against it unchanged. Its events carry made-up descriptor numbers; the file's
path is ``path_of(event)``, as ``/proc/self/fd/<fd>`` gives it on a real node.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nodeagent.host.events import Poke
from nodeagent.host.fanotify import FAN_OPEN_PERM, OpenedRoot, PermEvent
from nodeagent.sim.clock import Actor, Scheduler

__all__ = ["PendingOpen", "SimFanotify"]

_FDS = itertools.count(10_000)  # the events' descriptor numbers: never a real descriptor


@dataclass
class PendingOpen:
    """One open waiting for a group's answer."""

    path: str  # as the host sees it, e.g. /run/nvidia/driver/lib/modules/...
    pid: int
    actor: Actor | None
    answer: bool | None = None


class MarkedKernel(Protocol):
    """What a group needs of the simulated kernel (``SimKernel``, which makes the groups:
    named here, not imported, so the two modules do not import each other)."""

    @property
    def sched(self) -> Scheduler: ...

    @property
    def superblocks(self) -> Mapping[str, int]: ...

    @property
    def fanotify_groups(self) -> list[Any]: ...

    def superblock_at(self, path: str) -> int | None: ...

    def fs_type_at(self, path: str) -> int | None: ...


class SimFanotify:
    def __init__(self, kernel: MarkedKernel) -> None:
        self.kernel = kernel
        self.marks: set[int] = set()
        self.closed = False
        self._queue: list[PermEvent] = []
        self._waiting: dict[int, PendingOpen] = {}
        self._pipe = Poke()  # readable while events are queued (a threaded responder polls it)
        self.events = 0
        self.unlimited_queue = True  # the simulator's queue never overflows
        self.queue_problem: str | None = None

    # -- the group's API (HoldGroup) ---------------------------------------------

    def fileno(self) -> int:
        return self._pipe.fileno()

    def mark_filesystem(self, path: str) -> None:
        sb = self.kernel.superblock_at(path)
        if sb is None:
            raise OSError(errno.ENOENT, f"fanotify_mark {path}: No such file or directory")
        self.marks.add(sb)

    def unmark_filesystem(self, path: str) -> None:
        sb = self.kernel.superblock_at(path)
        self.marks.discard(sb if sb is not None else -1)

    def open_root(self, path: str) -> OpenedRoot | None:
        """As the kernel's group does it: one resolution of ``path``, marked as resolved."""
        sb = self.kernel.superblock_at(path)
        if sb is None:
            return None

        def mark() -> None:
            self.marks.add(sb)

        return OpenedRoot(
            dev=sb,
            fs_type=self.kernel.fs_type_at(path),
            mark=mark,
            unmark=lambda: self.marks.discard(sb),
            close=lambda: None,
        )

    def marked_devices(self) -> set[int]:
        return {sb for sb in self.marks if sb in self.kernel.superblocks.values()}

    def read(self) -> list[PermEvent]:
        self._pipe.drain()
        out, self._queue = self._queue, []
        return out

    def respond(self, event: PermEvent, allow: bool) -> None:
        pending = self._waiting.pop(event.fd, None)
        if pending is not None:
            self._answer(pending, allow)

    def close(self) -> None:
        """The listener is gone: the kernel allows every open still waiting."""
        if self.closed:
            return
        self.closed = True
        self._queue = []
        waiting, self._waiting = self._waiting, {}
        for pending in waiting.values():
            self._answer(pending, True)
        self.kernel.fanotify_groups.remove(self)
        self._pipe.close()

    # -- the kernel's side ----------------------------------------------------------

    @property
    def unread(self) -> int:
        """Events queued that the listener has not read yet."""
        return len(self._queue)

    def path_of(self, event: PermEvent) -> str:
        pending = self._waiting.get(event.fd)
        return pending.path if pending is not None else "?"

    def deliver(self, path: str, pid: int, actor: Actor | None) -> PendingOpen:
        pending = PendingOpen(path, pid, actor)
        fd = next(_FDS)
        self._waiting[fd] = pending
        self._queue.append(PermEvent(fd, pid, FAN_OPEN_PERM))
        self.events += 1
        self._pipe.poke("open")
        return pending

    def drop_superblock(self, sb: int) -> None:
        self.marks.discard(sb)

    def _answer(self, pending: PendingOpen, allow: bool) -> None:
        pending.answer = allow
        if pending.actor is not None:
            self.kernel.sched.wake(pending.actor)
