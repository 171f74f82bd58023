"""fanotify permission events through ctypes (pyfanotify refuses permission events).

One group, ``FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK | FAN_UNLIMITED_QUEUE``, marked with
``FAN_MARK_FILESYSTEM`` + ``FAN_OPEN_PERM``: every ``open()`` on a marked
filesystem waits in the kernel until the group answers ``FAN_ALLOW`` or
``FAN_DENY``, or the group's descriptor is closed (every pending event is then
allowed). Facts and kernel lines: ``../shared/research/fanotify-hold.md``.

The queue is unlimited: with a bounded queue (``max_queued_events``, 16384 by
default) an overflow makes the kernel drop a permission event and *allow* that
open unanswered, so a held-class open could go through with the gate closed.
It needs ``CAP_SYS_ADMIN`` at ``fanotify_init``, as the content class does; a
kernel that refuses it alone gets a group with a bounded queue, said in
``queue_problem`` (the hold is weaker, not off: see ``FanotifyGroup``).

Rules kept here: the metadata version is checked; events are walked by
``event_len``; every event's descriptor is closed once answered; an event
without a descriptor (``FAN_NOFD``: the kernel could not open the file) needs
no answer, the kernel denied it already. The group's descriptor is close-on-exec,
so no child inherits it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from nodeagent.core.hold import MODULE_HEAD_BYTES, could_be_module

FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_CONTENT = 0x00000004
FAN_UNLIMITED_QUEUE = 0x00000010
FAN_MARK_ADD = 0x00000001
FAN_MARK_REMOVE = 0x00000002
FAN_MARK_IGNORED_MASK = 0x00000020
FAN_MARK_EVICTABLE = 0x00000200  # 5.19: the kernel may drop the mark with the inode
FAN_MARK_FILESYSTEM = 0x00000100
FAN_OPEN_PERM = 0x00010000
FAN_Q_OVERFLOW = 0x00004000
FAN_ALLOW = 0x01
FAN_DENY = 0x02
FAN_NOFD = -1
AT_FDCWD = -100

METADATA = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
RESPONSE = struct.Struct("=iI")  # fd, response
METADATA_VERSION = 3
# Events per read: each comes with a descriptor of the agent's until it is answered, so a
# read is kept small (a content-class event without info records is 24 bytes).
READ_EVENTS = 128
READ_SIZE = READ_EVENTS * METADATA.size


@dataclass(frozen=True)
class OpenedRoot:
    """A root resolved once: its filesystem's device and type, and how to mark and unmark
    that very filesystem. ``close`` when done (it holds a descriptor, never a mount)."""

    dev: int
    fs_type: int | None
    mark: Callable[[], None]
    unmark: Callable[[], None]
    close: Callable[[], None]


def fstatfs_type(libc: Any, fd: int) -> int | None:
    """``f_type`` of the filesystem ``fd`` is on (``fstatfs``; works on ``O_PATH``), through
    the group's C library (``_libc``)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs: {os.strerror(err)}")
    return int(ctypes.c_long.from_buffer(buf).value)  # f_type comes first


class PermEvent(NamedTuple):
    """One permission event: the opened file's descriptor (ours to close) and the opener.
    A tuple: one is made for every event, and a frozen dataclass costs twice as much."""

    fd: int  # FAN_NOFD when the kernel could not give one
    pid: int  # the opener, in the listener's pid namespace (0: not visible from here)
    mask: int

    @property
    def overflow(self) -> bool:
        return bool(self.mask & FAN_Q_OVERFLOW)


class EventSource(Protocol):
    """Where a responder's events come from: the kernel's fanotify group in production,
    the simulated kernel in the simulator."""

    def fileno(self) -> int: ...

    def read(self) -> list[PermEvent]: ...

    def respond(self, event: PermEvent, allow: bool) -> None: ...

    def close(self) -> None: ...


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
    libc.fanotify_init.restype = ctypes.c_int
    libc.fanotify_mark.argtypes = [
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_char_p,
    ]
    libc.fanotify_mark.restype = ctypes.c_int
    libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fstatfs.restype = ctypes.c_int
    return libc


