"""Wake-ups: inotify, kernel uevents (pyudev), a timer, and pokes.

An event only says "look again": the agent re-reads the whole node on every
pass, so the sources here only need to be prompt, not complete. All sources
feed one ``poll``; whatever arrived while a pass ran is drained at once and
coalesced into the next single pass.

Inotify is a descriptor of the loop's own (ctypes), not watchdog: watchdog
delivers each event through its own threads and Python callbacks, which under
a 20k-event storm kept the loop busy a second after the storm ended.
Directories that do not exist yet are watched from their nearest existing
parent; ``refresh()`` moves a watch down as directories appear. When the
kernel's inotify queue overflows, events were lost: that wakes the loop for a
full pass at once.

``StopOnSignal`` makes SIGTERM stop the daemon within its grace period
whatever the main thread is doing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
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
    """A self-pipe: any thread may ``poke`` the loop awake (workers, ``stop``, tests)."""

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
        """The reasons poked since the last drain. The pipe is read and the reasons taken
        under the lock a poke writes under: a poke between the two had its reason taken
        and its byte left, so the next pass found a wake pending (its decision not fresh:
        the gates it had decided open withdrawn) and the drain of that byte gave no reason
        (no pass followed), until the next event or the resync (found in the simulator,
        whose wake pipe is this one)."""
        with self._lock:
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._r, 4096):
                    pass
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


# inotify(7): what the agent asks for, and what the kernel says besides.
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR = 0x4000, 0x8000, 0x01000000
IN_OPEN, IN_DONT_FOLLOW = 0x20, 0x02000000
IN_ISDIR = 0x40000000
WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
# A file whose openings wake the loop: watched itself (its inode), never through a link.
OPEN_MASK = IN_OPEN | IN_DELETE_SELF | IN_DONT_FOLLOW
_EVENT_WORDS = (
    (IN_CREATE, "created"),
    (IN_DELETE, "deleted"),
    (IN_MOVED_FROM, "moved"),
    (IN_MOVED_TO, "moved"),
    (IN_CLOSE_WRITE, "closed"),
    (IN_MODIFY, "modified"),
    (IN_ATTRIB, "attrib"),
)
INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
INOTIFY_READ = 64 * 1024
DRAIN_MAX_BYTES = 4 * 1024 * 1024  # per drain; the rest keeps the descriptor readable
REASONS_MAX = 16  # descriptions per drain; a storm is one wake-up, not 20k lines
WRITING_MAX = 64  # files created and not yet closed, tracked for ``settle``


def _inotify_libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_init1.restype = ctypes.c_int
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    libc.inotify_add_watch.restype = ctypes.c_int
    libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.inotify_rm_watch.restype = ctypes.c_int
    return libc


@dataclass(frozen=True)
class _Watch:
    """One watched directory: is all of it relevant, or only the names on the way to a target."""

    directory: Path
    everything: bool
    on_the_way: frozenset[bytes]


class FileWatch:
    """Inotify on the given directories, itself a wake source: the loop polls its descriptor.

    The kernel queues events on one descriptor; ``drain`` reads all of them in
    a few large reads and keeps only the relevant ones (a handful of
    descriptions and a count), so a storm of 20k creations is one wake-up and
    one pass, not 20k callbacks on a thread of their own (watchdog, before,
    spent ~60 us of Python per event and delivered the last one a second late).
    ``has_pending`` answers "did anything relevant arrive?" for a pass checking
    that its decision still stands: it reads what is queued and holds the
    relevant part for the next ``drain``.
    """

    def __init__(
        self,
        root: Path,
        targets: Iterable[Path],
        explained: Callable[[Path], bool] | None = None,
        *,
        opens: Mapping[Path, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``explained(path)``: an event on ``path`` cannot change the observation beyond
        what a pass checks again anyway (a marker file's identity, a name nobody reads in a
        markers' directory). It still wakes the loop, but ``has_pending`` does not count
        it: ``touch`` of MOFED's flag is three events, and the last two, arriving while
        the pass woken by the first decides, made its decision stale (a second pass
        before the gate, in one trial in four: issue 39).

        ``opens``: files (absolute path -> the name ``opened_at`` answers to) whose every
        opening wakes the loop and is remembered with ``clock``'s time: an ``IN_OPEN``
        watch on the file's inode, moved to the new inode by ``refresh`` when the file is
        made again; its creation in a watched directory counts as an opening too (an
        ``O_CREAT`` open reports ``IN_CREATE`` there and ``IN_OPEN`` only on the file).
        Each must be in one of ``targets``' directories, so that its creation is seen."""
        self.root = root
        self.targets = [Path(t) for t in targets]
        self.explained = explained
        self._unexplained = False  # since the last drain: a relevant event not explained
        self._libc = _inotify_libc()
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._by_dir: dict[Path, int] = {}
        self._by_wd: dict[int, _Watch] = {}
        self._held: list[str] = []
        self._held_more = 0
        # Files created in a watched directory whose writer has not closed them yet (by
        # watch descriptor and name; bounded): ``settle`` waits for them.
        self._writing: set[tuple[int, bytes]] = set()
        self.clock = clock
        self._opens = dict(opens or {})
        self._open_watches: dict[Path, tuple[int, int]] = {}  # path -> (wd, inode watched)
        self._open_wd: dict[int, Path] = {}
        self._opened: dict[str, float] = {}  # name -> when last seen opened
        self._started = False
        self.refresh()
        self._started = True

    def fileno(self) -> int:
        return self._fd

    def relevant(self, p: Path) -> bool:
        # Something in a target directory, or a directory on the way to one appearing.
        return any(p.parent == t or p == t or p in t.parents for t in self.targets)

    def wanted_dirs(self) -> set[Path]:
        return {nearest_existing(t, self.root) for t in self.targets}

    def _watch_for(self, d: Path) -> _Watch:
        everything = d in self.targets
        names = {
            os.fsencode(t.relative_to(d).parts[0])
            for t in self.targets
            if t != d and d in t.parents
        }
        return _Watch(d, everything, frozenset(names))

    def refresh(self) -> list[Path]:
        """Move the watches to the nearest existing directories; returns those newly watched.

        A directory watched only now may have changed before its watch: its
        name is held as a wake-up, so the loop passes once more and misses nothing.
        """
        wanted = self.wanted_dirs()
        for d in list(self._by_dir):
            if d not in wanted or not d.is_dir():
                self._unwatch(d)
        added: list[Path] = []
        for d in sorted(wanted - set(self._by_dir)):
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(d), WATCH_MASK)
            if wd < 0:  # vanished between the check and the watch
                log.debug("cannot watch %s: %s", d, os.strerror(ctypes.get_errno()))
                continue
            self._by_dir[d] = wd
            self._by_wd[wd] = self._watch_for(d)
            added.append(d)
            if self._started:
                self._hold(f"inotify watching {d}")
        for path in self._opens:
            self._refresh_open_watch(path)
        return added

    def _refresh_open_watch(self, path: Path) -> None:
        """Watch the regular file now at ``path`` for openings (none if absent or odd)."""
        try:
            st = os.lstat(path)
            inode = st.st_ino if stat.S_ISREG(st.st_mode) else None
        except OSError:
            inode = None
        current = self._open_watches.get(path)
        if current is not None and current[1] == inode:
            return
        if current is not None:
            self._drop_open_watch(path)
        if inode is None:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), OPEN_MASK)
        if wd < 0:  # gone between the lstat and the watch: its creation wakes the loop
            return
        self._open_watches[path] = (wd, inode)
        self._open_wd[wd] = path

    def _drop_open_watch(self, path: Path) -> None:
        wd, _ = self._open_watches.pop(path)
        if self._open_wd.pop(wd, None) is not None:
            self._libc.inotify_rm_watch(self._fd, wd)  # EINVAL if the kernel dropped it

    def opened_at(self, name: str) -> float | None:
        """When one of ``opens`` was last seen opened (``clock``'s time), if ever."""
        return self._opened.get(name)

    def _saw_open(self, path: Path, word: str) -> None:
        self._opened[self._opens[path]] = self.clock()
        if self.explained is None or not self.explained(path):
            self._unexplained = True
        if len(self._held) < REASONS_MAX:
            self._held.append(f"inotify {word} {path}")
        else:
            self._held_more += 1

    def _unwatch(self, d: Path) -> None:
        wd = self._by_dir.pop(d)
        if wd in self._by_dir.values():  # the same inode under another name
            return
        self._by_wd.pop(wd, None)
        self._libc.inotify_rm_watch(self._fd, wd)  # EINVAL if the kernel dropped it: fine

    @property
    def watched(self) -> set[Path]:
        return set(self._by_dir)

    def _hold(self, reason: str) -> None:
        self._unexplained = True
        if len(self._held) < REASONS_MAX:
            self._held.append(reason)
        else:
            self._held_more += 1

    def _read_queued(self) -> None:
        """Everything the kernel queued (up to DRAIN_MAX_BYTES), relevant events held."""
        if self._fd < 0:
            return
        total = 0
        while total < DRAIN_MAX_BYTES:
            try:
                buf = os.read(self._fd, INOTIFY_READ)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._hold(f"inotify read failed ({exc.strerror}): looking again")
                return
            if not buf:
                return
            total += len(buf)
            self._take(buf)

    def _take(self, buf: bytes) -> None:
        off = 0
        size = INOTIFY_EVENT.size
        while off + size <= len(buf):
            wd, mask, _cookie, length = INOTIFY_EVENT.unpack_from(buf, off)
            name = buf[off + size : off + size + length].rstrip(b"\0")
            off += size + length
            if mask & IN_Q_OVERFLOW:
                self._hold("inotify queue overflow: events were lost")
                continue
            opened = self._open_wd.get(wd)
            if opened is not None:
                if mask & IN_OPEN:
                    self._saw_open(opened, "opened")
                if mask & (IN_IGNORED | IN_DELETE_SELF):  # the inode went: refresh() again
                    self._open_wd.pop(wd, None)
                    self._open_watches.pop(opened, None)
                continue
            watch = self._by_wd.get(wd)
            if watch is None:
                continue
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                # The watched directory itself went: refresh() watches its parent.
                self._hold(f"inotify gone {watch.directory}")
                continue
            if not (watch.everything or name in watch.on_the_way):
                continue
            if mask & IN_CREATE and not mask & IN_ISDIR:
                if self._opens and (made := watch.directory / os.fsdecode(name)) in self._opens:
                    self._saw_open(made, "created")  # its creator holds it open: no settle
                    continue
                if len(self._writing) < WRITING_MAX:
                    self._writing.add((wd, name))
            elif mask & (IN_CLOSE_WRITE | IN_MOVED_FROM | IN_DELETE) and self._writing:
                self._writing.discard((wd, name))
            # As _hold, inline: under a storm the path and description are made only when
            # needed (once one event is unexplained, the rest need not be asked about).
            path = None
            if not self._unexplained:
                path = watch.directory / os.fsdecode(name)
                if self.explained is None or not self.explained(path):
                    self._unexplained = True
            if len(self._held) < REASONS_MAX:
                word = next((w for bit, w in _EVENT_WORDS if mask & bit), "changed")
                path = path or watch.directory / os.fsdecode(name)
                self._held.append(f"inotify {word} {path}")
            else:
                self._held_more += 1

    @property
    def holds(self) -> bool:
        """Relevant events already read from the descriptor, not yet drained."""
        return bool(self._held or self._held_more)

    def has_pending(self) -> bool:
        """Is a relevant change queued or held that ``explained`` does not cover? (An
        irrelevant one is dropped here; an explained one is held for the next drain.)"""
        self._read_queued()
        return self._unexplained

    def settle(self, within_s: float) -> list[str]:
        """After a wake-up, before the pass observes: wait (at most ``within_s``) until each
        file created since is closed by its writer, and drain what came meanwhile.

        inotify wakes the loop on a writer's first syscall: ``touch`` creates MOFED's
        flag, then sets its times, then closes it; a pass that observed in between saw a
        file that changed right after, and found its decision stale at the gate (a second
        pass before the held load goes on). A writer that keeps its file open costs this
        wait once; a file renamed into place (written elsewhere) costs nothing."""
        end = time.monotonic() + within_s
        while self._writing and self._fd >= 0:
            left = end - time.monotonic()
            if left <= 0 or not readable([self], left):
                break
            self._read_queued()
        self._writing.clear()  # (what was not closed in time: the pass sees it as it is)
        return self.drain()

    def drain(self) -> list[str]:
        self._read_queued()
        self._unexplained = False
        out, self._held = self._held, []
        if self._held_more:
            out.append(f"inotify {self._held_more} more events")
            self._held_more = 0
        return out

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def pending(sources: Sequence[WakeSource]) -> bool:
    """Has anything that wakes the loop arrived? Sources that can tell relevant from
    irrelevant (``has_pending``) say so themselves; the rest count when readable."""
    plain: list[WakeSource] = []
    for s in sources:
        ask = getattr(s, "has_pending", None)
        if ask is None:
            plain.append(s)
        elif ask():
            return True
    return bool(plain) and bool(readable(plain))


