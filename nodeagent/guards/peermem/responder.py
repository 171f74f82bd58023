"""The responder: holds a module loader's open of ``nvidia-peermem.ko`` (and of an inbox RDMA
module it would pull in) while the gate is closed; which opens: ``core/hold.py``.

A ``Responder`` answers every fanotify permission event on the marked
filesystems (``host/fanotify.py``, or any ``EventSource``): in the agent, in a
process of its own (``guards/peermem/process.py``, ``guards/peermem/process_main.py``: a
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
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.core.hold import held_open
from nodeagent.core.snapshot import HeldFileKey
from nodeagent.guards.peermem.budget import Caps
from nodeagent.guards.peermem.heldfiles import ENDED, HeldFacts
from nodeagent.guards.peermem.lease import HeldVerdicts
from nodeagent.guards.peermem.openers import (
    Openers,
    is_loader,
    mount_namespace,
    opener_may_load,
)
from nodeagent.guards.peermem.reports import (
    FAULT_BACKOFF_S,
    Burst,
    HoldReport,
    fault_name,
)
from nodeagent.host.events import Poke
from nodeagent.host.fanotify import (
    EventSource,
    PermEvent,
)


@dataclass
class _Held:
    event: PermEvent
    opener: str
    path: str
    began: float
    container: str = "?"  # the opener's (``mount_namespace``), for the cap per container
    # An nvidia-peermem file's identity, when its facts were read (``heldfiles.py``): its
    # own verdict decides, where the agent gives verdicts.
    file: HeldFileKey | None = None


@dataclass(frozen=True)
class Rounds:
    """What the responder's thread does besides answering. ``on_report``: called (from
    that thread, so it must not block or open a file) when a report or a notice is added:
    the loop records it on its next pass. ``watch_fds``: descriptors the thread also
    waits on, each with what to do when it is readable; ``after_step``: called after each
    round (the process apart sends its reports there). ``ignore``: given an event's
    descriptor, filters later opens of that file in the kernel if it cannot be a target
    (``host/fanotify.IgnoreMarks.add``); called before the first open of a file the hold
    does not name is allowed."""

    on_report: Callable[[], None] = lambda: None
    watch_fds: Mapping[int, Callable[[], None]] = field(default_factory=dict)
    after_step: Callable[[], None] = lambda: None
    ignore: Callable[[int], None] | None = None


class Responder:
    def __init__(
        self,
        source: EventSource,
        *,
        gate_open: Callable[[], bool],
        budget_s: float,
        verdicts: Callable[[], HeldVerdicts | None] | None = None,
        openers: Openers | None = None,
        caps: Caps | None = None,
        rounds: Rounds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``source``'s permission events answered while ``gate_open`` reads closed, each
        held at most ``budget_s``; ``verdicts``: the agent's verdict on each held
        nvidia-peermem file (``heldfiles.GO``, ``REBUILD``, ``WAIT``; one not listed goes
        by the gate), or None where there are none to read (the gate alone decides); how
        openers are read, the caps, and what else its rounds do: ``Openers``, ``Caps``,
        ``Rounds``."""
        o, c, r = openers or Openers(), caps or Caps(), rounds or Rounds()
        self.source = source
        self.gate_open = gate_open
        self.budget_s = budget_s
        self.own_pid = os.getpid() if o.own_pid is None else o.own_pid
        self.own_pids = frozenset({self.own_pid, *o.also_own})
        self.watch_fds = dict(r.watch_fds)
        self.after_step = r.after_step
        self.ignore = r.ignore
        self.clock = clock
        proc = self.proc = o.proc
        self.loader_of = o.loader_of or (lambda pid: is_loader(pid, proc))
        may_load = o.may_load
        if may_load is None:
            may_load = opener_may_load(proc) if o.loader_of is None else (lambda pid: None)
        self.may_load = may_load
        self.container_of = o.container_of or (lambda pid: mount_namespace(pid, proc))
        self.path_of = o.path_of
        self.verdicts = verdicts or (lambda: None)
        self.facts, self.files_changed = HeldFacts(o.facts_of), 0  # held files: a change bumps
        self.on_report = r.on_report
        self.held_per_container = c.held_per_container
        self.held_total = c.held_total
        self.burst_quiet_s = c.burst_quiet_s
        self.descriptors = c.descriptors
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
        self._bursts: dict[str, Burst] = {}  # by notice key; the responder thread's own
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

    def follow(self, is_open: bool, verdicts: object = None, judge_all: bool = False) -> None:
        """The gate changed, or its decision was renewed (``gate_open`` and ``verdicts``
        read them)."""
        self.wake()

    def wake(self) -> None:
        """The gate may have changed: look now (cheap, never blocks)."""
        self._wake.poke("gate")

    # A thread of the agent's: no process of its own, never adopted, never dies apart.
    pid: int | None = None
    adopted_from: dict[str, Any] | None = None
    died: str | None = None

    def held_count(self) -> int:
        with self._lock:
            return len(self._held)

    def ignore_status(self) -> dict[str, Any] | None:
        return None  # its caller's ignore marks (``ignore``), not its own

    def descriptors_in_use(self) -> int | None:
        return None  # its held opens' descriptors are the agent's own

    def held_files(self) -> list[dict[str, Any]]:
        """What the gate judges of each nvidia-peermem file held now (``read_held_fd``'s)."""
        with self._lock:
            return self.facts.described(h.file for h in self._held)

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
        name = fault_name(exc)
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
            burst = self._bursts[key] = Burst(began=now, last=now, kind=kind)
            burst.detail.update(first or {})
        burst.add(now, detail)

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
            self.notices.append(b.notice(self.held_per_container, self.held_total))
            self.reported += 1
        if ended:
            self.on_report()

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
        if not loader or (self.gate_open() and not self._judge_all(path)):
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
                held = _Held(event, name, path, self.clock(), container)
                self._held.append(held)
                self._per_container[container] += 1
        if not over and held_open(path) == "nvidia-peermem":
            self._read_facts(held)
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

    def _judge_all(self, path: str) -> bool:
        """An open gate that checked no file: an open of nvidia-peermem.ko waits for its own."""
        verdicts = self.verdicts() if held_open(path) == "nvidia-peermem" else None
        return verdicts is not None and verdicts.judge_all

    def _read_facts(self, held: _Held) -> None:
        """What the gate judges of the held file, read from the event's descriptor (once
        per identity while held); the agent hears of a new file at its next report."""
        try:
            with self._lock:
                key = self.facts.read(held.event, held.path, {h.file for h in self._held})
                known = any(h.file == key for h in self._held)
                held.file = key
        except Exception as exc:  # (it reads a file: never the end of the responder)
            self._fault(exc)
            return  # not identified: the gate alone decides for it
        if key is None:
            return
        if not known:
            self.files_changed += 1
            self.on_report()

    def _release(self, stopping: bool = False) -> None:
        """Answer held opens whose file's verdict (``GO``, ``REBUILD``; ``WAIT`` holds it
        whatever the gate) or gate opened, budget ran out, or opener went away."""
        if not self._held:  # (changed in this thread only)
            return
        with self._lock:
            if not self._held:
                return
            is_open = self.gate_open()
            verdicts = self.verdicts() if any(h.file for h in self._held) else None
            files = verdicts.files if verdicts is not None else {}
            judge_all = verdicts is not None and verdicts.judge_all
            now = self.clock()
            keep: list[_Held] = []
            done: list[tuple[_Held, str]] = []
            for h in self._held:
                code = files.get(h.file) if h.file else None
                if stopping:
                    done.append((h, "responder stopped"))
                elif code in ENDED:
                    done.append((h, ENDED[code]))
                elif is_open and code is None and not (judge_all and h.file):
                    done.append((h, "gate opened"))  # (not judged: the gate decides)
                elif now - h.began >= self.budget_s:
                    done.append((h, "budget expired"))
                elif not os.path.exists(f"{self.proc}/{h.event.pid}"):
                    done.append((h, "opener gone"))
                else:
                    keep.append(h)
            self._held = keep
            if done and {h.file for h, _ in done} - {h.file for h in keep} - {None}:
                self.files_changed += 1  # a file no longer held: the agent judges it no more
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
            self.reports.append(
                HoldReport(h.event.pid, h.opener, h.path, now - h.began, why, h.file)
            )
            self.reported += 1
        if done:
            self.on_report()
