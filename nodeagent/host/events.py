"""Wake-ups: inotify (watchdog), kernel uevents (pyudev), a timer, and pokes.

An event only says "look again": the agent re-reads the whole node on every
pass, so the sources here only need to be prompt, not complete. All sources
feed one ``select``; whatever arrived while a pass ran is drained at once and
coalesced into the next single pass.

Directories that do not exist yet are watched from their nearest existing
parent (watchdog raises on a missing directory); ``refresh()`` moves a watch
down as directories appear. When the kernel's inotify queue overflows, events
were lost: that wakes the loop for a full pass at once (watchdog itself only
rebuilds recursive watches and drops the overflow for ours).

``StopOnSignal`` makes SIGTERM stop the daemon within its grace period
whatever the main thread is doing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
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
        self._watch_overflow()
        self.refresh()

    def _watch_overflow(self) -> None:
        """Wake the loop when the kernel drops inotify events (IN_Q_OVERFLOW).

        watchdog hands an overflow to the callbacks registered on its inotify
        descriptor; its own watch groups act on it only when recursive. Ours is
        registered on the root with IN_MASK_ADD, so it never narrows the mask of
        a watch watchdog already has there.
        """
        from watchdog.observers.inotify_c import InotifyConstants

        inotify_fd = getattr(self._observer, "_inotify_fd", None)
        if inotify_fd is None:  # a watchdog without a shared inotify descriptor
            log.warning("inotify overflow is not observable; the periodic resync covers it")
            return
        mask = InotifyConstants.IN_DELETE_SELF | InotifyConstants.IN_MASK_ADD
        try:
            inotify_fd.add_callback(
                os.fsencode(self.root), mask, _OverflowAlarm(self.poke), "nodeagent-overflow"
            )
        except OSError as exc:
            log.warning("cannot watch for inotify overflow (%s); the resync covers it", exc)

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


class _OverflowAlarm:
    """A watchdog WatchCallback that only cares about a queue overflow."""

    def __init__(self, poke: Poke) -> None:
        self.poke = poke

    def on_event(self, event: Any) -> None:
        pass

    def on_watch_deleted(self, wd: Any) -> None:
        pass

    def on_queue_overflow(self) -> None:
        self.poke.poke("inotify queue overflow: events were lost")


class StopOnSignal:
    """SIGTERM/SIGINT stop the daemon within ``grace_seconds``, whatever it is doing.

    The signals are blocked in every thread and taken by one thread with
    ``sigwait``, so they are seen at once even while the main thread is inside
    a long C call (a Python handler would wait for it to return). That thread
    asks the loop to stop; if the loop has not returned within the grace
    period (a pass stuck in a read or a module load), the process exits there
    and then with 143: every file the agent writes is written atomically and
    guard memory ahead of actions, so this costs at most the pass in flight.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop: Callable[[], None], grace_seconds: float = 1.5) -> None:
        self.stop = stop
        self.grace = grace_seconds
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_mask: set[int | signal.Signals] | None = None

    def __enter__(self) -> StopOnSignal:
        # Before any other thread starts: threads inherit the mask.
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self._thread = threading.Thread(target=self._wait, name="nodeagent-signals", daemon=True)
        self._thread.start()
        return self

    def _wait(self) -> None:
        sig = signal.sigwait(self.SIGNALS)
        if self._done.is_set():
            return  # woken by __exit__
        log.info("%s: stopping", signal.Signals(sig).name)
        self.stop()
        if not self._done.wait(self.grace):
            log.error(
                "%s: the pass in flight did not finish within %.1fs; exiting now",
                signal.Signals(sig).name,
                self.grace,
            )
            logging.shutdown()
            os._exit(128 + sig)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None and self._thread.is_alive() and self._thread.ident:
            with contextlib.suppress(OSError, ProcessLookupError):
                signal.pthread_kill(self._thread.ident, signal.SIGTERM)
            self._thread.join(1.0)
        if self._old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)


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


def readable(sources: Sequence[WakeSource], timeout: float | None = 0) -> list[int]:
    """The descriptors of ``sources`` with something to read, waiting up to ``timeout``.

    poll, not select: select refuses descriptors numbered past 1023, which a
    long-lived process (or a test run) can reach.
    """
    poller = select.poll()
    for s in sources:
        poller.register(s.fileno(), select.POLLIN)
    try:
        events = poller.poll(None if timeout is None else timeout * 1000)
    except InterruptedError:
        return []
    # A closed pipe or socket reads as ready (POLLHUP/POLLERR/POLLNVAL): look again.
    return [fd for fd, _ in events]


class Waker:
    """Blocks until any source has something or the timeout passes; returns what woke it."""

    def __init__(self, sources: Sequence[WakeSource]) -> None:
        self.sources = list(sources)

    def wait(self, timeout: float | None) -> list[str]:
        if timeout is not None and timeout < 0:
            timeout = 0
        ready = readable(self.sources, timeout)
        reasons: list[str] = []
        # Drain every source, not just the ready ones: one pass covers them all.
        for s in self.sources:
            reasons.extend(s.drain())
        if not ready and not reasons:
            return ["resync"]
        return reasons
