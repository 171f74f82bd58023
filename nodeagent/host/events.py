"""Wake-ups: inotify (watchdog), kernel uevents (pyudev), a timer, and pokes.

An event only says "look again": the agent re-reads the whole node on every
pass, so the sources here only need to be prompt, not complete. All sources
feed one ``select``; whatever arrived while a pass ran is drained at once and
coalesced into the next single pass.

Directories that do not exist yet are watched from their nearest existing
parent (watchdog raises on a missing directory); ``refresh()`` moves a watch
down as directories appear.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("nodeagent.events")

UEVENT_SUBSYSTEMS = ("module", "net", "pci")


class WakeSource(Protocol):
    def fileno(self) -> int: ...

    def drain(self) -> list[str]:
        """Consume what is pending; return short descriptions (for the record)."""
        ...


class Poke:
    """A self-pipe: any thread may ``poke`` the loop awake (watchdog callbacks, SIGTERM)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Re-entrant: a signal handler on the main thread may poke while drain() holds it.
        self._lock = threading.RLock()
        self._pending: list[str] = []

    def fileno(self) -> int:
        return self._r

    def poke(self, why: str) -> None:
        with self._lock:
            if self._w < 0:  # closed: a late stop() must not write to a reused fd number
                return
            if len(self._pending) < 256:
                self._pending.append(why)
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._w, b"\0")

    def drain(self) -> list[str]:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._r, 4096):
                pass
        with self._lock:
            out, self._pending = self._pending, []
            self._taken(out)
        return out

    def _taken(self, out: list[str]) -> None:
        """Called under the lock with what a drain took (for subclasses that count)."""

    def close(self) -> None:
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def nearest_existing(path: Path, root: Path) -> Path:
    """The deepest existing directory on the way from ``root`` to ``path``."""
    cur = path
    while cur != root and not cur.is_dir():
        if cur.parent == cur:
            break
        cur = cur.parent
    return cur if cur.is_dir() else root


class FileWatch:
    """Inotify (watchdog) on the given directories: any change in them wakes the loop."""

    def __init__(self, root: Path, targets: Iterable[Path], poke: Poke) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers.inotify import InotifyObserver

        self.root = root
        self.targets = [Path(t) for t in targets]
        self.poke = poke
        self._observer = InotifyObserver(timeout=0.2)
        self._watches: dict[Path, Any] = {}
        outer = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                paths = [event.src_path, getattr(event, "dest_path", "")]
                if any(p and outer.relevant(Path(os.fsdecode(p))) for p in paths):
                    outer.poke.poke(f"inotify {event.event_type} {os.fsdecode(event.src_path)}")

        self._handler = Handler()
        self._observer.start()
        self.refresh()

    def relevant(self, p: Path) -> bool:
        # Something in a target directory, or a directory on the way to one appearing.
        return any(p.parent == t or p == t or p in t.parents for t in self.targets)

    def wanted_dirs(self) -> set[Path]:
        return {nearest_existing(t, self.root) for t in self.targets}

    def refresh(self) -> None:
        wanted = self.wanted_dirs()
        for d in list(self._watches):
            if d not in wanted or not d.is_dir():
                with contextlib.suppress(Exception):
                    self._observer.unschedule(self._watches.pop(d))
        for d in wanted - set(self._watches):
            try:
                self._watches[d] = self._observer.schedule(self._handler, str(d), recursive=False)
            except OSError as exc:  # vanished between the check and the watch
                log.debug("cannot watch %s: %s", d, exc)

    @property
    def watched(self) -> set[Path]:
        return set(self._watches)

    def close(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=1.0)


class UeventSource:
    """Kernel uevents (NETLINK_KOBJECT_UEVENT) through pyudev, ``source='kernel'``.

    There is no udevd in a pod, so ``source='udev'`` would receive nothing.
    """

    def __init__(self, subsystems: Sequence[str] = UEVENT_SUBSYSTEMS) -> None:
        import pyudev

        self.subsystems = set(subsystems)
        self._monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        # Large enough for a burst of 100+ VF uevents during sriov_numvfs writes.
        with contextlib.suppress(Exception):
            self._monitor.set_receive_buffer_size(4 * 1024 * 1024)
        self._monitor.start()

    def fileno(self) -> int:
        return int(self._monitor.fileno())

    def drain(self) -> list[str]:
        out: list[str] = []
        for _ in range(10_000):
            device = self._monitor.poll(timeout=0)
            if device is None:
                break
            if device.subsystem in self.subsystems:
                out.append(f"uevent {device.action} {device.subsystem} {device.sys_name}")
        return out


class Waker:
    """Blocks until any source has something or the timeout passes; returns what woke it."""

    def __init__(self, sources: Sequence[WakeSource]) -> None:
        self.sources = list(sources)

    def wait(self, timeout: float | None) -> list[str]:
        if timeout is not None and timeout < 0:
            timeout = 0
        try:
            ready, _, _ = select.select(self.sources, [], [], timeout)
        except InterruptedError:
            ready = []
        reasons: list[str] = []
        # Drain every source, not just the ready ones: one pass covers them all.
        for s in self.sources:
            reasons.extend(s.drain())
        if not ready and not reasons:
            return ["resync"]
        return reasons