# How long a stop waits for the loop to return (the pass in flight, then the stop's own
# steps) before the process exits 143: inside the base DaemonSet's 30 s of grace, with the
# supervisor's 5 s for what is left under it after.
STOP_GRACE_S = 20.0


class StopOnSignal:
    """SIGTERM/SIGINT stop the daemon within ``grace_seconds``, whatever it is doing.

    The signals are blocked in every thread and taken by one thread with
    ``sigwait``, so they are seen at once even while the main thread is inside
    a long C call (a Python handler would wait for it to return). That thread
    asks the loop to stop. The pass in flight is finished, never abandoned
    mid-way (a pass is milliseconds; one slowed by a loaded node ends well
    within the grace), then the loop stops as after any pass, and the process
    exits 0. Only a loop that has not returned within the grace (a pass hung in
    the kernel) makes the process exit there and then with 143: every file the
    agent writes is written atomically and guard memory ahead of actions, so
    this costs at most the pass in flight.

    ``stop`` may return seconds the agent drains first (``Agent.stop_on_signal``: a load
    held with its gate closed): the grace is counted from the drain's end, and a second
    signal meanwhile stops at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(
        self, stop: Callable[[], float | None], grace_seconds: float = STOP_GRACE_S
    ) -> None:
        self.stop = stop
        self.stop_now: Callable[[], object] = stop  # (a second signal; the caller may set it)
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
        drain = self.stop() or 0.0
        if drain > 0:
            again = signal.sigtimedwait(self.SIGNALS, drain)
            if self._done.is_set():
                return
            if again is not None:  # a second signal: stop now
                log.warning("%s again: stopping now", signal.Signals(again.si_signo).name)
                self.stop_now()
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
    """Blocks until any source has something or the timeout passes; returns what woke it:
    nothing when only the timeout passed (a timeout is not a reason for a pass: the loop
    knows whether it was a beat or a pass that came due)."""

    def __init__(self, sources: Sequence[WakeSource]) -> None:
        self.sources = list(sources)

    def wait(self, timeout: float | None) -> list[str]:
        if timeout is not None and timeout < 0:
            timeout = 0
        held = any(getattr(s, "holds", False) for s in self.sources)
        if held:
            timeout = 0  # a source already read what woke it (``has_pending``)
        if not readable(self.sources, timeout) and not held:
            return []  # a timeout: nothing to drain (a lease beat's wake costs no reads)
        reasons: list[str] = []
        # Drain every source, not just the ready ones: one pass covers them all.
        for s in self.sources:
            reasons.extend(s.drain())
        return reasons