def parse_events(buf: bytes) -> tuple[list[PermEvent], list[str]]:
    """Events from one read, walked by ``event_len``; (events, problems).

    A record of another metadata version, or one whose length does not fit,
    ends the walk with a problem (its descriptor, if any, is closed).
    """
    events: list[PermEvent] = []
    problems: list[str] = []
    off = 0
    while off + METADATA.size <= len(buf):
        event_len, vers, _res, _mlen, mask, fd, pid = METADATA.unpack_from(buf, off)
        if vers != METADATA_VERSION:
            problems.append(f"fanotify metadata version {vers}, expected {METADATA_VERSION}")
            if fd >= 0:
                events.append(PermEvent(fd, pid, mask))  # answered allow by the caller
            break
        if event_len < METADATA.size or off + event_len > len(buf):
            problems.append(f"fanotify event of length {event_len} at offset {off} is malformed")
            break
        events.append(PermEvent(fd, pid, mask))
        off += event_len
    return events, problems


def parse_marked_devices(fdinfo: str) -> set[int]:
    """The ``sdev`` of each filesystem mark in a fanotify fdinfo text, as ``st_dev``.

    The kernel prints its own ``dev_t`` (major << 20 | minor) in hex; ``stat`` gives
    the encoding ``os.makedev`` makes, so convert."""
    devs: set[int] = set()
    for m in re.finditer(r"^fanotify sdev:([0-9a-f]+) ", fdinfo, re.MULTILINE):
        kdev = int(m.group(1), 16)
        devs.add(os.makedev(kdev >> 20, kdev & 0xFFFFF))
    return devs


