"""The responder: holds a module loader's open of ``nvidia-peermem.ko`` (and of an inbox RDMA
module it would pull in) while the gate is closed; which opens: ``core/hold.py``.

A ``Responder`` answers every fanotify permission event on the marked
filesystems (``host/fanotify.py``, or any ``EventSource``): in the agent, in a
process of its own (``host/responder_apart.py``, ``host/responder_main.py``: a
stalled agent stalls no open); in the simulator, stepped; in tests, a thread.

1. an event from the agent's own pid is allowed before anything else is done
   with it (the agent's own opens must never wait on itself);
2. an open of anything ``core/hold.held_open`` does not name is allowed at once;
3. an open of one it names by a module loader (``modprobe``/``insmod`` by ``/proc/<pid>/comm``
   or ``/proc/<pid>/exe``, never guessed; ``modinfo``, ``depmod`` and ``cat`` are
   not loaders, though kmod's ``exe`` is the same for all) is held while
   the gate reads closed, and allowed the moment it reads open, when its hold
   budget runs out, or when the responder stops;
4. anything it cannot identify (pid 0: the agent does not see the opener's pid
   namespace) is allowed: the hold never blocks what it cannot name;
5. the first open of a file it does not name, whose bytes could not be a module, is
   filtered in the kernel from then on (``ignore``: an inode ignore mark added before
   the open is allowed; ``host/fanotify.IgnoreMarks``);
6. past a cap on held opens (``HELD_PER_CONTAINER`` per opener's mount namespace,
   ``HELD_TOTAL`` in all; each keeps a descriptor) an open is allowed at once.

What is not a single open's report (a queue overflow, opens past a cap, an error it
survived: it never dies of one) is a notice, one per burst. ``start_hold`` raises the
descriptor limit first and fits the caps in it (``descriptor_budget``).

It never waits on a pass, a plan, a lock or a disk write: ``gate_open()`` reads
the last decision, and the loop calls ``wake()`` after each one. It writes no
log and imports nothing after it starts (either could open a file on a marked
filesystem and wait on itself); what it did goes to ``reports``, for the loop
to record.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import resource
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nodeagent.core.hold import held_open
from nodeagent.host.events import Poke
from nodeagent.host.fanotify import (
    READ_EVENTS,
    EventSource,
    FanotifyGroup,
    OpenedRoot,
    PermEvent,
)

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
    container: str = "?"  # the opener's (``mount_namespace``), for the cap per container


# Caps on opens held at once (each keeps an event descriptor in the agent until answered):
# per opener's container, and in all. Constants for now, not policy: a new policy field
# needs docs/configuration.md. 64 is far above a driver container's handful of loads.
HELD_PER_CONTAINER = 64
HELD_TOTAL = 256
# Descriptors kept for the agent's own writes, endpoints' connections and /proc reads, on
# top of what the hold may have at once (held opens and one read's events).
FD_RESERVE = 256
# After an EMFILE/ENFILE the responder waits this long (or for a wake-up) before reading
# the group again: each failed read costs the kernel one event (it denies it).
FAULT_BACKOFF_S = 0.1

# A burst of one kind of trouble (an overflow, ...) ends after this long without another:
# one notice per burst, with its count, never one per event.
BURST_QUIET_S = 2.0

OVERFLOW_MEANING = (
    "the kernel's fanotify queue overflowed: it dropped permission events and allowed "
    "those opens unanswered, so a held-class open (a load of nvidia-peermem.ko or of an "
    "inbox RDMA module) may have gone through"
)


@dataclass
class _Burst:
    """Occurrences of one kind gathered until ``BURST_QUIET_S`` passes without another."""

    began: float
    last: float
    kind: str = ""  # the notice's record kind
    count: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DescriptorBudget:
    """The agent's descriptors as the hold planned them at start: ``limit`` (the soft
    ``RLIMIT_NOFILE``, raised to ``hard``), ``reserve`` kept for the rest of the agent,
    and the caps on held opens that fit in what is left with one read's events."""

    limit: int
    hard: int
    reserve: int
    held_total: int
    held_per_container: int
    read_events: int = READ_EVENTS

    def status(self) -> dict[str, int]:
        return {
            "limit": self.limit,
            "hard": self.hard,
            "reserve": self.reserve,
            "held_total": self.held_total,
            "held_per_container": self.held_per_container,
            "per_read": self.read_events,
        }


