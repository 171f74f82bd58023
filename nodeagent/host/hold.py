"""The responder: holds a module loader's open of ``nvidia-peermem.ko`` (and of an inbox RDMA
module it would pull in) while the gate is closed; which opens: ``core/hold.py``.

One thread of its own answers every fanotify permission event on the marked
filesystems (``host/fanotify.py``, or any ``EventSource``):

1. an event from the agent's own pid is allowed before anything else is done
   with it (the agent's own opens must never wait on itself);
2. an open of anything ``core/hold.held_open`` does not name is allowed at once;
3. an open of one it names by a module loader (``modprobe``/``insmod`` by ``/proc/<pid>/comm``
   or ``/proc/<pid>/exe``, never guessed; ``modinfo``, ``depmod`` and ``cat`` are
   not loaders, though kmod's ``exe`` is the same for all) is held while
   the gate reads closed, and allowed the moment it reads open, when its hold
   budget runs out, or when the responder stops;
4. anything it cannot identify (pid 0: the agent does not see the opener's pid
   namespace) is allowed: the hold never blocks what it cannot name.

It never waits on a pass, a plan, a lock or a disk write: ``gate_open()`` reads
the last decision, and the loop calls ``wake()`` after each one. It writes no
log and imports nothing after it starts (either could open a file on a marked
filesystem and wait on itself); what it did goes to ``reports``, for the loop
to record.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from nodeagent.core.hold import held_open
from nodeagent.host.events import Poke
from nodeagent.host.fanotify import EventSource, FanotifyGroup, PermEvent

# kmod is one binary for modprobe, insmod, modinfo, depmod...: its exe says "kmod" for all
# of them, its comm (argv[0]'s name) says which. So "kmod" alone names no loader.
LOADERS = frozenset({"modprobe", "insmod"})


@dataclass(frozen=True)
class HoldReport:
    """One held open, once it ended: who, which file, how long, how it ended."""

    pid: int
    opener: str
    path: str
    seconds: float
    ended: str  # "gate opened" | "budget expired" | "responder stopped" | "opener gone"


@dataclass
class _Held:
    event: PermEvent
    opener: str
    path: str
    began: float


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


def event_path(event: PermEvent) -> str:
    """The opened file's path as this process sees it (readlink: no open, no event)."""
    try:
        return os.readlink(f"/proc/self/fd/{event.fd}")
    except OSError:
        return "?"


class Responder:
    def __init__(
        self,
        source: EventSource,
        *,
        gate_open: Callable[[], bool],
        budget_s: float,
        own_pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        loader_of: Callable[[int], tuple[bool, str]] | None = None,
        on_report: Callable[[], None] = lambda: None,
        proc: str = "/proc",
        path_of: Callable[[PermEvent], str] = lambda event: event_path(event),
    ) -> None:
        """``on_report``: called (from the responder thread, so it must not block or open a
        file) when a report is added: the loop records it on its next pass. ``proc``,
        ``path_of``: where openers and opened files are read (the simulator's kernel
        gives its own)."""
        self.source = source
        self.gate_open = gate_open
        self.budget_s = budget_s
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.clock = clock
        self.proc = proc
        self.loader_of = loader_of or (lambda pid: is_loader(pid, proc))
        self.path_of = path_of
        self.on_report = on_report
        self.reports: collections.deque[HoldReport] = collections.deque(maxlen=1024)
        self.reported = 0  # reports ever added (the deque is drained by the loop)
        # no_fd: the kernel could not open the file for us (e.g. our descriptors ran out)
        # and denied that open itself; overflow: the kernel's queue overflowed.
        self.counts = {"allowed": 0, "held": 0, "unidentified": 0, "overflow": 0, "no_fd": 0}
        self._held: list[_Held] = []
        self._lock = threading.Lock()  # guards _held for readers (status); never held long
        self._wake = Poke()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fanotify-responder", daemon=True)

    # -- the loop's side -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The gate may have changed: look now (cheap, never blocks)."""
        self._wake.poke("gate")

    def held(self) -> list[tuple[int, str, str, float]]:
        """(pid, opener, path, seconds held) of every open held now."""
        now = self.clock()
        with self._lock:
            return [(h.event.pid, h.opener, h.path, now - h.began) for h in self._held]

    def stop(self, timeout: float = 2.0) -> None:
        """Allow everything held, stop answering, close the source (the kernel allows the
        rest)."""
        self._stopping = True
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # stepped, never a thread: release here
            self._release(stopping=True)
        self.source.close()
        self._wake.close()

    # -- the responder thread ------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.source.fileno(), select.POLLIN)
        poller.register(self._wake.fileno(), select.POLLIN)
        while not self._stopping:
            with contextlib.suppress(InterruptedError):
                poller.poll(self._timeout_ms())
            self.step()
        self._release(stopping=True)

    def step(self) -> None:
        """One round: take the wake-ups, answer every event read, release what may go.
        The thread runs it after each wait; the simulator calls it between its steps."""
        self._wake.drain()
        for event in self.source.read():
            self._answer(event)
        self._release()

    def _timeout_ms(self) -> int | None:
        with self._lock:
            if not self._held:
                return None
            due = min(h.began for h in self._held) + self.budget_s
        return max(0, int((due - self.clock()) * 1000) + 1)

    def _allow(self, event: PermEvent) -> None:
        self.source.respond(event, True)
        self.counts["allowed"] += 1

    def _answer(self, event: PermEvent) -> None:
        if event.pid == self.own_pid:  # first: the agent's own opens never wait on it
            self._allow(event)
            return
        if event.overflow:
            self.counts["overflow"] += 1
            self._allow(event)
            return
        if event.fd < 0:
            self.counts["no_fd"] += 1
            return
        path = self.path_of(event)
        if held_open(path) is None:
            self._allow(event)
            return
        if event.pid <= 0:
            self.counts["unidentified"] += 1
            self._allow(event)
            return
        loader, name = self.loader_of(event.pid)
        if not loader or self.gate_open():
            self._allow(event)
            return
        with self._lock:
            self._held.append(_Held(event, name, path, self.clock()))
        self.counts["held"] += 1

    def _release(self, stopping: bool = False) -> None:
        """Answer held opens whose gate opened, budget ran out, or opener went away."""
        with self._lock:
            if not self._held:
                return
            is_open = self.gate_open()
            now = self.clock()
            keep: list[_Held] = []
            done: list[tuple[_Held, str]] = []
            for h in self._held:
                if stopping:
                    done.append((h, "responder stopped"))
                elif is_open:
                    done.append((h, "gate opened"))
                elif now - h.began >= self.budget_s:
                    done.append((h, "budget expired"))
                elif not os.path.exists(f"{self.proc}/{h.event.pid}"):
                    done.append((h, "opener gone"))
                else:
                    keep.append(h)
            self._held = keep
        for h, why in done:
            self._allow(h.event)
            self.reports.append(HoldReport(h.event.pid, h.opener, h.path, now - h.began, why))
            self.reported += 1
        if done:
            self.on_report()