class FanotifyGroup:
    """A content-class fanotify group with an unlimited queue; raises OSError (with errno)
    when the kernel refuses the group.

    If the kernel refuses only ``FAN_UNLIMITED_QUEUE``, the group is made without it and
    ``queue_problem`` says so in one line: a bounded queue still holds every open until
    it overflows (and an overflow is counted and said), whereas no group would let every
    load through, always. ``libc``: a test's stand-in for the C library."""

    def __init__(self, libc: Any = None) -> None:
        self._libc = libc if libc is not None else _libc()
        flags = FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK
        event_flags = os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC
        self.unlimited_queue = True
        self.queue_problem: str | None = None
        fd = self._libc.fanotify_init(flags | FAN_UNLIMITED_QUEUE, event_flags)
        if fd < 0:
            err = ctypes.get_errno()
            fd = self._libc.fanotify_init(flags, event_flags)
            if fd >= 0:
                self.unlimited_queue = False
                self.queue_problem = (
                    f"peermem.hold_loads: the kernel refused FAN_UNLIMITED_QUEUE "
                    f"({os.strerror(err)}); holding with a bounded queue: if it overflows, "
                    "the kernel allows the opens it drops, held loads included"
                )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        self.fd: int = fd
        self.problems: list[str] = []  # malformed records seen by read()
        # Marks and close come from different threads (the scanner, the responder's
        # supervisor): a mark never lands on a descriptor number closed and reused.
        self._lock = threading.Lock()

    @classmethod
    def adopt(cls, fd: int, libc: Any = None) -> FanotifyGroup:
        """A group made by another process and handed over (the responder apart)."""
        group = cls.__new__(cls)
        group._libc = libc if libc is not None else _libc()
        group.unlimited_queue = True
        group.queue_problem = None
        group.fd = fd
        group.problems = []
        group._lock = threading.Lock()
        return group

    def fileno(self) -> int:
        return self.fd

    def _mark(self, flags: int, path: str, dirfd: int = AT_FDCWD) -> None:
        with self._lock:
            if self.fd < 0:
                raise OSError(errno.EBADF, "fanotify_mark: the group is closed")
            rc = self._libc.fanotify_mark(
                self.fd, flags | FAN_MARK_FILESYSTEM, FAN_OPEN_PERM, dirfd, os.fsencode(path)
            )
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")

    def open_root(self, path: str) -> OpenedRoot | None:
        """``path`` (a container's ``/proc/<pid>/root``) resolved once, to an ``O_PATH``
        descriptor: what is checked (``fstat``, ``fstatfs``) is what is marked (``"."``
        relative to it: an ``O_PATH`` dirfd with a NULL path is EBADF). None when it does
        not resolve. An ``O_PATH`` open raises no fanotify event, even on a marked
        filesystem."""
        try:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            dev = os.fstat(fd).st_dev
            kind = fstatfs_type(self._libc, fd)
        except OSError:
            os.close(fd)
            return None
        return OpenedRoot(
            dev=dev,
            fs_type=kind,
            mark=lambda: self._mark(FAN_MARK_ADD, ".", fd),
            unmark=lambda: self._mark(FAN_MARK_REMOVE, ".", fd),
            close=lambda: os.close(fd),
        )

    def mark_filesystem(self, path: str) -> None:
        """Hold every open on the filesystem that ``path`` is on (any mount of it)."""
        self._mark(FAN_MARK_ADD, path)

    def unmark_filesystem(self, path: str) -> None:
        self._mark(FAN_MARK_REMOVE, path)

    def marked_devices(self) -> set[int]:
        """``st_dev`` of every filesystem this group has a mark on, as the kernel lists them
        (``/proc/self/fdinfo``: one ``fanotify sdev:`` line per filesystem mark); a mark the
        kernel dropped with its superblock is gone from here."""
        with self._lock:
            if self.fd < 0:
                raise OSError(errno.EBADF, "the group is closed")
            with open(f"/proc/self/fdinfo/{self.fd}", encoding="ascii", errors="replace") as f:
                text = f.read(1 << 20)
        return parse_marked_devices(text)

    def read(self) -> list[PermEvent]:
        try:
            buf = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        except OSError as exc:
            if exc.errno == errno.EINTR:
                return []
            raise
        events, problems = parse_events(buf)
        self.problems.extend(problems)
        return events

    def respond(self, event: PermEvent, allow: bool) -> None:
        """Answer and close the event's descriptor (an FAN_NOFD event needs neither)."""
        if event.fd < 0:
            return
        try:
            os.write(self.fd, RESPONSE.pack(event.fd, FAN_ALLOW if allow else FAN_DENY))
        except OSError as exc:  # ENOENT: the event is gone (the opener was killed)
            if exc.errno != errno.ENOENT:
                raise
        finally:
            os.close(event.fd)

    def close(self) -> None:
        """The kernel allows every event still pending (once no process keeps a copy)."""
        with self._lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)


# Marks pinned at most where the kernel cannot evict them (before 5.19): each pins an inode
# in memory until the group closes. Past it, opens are answered one by one as before.
PINNED_MAX = 16384


IGNORE_MODES = ("auto", "evictable", "pinned", "off")
_IGNORE_PINNED = FAN_MARK_ADD | FAN_MARK_IGNORED_MASK
_IGNORE_EVICTABLE = _IGNORE_PINNED | FAN_MARK_EVICTABLE


# The group's fdinfo read to count its marks: ~150 bytes a mark, PINNED_MAX of them.
FDINFO_MAX = 8 << 20


