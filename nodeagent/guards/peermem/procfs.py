"""What ``/proc`` says of one process, read in a few bounded syscalls: its mount
namespace, whether it can ever load a module, its start time; and a marked container
root (``ContainerRoot``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

STATUS_BYTES = 8192
STAT_BYTES = 1024  # /proc/<pid>/stat: 52 numbers and a 16-byte command name
CAP_SYS_MODULE = 16


@dataclass(frozen=True)
class ContainerRoot:
    """A driver container's root, marked: its filesystem (``st_dev``) and who led to it."""

    dev: int
    pid: int
    rule: str
    command: str
    marked_at: float  # the scanner's clock
    noticed_s: float  # from first seeing the pid to the mark in place
    mount_ns: tuple[int, int] | None = None  # its process's mount namespace, at the mark
    # Its process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), at
    # the mark: with the pid, which process it is (a pid is reused, a start time is not).
    start_time: int | None = None

    def dev_text(self) -> str:
        return f"{os.major(self.dev)}:{os.minor(self.dev)}"


def ns_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def module_loader_check(proc: str = "/proc") -> Callable[[int], str | None]:
    """Why the process ``pid`` can never load a module, or None when it can: from its
    bounding set (``CapBnd``) and whether it is in the host's user namespace."""

    def why_not(pid: int) -> str | None:
        try:
            with open(f"{proc}/{pid}/status", "rb") as f:
                status = f.read(STATUS_BYTES)
        except OSError as exc:
            return f"cannot read its capabilities ({exc.strerror or exc})"
        bounding = None
        for line in status.splitlines():
            if line.startswith(b"CapBnd:"):
                with contextlib.suppress(ValueError):
                    bounding = int(line.split(b":", 1)[1].strip()[:16], 16)
        if bounding is None:
            return "cannot read its capabilities (no CapBnd in its status)"
        if not bounding >> CAP_SYS_MODULE & 1:
            return "it can never load a module (no CAP_SYS_MODULE in its bounding set)"
        # The agent's own is the host's: a fanotify permission group needs CAP_SYS_ADMIN in
        # the initial user namespace, so an agent that holds is in it (pid 1 may be
        # unreadable where the agent is not given CAP_SYS_PTRACE over it).
        own, host = ns_id(f"{proc}/{pid}/ns/user"), ns_id(f"{proc}/self/ns/user")
        if own is None or host is None:
            return "cannot read its user namespace"
        if own != host:
            return "it can never load a module (not in the host's user namespace)"
        return None

    return why_not


def read_head(path: str, size: int) -> bytes:
    """The first ``size`` bytes of a file: open, one read, close (``open()`` adds an
    ``fstat``, an ``ioctl`` and an ``lseek``; this runs once per exec on the node)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def start_time(proc: str, pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (``starttime``), or None when unreadable. The
    command name (field 2) may hold spaces and parentheses: the fields are counted from
    the last ``)``."""
    try:
        raw = read_head(f"{proc}/{pid}/stat", STAT_BYTES)
    except OSError:
        return None
    _comm, paren, rest = raw.rpartition(b")")
    fields = rest.split()
    if not paren or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])  # fields[0] is field 3 (state)


def stat_dev(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None