def sees_host_pids(status_path: str = "/proc/self/status") -> bool:
    """In the host's pid namespace (``hostPID``)? ``NSpid`` lists one pid per namespace level."""
    try:
        with open(status_path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) == 2
    except OSError:
        return False
    return True  # a kernel without NSpid (< 4.1) has no nested namespaces to tell apart


class HoldGroup(EventSource, Protocol):
    """A permission group the hold can mark: the kernel's fanotify group, or the
    simulator's."""

    def mark_filesystem(self, path: str) -> None: ...

    def marked_devices(self) -> set[int]: ...


@dataclass(frozen=True)
class HoldHost:
    """Where the hold meets a kernel: the running one by default. The simulator gives its
    own group, process table and superblocks, and steps the responder and the scanner
    itself (``threaded=False``) so its virtual clock orders every answer."""

    group: Callable[[], HoldGroup]  # OSError when the kernel refuses
    proc: str = "/proc"
    host_pids: Callable[[], bool] = lambda: sees_host_pids()
    path_of: Callable[[PermEvent], str] = lambda event: event_path(event)
    dev_of: Callable[[str], int | None] | None = None  # a root's device (default: stat)
    fs_type: Callable[[str], int | None] | None = None  # a root's fs type (default: statfs)
    threaded: bool = True
    clock: Callable[[], float] = time.monotonic  # budgets and ages


def start_hold(
    source: EventSource,
    mark: Callable[[str], None],
    roots: list[tuple[str, str]],
    *,
    gate_open: Callable[[], bool],
    budget_s: float,
    host_pids: bool,
    containers: bool = False,
    on_report: Callable[[], None] = lambda: None,
    host: HoldHost | None = None,
) -> tuple[Responder | None, list[str], list[str]]:
    """Mark ``roots`` ((name, path) pairs) and start a responder; (responder, marked, problems).
    ``host``: where openers and files are read, and whether the responder gets a thread
    (the running kernel's by default).

    Refuses, in one line each, without host PIDs (every opener would be pid 0) or with
    nothing marked and no container roots to come (``containers``); a root that cannot be
    marked is named and skipped.
    """
    if not host_pids:
        source.close()
        return (
            None,
            [],
            [
                "peermem.hold_loads: the agent does not see host PIDs (run it with hostPID: true); "
                "not holding any load"
            ],
        )
    marked: list[str] = []
    problems: list[str] = []
    for name, path in roots:
        if not os.path.isdir(path):
            problems.append(f"peermem.hold_roots: {name} is not a directory; not marked")
            continue
        try:
            mark(path)
        except OSError as exc:
            problems.append(f"peermem.hold_roots: cannot mark {name}: {exc.strerror or exc}")
            continue
        marked.append(name)
    if not marked and not containers:
        source.close()
        return None, [], [*problems, "peermem.hold_loads: nothing marked; not holding any load"]
    host = host or HoldHost(group=FanotifyGroup)
    responder = Responder(
        source,
        gate_open=gate_open,
        budget_s=budget_s,
        on_report=on_report,
        proc=host.proc,
        path_of=host.path_of,
        clock=host.clock,
    )
    if host.threaded:
        responder.start()
    return responder, marked, problems