class IgnoreMarks:
    """Opens of files that cannot be a target, filtered in the kernel after the first.

    On the first event for a regular file the hold does not name and whose content
    could not be a module (``core/hold.could_be_module``), the responder adds an
    inode ignore mark for ``FAN_OPEN_PERM`` through the event's own descriptor (no
    path: the file the kernel gave, in whatever namespace it lives), **before** it
    allows the open; later opens of that inode never reach the responder. Without
    ``FAN_MARK_IGNORED_SURV_MODIFY``, so a write to the file (by the opener it was
    just allowed for too) clears the mark: content that becomes a module is seen
    again. A rename or a link keeps an inode's mark, which is why no file that could
    be a module, by its bytes, is ever ignored, whatever its name.

    ``mode``: ``evictable`` (5.19+: ``FAN_MARK_EVICTABLE``, the kernel drops marks of
    inodes it evicts, so memory stays bounded), ``pinned`` (older kernels: at most
    ``PINNED_MAX`` marks, each pinning its inode until the group closes), ``off``.
    ``auto`` probes the kernel at start (``probe``).

    The kernel answers 0 to an ignore mark it silently does not take (a file someone has
    open for writing: ``fanotify_add_inode_mark``), so ``added`` counts requests; in
    ``pinned`` mode, when they reach ``pinned_max``, the group's fdinfo (the kernel's own
    list of its marks) is read and ``added`` set to what it holds, so phantom marks never
    use up the budget (issue 51)."""

    def __init__(self, group: FanotifyGroup, mode: str = "auto", pinned_max: int = PINNED_MAX):
        self.group = group
        self.pinned_max = pinned_max
        self.added = 0  # marks asked for and answered 0 (since the last count: see above)
        self.counted: int | None = None  # marks the kernel listed at the last count
        self.modules = 0  # first opens of files that could be modules: never ignored
        self.failed = 0  # marks the kernel refused (after the probe)
        self.problem: str | None = None
        if mode not in IGNORE_MODES:
            raise ValueError(f"ignore marks: mode {mode!r} is not one of {', '.join(IGNORE_MODES)}")
        self.mode = self.probe() if mode == "auto" else mode

    def probe(self) -> str:
        """``evictable`` if the kernel takes an evictable ignore mark (on a memfd of our
        own, removed at once), else ``pinned``; ``off`` if it takes no ignore mark."""
        for mode, flags in (("evictable", FAN_MARK_EVICTABLE), ("pinned", 0)):
            fd = os.memfd_create("nodeagent-ignore-probe", os.MFD_CLOEXEC)
            try:
                if self._mark(FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | flags, fd) == 0:
                    self._mark(FAN_MARK_REMOVE | FAN_MARK_IGNORED_MASK, fd)
                    return mode
                err = ctypes.get_errno()
            finally:
                os.close(fd)
        self.problem = f"the kernel takes no fanotify ignore mark ({os.strerror(err)})"
        return "off"

    def _mark(self, flags: int, fd: int) -> int:
        return int(self.group._libc.fanotify_mark(self.group.fd, flags, FAN_OPEN_PERM, fd, None))

    def add(self, fd: int) -> None:
        """Ignore the file ``fd`` is open on, if it cannot be a target (never raises)."""
        if self.mode == "off" or fd < 0:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return  # a FIFO or device: never read, never ignored
            if could_be_module(os.pread(fd, MODULE_HEAD_BYTES, 0)):
                self.modules += 1
                return
        except OSError:
            return
        evictable = self.mode == "evictable"
        if not evictable and self.added >= self.pinned_max:
            if self.counted is not None and self.counted >= self.pinned_max:
                return  # full, counted: no more reads of fdinfo
            self.counted = self.added = self.kernel_marks()
            if self.added >= self.pinned_max:
                return
        flags = _IGNORE_EVICTABLE if evictable else _IGNORE_PINNED
        if self._mark(flags, fd) == 0:
            self.added += 1
            return
        err = ctypes.get_errno()
        self.failed += 1
        if err == errno.ENOSPC:  # the user's mark limit: stop adding, say so once
            self.problem = f"ignore marks stopped at {self.added}: {os.strerror(err)}"
            self.mode = "off"

    def kernel_marks(self) -> int:
        """The ignore marks the kernel holds in this group: its fdinfo, one line an inode
        mark (bounded read; as many as ``added`` if it cannot be read)."""
        try:
            fd = os.open(f"/proc/self/fdinfo/{self.group.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return self.added
        try:
            chunks, size = [], 0
            while size < FDINFO_MAX:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError:
            return self.added
        finally:
            os.close(fd)
        lines = b"".join(chunks).splitlines()
        return sum(1 for line in lines if line.startswith(b"fanotify ino:"))

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "added": self.added,
            "modules_seen": self.modules,
            "failed": self.failed,
        }
        if self.mode == "pinned":
            out["pinned_max"] = self.pinned_max
        if self.problem:
            out["problem"] = self.problem
        return out