def descriptor_budget(
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> tuple[DescriptorBudget, list[str]]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and fit the caps on held opens
    in it, keeping ``FD_RESERVE`` for the rest of the agent; (budget, problems)."""
    problems: list[str] = []
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            problems.append(
                f"peermem.hold_loads: cannot raise the descriptor limit from {soft} to {hard}: "
                f"{exc}"
            )
    room = max(0, soft - FD_RESERVE - READ_EVENTS)
    total = min(HELD_TOTAL, room)
    if total < HELD_TOTAL:
        problems.append(
            f"peermem.hold_loads: a descriptor limit of {soft} (hard {hard}) leaves room for "
            f"{total} held opens, not {HELD_TOTAL}; past that, loads go on at once"
        )
    budget = DescriptorBudget(
        limit=soft,
        hard=hard,
        reserve=FD_RESERVE,
        held_total=total,
        held_per_container=min(HELD_PER_CONTAINER, total),
    )
    return budget, problems


def open_descriptors() -> int:
    """How many descriptors this process has open now (-1: unreadable)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


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


def _fault_name(exc: BaseException) -> str:
    """A bounded word for an error: ``EMFILE``, ``ENFILE``, ``OSError`` or the class name."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return errno.errorcode[exc.errno]
    return type(exc).__name__


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
        burst_quiet_s: float = BURST_QUIET_S,
        held_per_container: int = HELD_PER_CONTAINER,
        held_total: int = HELD_TOTAL,
        container_of: Callable[[int], str] | None = None,
        descriptors: DescriptorBudget | None = None,
        also_own: Collection[int] = (),
        watch_fds: Mapping[int, Callable[[], None]] | None = None,
        after_step: Callable[[], None] = lambda: None,
        ignore: Callable[[int], None] | None = None,
        may_load: Callable[[int], str | None] | None = None,
    ) -> None:
        """``on_report``: called (from the responder thread, so it must not block or open a
        file) when a report or a notice is added: the loop records it on its next pass.
        ``proc``, ``path_of``: where openers and opened files are read (the simulator's
        kernel gives its own). ``held_per_container``, ``held_total``: the caps on opens
        held at once (each keeps a descriptor); past either, an open is allowed at once
        and said, once per burst. ``container_of``: an opener's container, for the first
        cap (default: its mount namespace). ``descriptors``: the budget the caps fit in,
        for status. ``also_own``: pids besides ``own_pid`` whose opens are the agent's own
        (the responder's process, when it runs apart). ``watch_fds``: descriptors the
        thread also waits on, each with what to do when it is readable; ``after_step``:
        called after each round (the process apart sends its reports there). ``ignore``:
        given an event's descriptor, filters later opens of that file in the kernel if it
        cannot be a target (``host/fanotify.IgnoreMarks.add``); called before the first
        open of a file the hold does not name is allowed. ``may_load``: why an opener
        cannot load a module (None: it can); only one that can is ever held (default:
        ``opener_may_load`` under ``proc``; a caller giving its own ``loader_of`` says
        who loads, and by default everyone it names can)."""
        self.source = source
        self.gate_open = gate_open
        self.budget_s = budget_s
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.own_pids = frozenset({self.own_pid, *also_own})
        self.watch_fds = dict(watch_fds or {})
        self.after_step = after_step
        self.ignore = ignore
        self.clock = clock
        self.proc = proc
        self.loader_of = loader_of or (lambda pid: is_loader(pid, proc))
        if may_load is None:
            may_load = opener_may_load(proc) if loader_of is None else (lambda pid: None)
        self.may_load = may_load
        self.container_of = container_of or (lambda pid: mount_namespace(pid, proc))
        self.path_of = path_of
        self.on_report = on_report
        self.held_per_container = held_per_container
        self.held_total = held_total
        self.descriptors = descriptors
        self.reports: collections.deque[HoldReport] = collections.deque(maxlen=1024)
        self.reported = 0  # reports and notices ever added (the deques are drained by the loop)
        self.reports_lost = 0  # reports pushed out of the full deque before the loop read them
        # no_fd: the kernel could not open the file for us (e.g. our descriptors ran out)
        # and denied that open itself; overflow: the kernel's queue overflowed; over_cap:
        # held-class opens allowed at once past a cap; faults: errors survived; incapable:
        # held-class opens by a loader that cannot load a module (allowed at once).
        self.counts = {
            "allowed": 0,
            "held": 0,
            "incapable": 0,
            "unidentified": 0,
            "overflow": 0,
            "no_fd": 0,
            "over_cap": 0,
            "faults": 0,
        }
        # Event descriptors the responder had at once at most (held + one read's).
        self.peak_descriptors = 0
        # Timeline records of bursts (an overflow, opens past a cap, a fault), one per
        # burst once it is over, for the loop to record with the held opens' reports.
        self.notices: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.burst_quiet_s = burst_quiet_s
        self._bursts: dict[str, _Burst] = {}  # by notice key; the responder thread's own
        self._held: list[_Held] = []
        self._per_container: collections.Counter[str] = collections.Counter()
        self._answering: PermEvent | None = None  # read, not yet answered nor held
        self._backoff = False  # an EMFILE/ENFILE: wait a little before reading again
        self._lock = threading.Lock()  # guards _held for readers (status); never held long
        self._wake = Poke()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fanotify-responder", daemon=True)

    # -- the loop's side -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def serve(self) -> None:
        """Answer in the calling thread until stopped (the responder's own process)."""
        self._run()

    def follow(self, is_open: bool) -> None:
        """The gate changed, or its decision was renewed (``gate_open`` reads it)."""
        self.wake()

    def wake(self) -> None:
        """The gate may have changed: look now (cheap, never blocks)."""
        self._wake.poke("gate")

    def held(self) -> list[tuple[int, str, str, float]]:
        """(pid, opener, path, seconds held) of every open held now."""
        now = self.clock()
        with self._lock:
            return [(h.event.pid, h.opener, h.path, now - h.began) for h in self._held]

    def alive(self) -> bool:
        """Answering (a thread that runs), or stepped by its owner."""
        return self._thread.is_alive() or self._thread.ident is None

    def stop(self, timeout: float = 2.0) -> None:
        """Allow everything held, stop answering, close the source (the kernel allows the
        rest)."""
        self._stopping = True
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # stepped, never a thread: release here
            self._release(stopping=True)
            self._end_bursts(stopping=True)
        self.source.close()
        self._wake.close()

    # -- the responder thread ------------------------------------------------------

    def _run(self) -> None:
        """Never dies of an exception: each is noted (a ``hold-fault`` per burst) and the
        loop goes on; after an EMFILE/ENFILE it waits ``FAULT_BACKOFF_S`` (or a wake-up)
        before reading again, so it does not spin."""
        poller = select.poll()
        poller.register(self.source.fileno(), select.POLLIN)
        poller.register(self._wake.fileno(), select.POLLIN)
        for fd in self.watch_fds:
            poller.register(fd, select.POLLIN)
        pause = select.poll()
        pause.register(self._wake.fileno(), select.POLLIN)
        while not self._stopping:
            try:
                ready: list[tuple[int, int]] = []
                with contextlib.suppress(InterruptedError):
                    ready = poller.poll(self._timeout_ms())
                woken = False
                for fd, _ in ready:
                    if fd in self.watch_fds:
                        self.watch_fds[fd]()
                    woken = woken or fd == self._wake.fileno()
                self.step(drain=woken)
                self.after_step()
                if self._backoff:
                    self._backoff = False
                    with contextlib.suppress(InterruptedError):
                        pause.poll(int(FAULT_BACKOFF_S * 1000))
            except Exception as exc:  # (step catches its own: this is the last net)
                self._fault(exc)
        try:
            self._release(stopping=True)
        finally:
            self._end_bursts(stopping=True)

    def step(self, drain: bool = True) -> None:
        """One round: take the wake-ups, answer every event read, release what may go.
        The thread runs it after each wait; the simulator calls it between its steps.
        Raises nothing: an event whose answer failed is allowed if it can still be.
        ``drain``: take the wake-ups (the thread knows when there are none: a syscall
        saved per event)."""
        if drain:
            self._wake.drain()
        try:
            events = self.source.read()
        except Exception as exc:  # EMFILE/ENFILE: the kernel denied the event it could not
            self._fault(exc)  # give a descriptor for; nothing was read, nothing is pending
            events = []
        # (_held changes in this thread only: its length needs no lock here)
        self.peak_descriptors = max(self.peak_descriptors, len(self._held) + len(events))
        for event in events:
            self._answering = event
            try:
                self._answer(event)
            except Exception as exc:
                self._fault(exc)
                self._allow_pending()
            self._answering = None
        try:
            self._release()
        except Exception as exc:
            self._fault(exc)
        self._end_bursts()

    def _allow_pending(self) -> None:
        """Allow the event being answered if no answer was attempted yet (an answer that
        failed closed its descriptor already: never twice)."""
        event, self._answering = self._answering, None
        if event is not None:
            with contextlib.suppress(Exception):
                self._allow(event)

    def _fault(self, exc: BaseException) -> None:
        self.counts["faults"] += 1
        name = _fault_name(exc)
        if name in ("EMFILE", "ENFILE"):
            self._backoff = True
        self._note(
            "hold-fault", key=f"hold-fault:{name}", first={"fault": name, "error": str(exc)[:200]}
        )

    def _timeout_ms(self) -> int | None:
        if not self._bursts and not self._held:  # the usual case, once per event
            return None
        dues = [b.last + self.burst_quiet_s for b in list(self._bursts.values())]
        with self._lock:
            if self._held:
                dues.append(min(h.began for h in self._held) + self.budget_s)
        if not dues:
            return None
        return max(0, int((min(dues) - self.clock()) * 1000) + 1)

    def _note(
        self,
        kind: str,
        *,
        key: str | None = None,
        first: dict[str, Any] | None = None,
        **detail: Any,
    ) -> None:
        """One more occurrence of ``kind`` in its burst (``key``: kind by default; a new
        burst after a quiet spell). ``first``: what the burst's first occurrence says;
        ``detail``: numbers are added up over the burst, flags or-ed."""
        now = self.clock()
        key = key or kind
        burst = self._bursts.get(key)
        if burst is None:
            burst = self._bursts[key] = _Burst(began=now, last=now, kind=kind)
            burst.detail.update(first or {})
        burst.last = now
        burst.count += 1
        for k, v in detail.items():
            if isinstance(v, bool):
                burst.detail[k] = burst.detail.get(k, False) or v
            else:
                burst.detail[k] = burst.detail.get(k, 0) + v

    def _end_bursts(self, stopping: bool = False) -> None:
        """A notice for each burst that has been quiet for ``burst_quiet_s`` (each, when
        stopping)."""
        if not self._bursts:
            return
        now = self.clock()
        ended = [
            k for k, b in self._bursts.items() if stopping or now - b.last >= self.burst_quiet_s
        ]
        for key in ended:
            b = self._bursts.pop(key)
            notice: dict[str, Any] = {
                "kind": b.kind,
                "count": b.count,
                "seconds": b.last - b.began,
            }
            notice.update(b.detail)
            notice["meaning"] = self._meaning(b)
            self.notices.append(notice)
            self.reported += 1
        if ended:
            self.on_report()

    def _meaning(self, b: _Burst) -> str:
        if b.kind == "hold-overflow":
            return OVERFLOW_MEANING + (
                " while the gate was closed"
                if b.detail.get("gate_closed")
                else "; the gate was open at each overflow, so none would have been held"
            )
        if b.kind == "hold-over-cap":
            return (
                f"module loaders' opens past the hold's caps ({self.held_per_container} held "
                f"per container, {self.held_total} in all) were allowed at once, gate "
                "closed: a flood of loads; each held open keeps a descriptor of the agent's"
            )
        return "the responder survived an error and went on" + (
            f" (out of descriptors: reads waited {FAULT_BACKOFF_S:g} s; the kernel "
            "denies an open it cannot give a descriptor for)"
            if b.detail.get("fault") in ("EMFILE", "ENFILE")
            else "; an event it was answering was allowed"
        )

    def _allow(self, event: PermEvent) -> None:
        self._answering = None  # an answer attempted: never again, even if it fails
        self.source.respond(event, True)
        self.counts["allowed"] += 1

    def _answer(self, event: PermEvent) -> None:
        if event.pid in self.own_pids:  # first: the agent's own opens never wait on it
            self._allow(event)
            return
        if event.overflow:  # the kernel allowed what it dropped: say so, once per burst
            self._note("hold-overflow", gate_closed=not self.gate_open())
            self.counts["overflow"] += 1  # (after the note: a reader of counts sees both)
            self._allow(event)
            return
        if event.fd < 0:
            self.counts["no_fd"] += 1
            return
        path = self.path_of(event)
        if held_open(path) is None:
            if self.ignore is not None:  # before the answer: the opener's writes clear it
                self.ignore(event.fd)
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
        # Only an opener that can load a module is held: no other can spend the caps, nor
        # grow what the responder reports (issue 51: an unprivileged user namespace's opens
        # were held and silenced the responder).
        if self.may_load(event.pid) is not None:
            self.counts["incapable"] += 1
            self._allow(event)
            return
        container = self.container_of(event.pid)
        with self._lock:
            if len(self._held) >= self.held_total:
                over = "total"
            elif self._per_container[container] >= self.held_per_container:
                over = "container"
            else:
                over = ""
                self._held.append(_Held(event, name, path, self.clock(), container))
                self._per_container[container] += 1
        if over:  # past a cap: allowed at once, said once per burst
            self._note(
                "hold-over-cap",
                first={"pid": event.pid, "opener": name, "container": container},
                past_container_cap=int(over == "container"),
                past_total_cap=int(over == "total"),
            )
            self.counts["over_cap"] += 1
            self._allow(event)
            return
        self._answering = None  # held: answered by _release
        self.counts["held"] += 1

    def _release(self, stopping: bool = False) -> None:
        """Answer held opens whose gate opened, budget ran out, or opener went away."""
        if not self._held:  # (changed in this thread only)
            return
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
            for h, _why in done:
                self._per_container[h.container] -= 1
                if self._per_container[h.container] <= 0:
                    del self._per_container[h.container]
        for h, why in done:
            try:
                self._allow(h.event)
            except Exception as exc:  # the rest are still answered
                self._fault(exc)
            if len(self.reports) == self.reports.maxlen:
                self.reports_lost += 1  # the oldest goes: counted, said in one record
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


class HoldResponder(Protocol):
    """What the hold's side reads and drives: the thread (``Responder``) or the process
    apart (``host/responder_apart.ResponderProcess``)."""

    reports: collections.deque[HoldReport]
    notices: collections.deque[dict[str, Any]]
    reported: int
    descriptors: DescriptorBudget | None

    @property
    def counts(self) -> dict[str, int]: ...

    def held(self) -> list[tuple[int, str, str, float]]: ...

    def alive(self) -> bool: ...

    def follow(self, is_open: bool) -> None: ...

    def wake(self) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...


class HoldGroup(EventSource, Protocol):
    """A permission group the hold can mark: the kernel's fanotify group, or the
    simulator's."""

    def mark_filesystem(self, path: str) -> None: ...

    def open_root(self, path: str) -> OpenedRoot | None: ...

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
    # Why a pid's process can never load a module, or None if it can (default: its
    # bounding set and user namespace under ``proc``; containers.py).
    may_load: Callable[[int], str | None] | None = None
    # Why an opener cannot load a module now (default: ``opener_may_load`` under ``proc``).
    opener_may_load: Callable[[int], str | None] | None = None
    threaded: bool = True
    clock: Callable[[], float] = time.monotonic  # budgets and ages
    # The responder in a process of its own (``host/responder_apart.py``) when threaded:
    # the kernel's group only (a test's fake group answers in a thread of the agent).
    apart: bool = True


def mark_root(mark: Callable[[str], None], name: str, path: str) -> str | None:
    """Mark the filesystem of hold root ``name`` (at ``path``); why not, or None when marked."""
    if not os.path.isdir(path):
        return f"{name} is not a directory; not marked"
    try:
        mark(path)
    except OSError as exc:
        return f"cannot mark {name}: {exc.strerror or exc}"
    return None


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
    budget: DescriptorBudget | None = None,
    apart: Callable[[DescriptorBudget], HoldResponder] | None = None,
) -> tuple[HoldResponder | None, list[str], list[str]]:
    """Start a responder, then mark ``roots`` ((name, path) pairs); (responder, marked,
    problems). ``host``: where openers and files are read, and how the responder runs
    (by default: the running kernel's, in a process of its own).

    Refuses, in one line each, without host PIDs (every opener would be pid 0) or with
    nothing marked and no container roots to come (``containers``); a root that cannot be
    marked is named and skipped. Before it starts, the descriptor limit is raised and the
    caps on held opens fitted in it (``budget``: a test's own plan instead). ``apart``:
    starts the responder as a process of its own, given the budget
    (``host/responder_apart.spawner``; OSError when it does not answer); without it, a
    thread of this process (or none: stepped). The responder answers before the first
    mark: a process apart has read every file it needs by then.
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
    problems: list[str] = []
    host = host or HoldHost(group=FanotifyGroup)
    if budget is None:
        budget, budget_problems = descriptor_budget()
        problems.extend(budget_problems)
    responder: HoldResponder
    if apart is not None and host.threaded:
        try:
            responder = apart(budget)
        except OSError as exc:
            source.close()
            return None, [], [*problems, f"peermem.hold_loads: {exc}; not holding any load"]
    else:
        thread = Responder(
            source,
            gate_open=gate_open,
            budget_s=budget_s,
            on_report=on_report,
            proc=host.proc,
            path_of=host.path_of,
            clock=host.clock,
            held_per_container=budget.held_per_container,
            held_total=budget.held_total,
            descriptors=budget,
            may_load=host.opener_may_load,
        )
        if host.threaded:
            thread.start()
        responder = thread
    marked: list[str] = []
    for name, path in roots:
        why = mark_root(mark, name, path)
        if why is not None:
            problems.append(f"peermem.hold_roots: {why}")
            continue
        marked.append(name)
    if not marked and not containers:
        responder.stop()
        return None, [], [*problems, "peermem.hold_loads: nothing marked; not holding any load"]
    return responder, marked, problems
