"""Who opened: a module loader (``modprobe``/``insmod``, by comm or exe, never guessed), whether
its process may load a module now (``CAP_SYS_MODULE`` in its effective set), the file an
event is about, and the opener's mount namespace (its container, for the caps)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from nodeagent.host.fanotify import (
    PermEvent,
)

# kmod is one binary for modprobe, insmod, modinfo, depmod...: its exe says "kmod" for all
# of them, its comm (argv[0]'s name) says which. So "kmod" alone names no loader.
LOADERS = frozenset({"modprobe", "insmod"})


def is_loader(pid: int, proc: str = "/proc") -> tuple[bool, str]:
    """(a module loader?, its name) from ``exe`` and ``comm``: kmod's modprobe is a link
    to ``kmod`` whose ``comm`` says ``modprobe``; busybox's says ``busybox``."""
    names: set[str] = set()
    with contextlib.suppress(OSError):
        names.add(os.path.basename(os.readlink(f"{proc}/{pid}/exe")).removesuffix(" (deleted)"))
    with (
        contextlib.suppress(OSError),
        open(f"{proc}/{pid}/comm", encoding="utf-8", errors="replace") as f,
    ):
        names.add(f.read(64).strip())
    names.discard("")
    loader = sorted(names & LOADERS)
    return bool(loader), (loader[0] if loader else ",".join(sorted(names)) or "?")


CAP_SYS_MODULE = 16
STATUS_BYTES = 8192


def _status_hex(status: bytes, field: bytes) -> int | None:
    for line in status.splitlines():
        if line.startswith(field):
            with contextlib.suppress(ValueError):
                return int(line[len(field) :].strip()[:16], 16)
    return None


def opener_may_load(proc: str = "/proc") -> Callable[[int], str | None]:
    """Why the opener ``pid`` cannot load a module now, or None when it can:
    ``finit_module`` needs ``CAP_SYS_MODULE`` in the initial user namespace, so the
    opener must be in the host's user namespace (the responder's own, as a fanotify
    permission group needs ``CAP_SYS_ADMIN`` there) with the capability in its effective
    or permitted set. One bounded read of its status and a stat of its namespace; an
    opener that cannot be read is not held (it cannot be shown to be able to load)."""

    def why_not(pid: int) -> str | None:
        try:
            fd = os.open(f"{proc}/{pid}/status", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                status = os.read(fd, STATUS_BYTES)
            finally:
                os.close(fd)
            mine, its = os.stat(f"{proc}/self/ns/user"), os.stat(f"{proc}/{pid}/ns/user")
        except OSError as exc:
            return f"cannot read it ({exc.strerror or exc})"
        if (mine.st_dev, mine.st_ino) != (its.st_dev, its.st_ino):
            return "not in the host's user namespace"
        caps = (_status_hex(status, b"CapEff:") or 0) | (_status_hex(status, b"CapPrm:") or 0)
        if not caps >> CAP_SYS_MODULE & 1:
            return "no CAP_SYS_MODULE"
        return None

    return why_not


def event_path(event: PermEvent) -> str:
    """The opened file's path as this process sees it (readlink: no open, no event)."""
    try:
        return os.readlink(f"/proc/self/fd/{event.fd}")
    except OSError:
        return "?"


def mount_namespace(pid: int, proc: str = "/proc") -> str:
    """Whose container an opener is in, for the caps: its mount namespace
    (``mnt:[4026532xxx]``, a readlink: no open). Every container has one of its own, and
    its processes share it whatever their root; leaving it takes ``CAP_SYS_ADMIN``, and
    then the cap in total still holds. ``?`` when unreadable (one shared bucket)."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/mnt")
    except OSError:
        return "?"


@dataclass(frozen=True)
class Openers:
    """How an event's opener and file are read. ``proc``, ``path_of``: where openers and
    opened files are read (the simulator's kernel gives its own). ``own_pid`` (default:
    this process) and ``also_own`` (the responder's process, when it runs apart): pids
    whose opens are the agent's own. ``loader_of``: whether a pid is a module loader
    (default: ``is_loader``). ``may_load``: why an opener cannot load a module (None: it
    can); only one that can is ever held (default: ``opener_may_load`` under ``proc``; a
    caller giving its own ``loader_of`` says who loads, and by default everyone it names
    can). ``container_of``: an opener's container, for the first cap (default: its
    mount namespace). ``facts_of``: what the gate judges of a held ``nvidia-peermem``
    file, given the event and its path (default: read from the event's descriptor,
    ``heldfiles.read_held_fd``; the simulator's events carry none)."""

    proc: str = "/proc"
    path_of: Callable[[PermEvent], str] = event_path
    own_pid: int | None = None
    also_own: Collection[int] = ()
    loader_of: Callable[[int], tuple[bool, str]] | None = None
    may_load: Callable[[int], str | None] | None = None
    container_of: Callable[[int], str] | None = None
    facts_of: Callable[[PermEvent, str], dict[str, Any]] | None = None
