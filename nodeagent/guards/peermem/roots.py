"""Finds each GPU driver container as it starts and marks its root for the peermem hold
(``RootScanner``). How new processes are noticed, which are marked and why, and how a
mark is kept: the wing's ``__init__.py``, "Container roots"."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nodeagent.core.hold import matching_rule, split_cmdline
from nodeagent.guards.peermem import procfs
from nodeagent.guards.peermem.procfs import ContainerRoot
from nodeagent.host.fanotify import OpenedRoot
from nodeagent.host.procevents import ConnectorRefused, ExecEvents

OVERLAYFS_SUPER_MAGIC = 0x794C7630
CMDLINE_BYTES = 4096
FULL_SCAN_S = 2.0  # with exec events: the safety net's period
BURST_LOOKS = 8  # with exec events: looks at once before the batch's pace (a start's burst)
PAUSE_SLICE_S = 0.5  # the pace's sleep, at most, between two looks at ``stop``


class RootScanner:
    """Finds driver containers as they exec (or by polling ``/proc``) and marks each new
    root; reports go to ``reports`` (records for the loop) and ``on_report`` is called (it
    must not block)."""

    def __init__(
        self,
        open_root: Callable[[str], OpenedRoot | None],
        marked_devices: Callable[[], set[int]],
        rules: Sequence[str],
        *,
        proc: str = "/proc",
        interval_s: float = 0.1,
        recheck_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_report: Callable[[], None] = lambda: None,
        dev_of: Callable[[str], int | None] | None = None,
        may_load: Callable[[int], str | None] | None = None,
        exec_events: Callable[[], ExecEvents] | None = ExecEvents,
        full_scan_s: float = FULL_SCAN_S,
        batch_s: float | None = None,
    ) -> None:
        """``open_root``: the group's (``FanotifyGroup.open_root``): a root resolved once,
        checked and marked through that one resolution. ``dev_of``: a path's device (the
        host's root, a container's liveness; ``stat``). ``may_load``: why a pid can never
        load a module, or None (``procfs.module_loader_check``; the simulator gives its own).
        ``exec_events``: subscribes to the kernel's exec events or raises
        ``ConnectorRefused`` (None: poll only); with them, the full scan runs every
        ``full_scan_s``, else every ``interval_s``; ``batch_s``: with them, the least time
        between two looks at exec'd processes under a stream of execs (a lone exec is
        looked at at once); ``interval_s`` unless given: one bound on how late a driver
        container is noticed, whichever way (``hold_scan_seconds``)."""
        self.open_root = open_root
        self.marked_devices = marked_devices
        self.rules = tuple(rules)
        self.proc = proc
        self.interval_s = interval_s
        self.recheck_s = recheck_s
        self.exec_events = exec_events
        self.full_scan_s = full_scan_s
        self.batch_s = interval_s if batch_s is None else batch_s
        self.mode = "starting"  # for status: "exec events" or "polling /proc every ...: why"
        self.rescans = 0  # full scans at once after events were lost
        self._events: ExecEvents | None = None
        self.clock = clock
        self.on_report = on_report
        self._dev = dev_of or procfs.stat_dev
        self.may_load = may_load or procfs.module_loader_check(proc)
        self.reports: collections.deque[dict[str, Any]] = collections.deque(maxlen=1024)
        self.reported = 0  # reports ever added (the deque is drained by the loop)
        self.scans = 0
        self.looks = 0
        self._young: dict[int, float] = {}  # pid -> first seen: its command is read again
        self._not_yet: dict[int, tuple[str, str]] = {}  # young matches not markable yet: why
        self._settled: set[int] = set()  # pids read for the last time (matched or too old)
        # Matches whose root's mark failed: pid -> (first seen, last tried); retried.
        self._mark_failed: dict[int, tuple[float, float]] = {}
        self._roots: dict[int, ContainerRoot] = {}  # dev -> root
        # The last matches refused, for status: (pid, command, why); bounded.
        self.refused: collections.deque[tuple[int, str, str]] = collections.deque(maxlen=16)
        self._lock = threading.Lock()  # guards _roots for readers (status)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hold-root-scanner", daemon=True)
        self._host_dev: int | None = None
        self._own_dev: int | None = None  # the agent's own root: never marked
        self._problem_said: set[str] = set()

    # -- the loop's side -------------------------------------------------------

    def prepare(self) -> None:
        """Read what the host's own root is (``start`` does it; a stepped caller too)."""
        self._host_dev = self._dev(f"{self.proc}/1/root")
        self._own_dev = self._dev(f"{self.proc}/self/root")

    def start(self) -> None:
        self.prepare()
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        events = self._events  # set before the thread's first wait, or the stop is seen
        if events is not None:
            events.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def roots(self) -> list[ContainerRoot]:
        with self._lock:
            return sorted(self._roots.values(), key=lambda r: r.marked_at)

    # -- the scanner ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """How new processes are noticed, for status: the mode and its counters."""
        events = self._events
        return {
            "mode": self.mode,
            "full_scans": self.scans,
            "looks": self.looks,  # wakes that read exec'd processes (exec events)
            "exec_events": events.execs if events is not None else 0,
            "overruns": events.overruns if events is not None else 0,
            "rescans_after_loss": self.rescans,
        }

    def _run(self) -> None:
        self.scan()  # at once: a refused subscription takes its ack timeout
        why = ""
        if self.exec_events is not None:
            try:
                self._events = self.exec_events()
            except ConnectorRefused as exc:
                why = f"the process events connector refused: {exc}"
            except OSError as exc:
                why = f"the process events connector failed: {exc.strerror or exc}"
        if self._events is not None:
            self.mode = "exec events"
            try:
                self._follow_execs(self._events)
                return
            except OSError as exc:  # the socket failed: the poll takes over
                why = f"exec events failed: {exc.strerror or exc}"
            finally:
                self._events.close()
        self.mode = f"polling /proc every {self.interval_s:g} s: {why or 'exec events off'}"
        if why:
            self._problem(self.mode)
        while not self._stop.wait(self.interval_s):
            self.scan()

    def _follow_execs(self, events: ExecEvents) -> None:
        """Subscribed before the first full scan, so no exec falls between the two. An
        exec'd process is read as its event arrives: a runtime's ``runc init`` becomes the
        entrypoint at that exec. The full scan every ``full_scan_s`` is the safety net for
        what the kernel drops without a word (an event it cannot allocate); a loss the
        socket reports (``ENOBUFS``) is a full scan at once, every command line read.

        The thread blocks in the socket's ``recv`` (``ExecEvents.wait``): one system call
        a wake, the cost of a node's exec rate. Its timeout is one of two fixed values
        (the full scan's period; ``interval_s`` while a match waits to be markable), and
        whether a full scan is due is asked at every wake: under a steady trickle of execs
        the scan still comes on time, and idle it comes within one more period."""
        self.scan()
        next_full = self.clock() + self.full_scan_s
        # Looks are rate-limited by a token bucket (real time, not ``clock``: it paces
        # wakes): BURST_LOOKS at once, then one every ``batch_s``. A container's start is a
        # burst of a few execs (runtime, shim, ``runc init``, the entrypoint): each looked
        # at as it comes. A stream drains the bucket: then a look waits for its token, and
        # the events that came meanwhile are read in that one wake, where each exec was a
        # wake of its own (~80-120 µs of this thread's CPU here before any work), and a
        # process that exec'd and exited in between (most of a busy node's execs) costs a
        # failed open (~5 µs), not the first read of a new pid's files (~40 µs).
        tokens, refilled = float(BURST_LOOKS), time.monotonic()
        while not self._stop.is_set():
            pids, lost = events.wait(self.interval_s if self._not_yet else self.full_scan_s)
            if self._stop.is_set():
                return
            if pids or lost:
                if self.batch_s > 0:
                    now = time.monotonic()
                    tokens = min(BURST_LOOKS, tokens + (now - refilled) / self.batch_s)
                    refilled = now
                    if tokens < 1:
                        if self._pause((1 - tokens) * self.batch_s):
                            return
                        tokens, refilled = 1.0, time.monotonic()
                    tokens -= 1
                more, lost_more = events.read()  # the rest already queued, in the same wake
                pids, lost = list(dict.fromkeys(pids + more)), lost or lost_more
                self.looks += 1
            if lost:
                self.rescans += 1
                self.scan(reread_all=True)
                next_full = self.clock() + self.full_scan_s
            else:
                for pid in pids:
                    self.exec_seen(pid)
                if self._not_yet:
                    self.recheck_not_yet()
                if self.clock() >= next_full:
                    self.scan()
                    next_full = self.clock() + self.full_scan_s
            if self.batch_s > 0 and tokens < 1:
                # The bucket is empty (a stream): wait for the next token now, so that
                # the events coming meanwhile are there when ``wait`` is called, and it
                # returns without sleeping: one wake a look, not two.
                if self._pause((1 - tokens) * self.batch_s):
                    return
                tokens, refilled = 1.0, time.monotonic()

    def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` of the pace; True when the scanner is stopping. A plain
        ``sleep`` (one system call), not ``Event.wait`` (a lock made and taken twice): a
        wake of this thread cost ~50 against ~90 µs of its CPU here, ten times a second
        under a stream of execs. ``stop`` is seen within ``PAUSE_SLICE_S``."""
        end = time.monotonic() + seconds
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, PAUSE_SLICE_S))
        return True

    def exec_seen(self, pid: int) -> None:
        """``pid`` exec'd: read its command line now (the young window restarts)."""
        now = self.clock()
        self._young.pop(pid, None)
        if self._check(pid, now) or pid not in self._not_yet:
            self._settled.add(pid)  # its next change of command is another exec
        else:
            self._young[pid] = now  # a match not markable yet: its window starts
            self._settled.discard(pid)

    def recheck_not_yet(self) -> None:
        """Look again at young matches not markable yet; name those whose window ended."""
        now = self.clock()
        for pid in list(self._not_yet):
            first = self._young.get(pid, now)
            done = self._check(pid, first)
            if done or now - first >= self.recheck_s:
                self._young.pop(pid, None)
                self._settled.add(pid)
                refused = self._not_yet.pop(pid, None)
                if refused is not None and not done:
                    self._refuse(pid, *refused)

    def scan(self, *, reread_all: bool = False) -> None:
        """One look at ``/proc``: mark new driver containers' roots, retire gone ones.
        ``reread_all``: every process's command line read again (exec events were lost:
        any process may have exec'd since it was read)."""
        self.scans += 1
        now = self.clock()
        try:
            pids = {int(n) for n in os.listdir(self.proc) if n.isdigit()}
        except OSError as exc:
            self._problem(f"cannot list {self.proc}: {exc.strerror or exc}")
            return
        self._settled &= pids
        self._retire()  # first: a freed overlay's device number may be reused at once
        young = {p: t for p, t in self._young.items() if p in pids}
        for pid in pids - self._settled - young.keys():
            young[pid] = now
        if reread_all:
            for pid in self._settled & pids:
                if not self._check(pid, now) and pid in self._not_yet:
                    young[pid] = now  # a match not markable yet: its window starts
                    self._settled.discard(pid)
        for pid, first in list(young.items()):
            done = self._check(pid, first)
            if done or now - first >= self.recheck_s:
                del young[pid]
                self._settled.add(pid)
                refused = self._not_yet.pop(pid, None)
                if refused is not None and not done:  # still not markable at its window's end
                    self._refuse(pid, *refused)
        self._not_yet = {p: why for p, why in self._not_yet.items() if p in young}
        self._young = young
        self._retry_marks(pids, now)

    def _retry_marks(self, pids: set[int], now: float) -> None:
        """Try again the roots whose mark failed, once a full scan period after the last
        try, while their process runs; a process gone is let go."""
        for pid, (first_seen, tried) in list(self._mark_failed.items()):
            if pid not in pids:
                del self._mark_failed[pid]
            elif now - tried >= self.full_scan_s:
                self._check(pid, first_seen)

    def _check(self, pid: int, first_seen: float) -> bool:
        """True when ``pid`` needs no further look (matched and handled)."""
        try:
            argv = split_cmdline(procfs.read_head(f"{self.proc}/{pid}/cmdline", CMDLINE_BYTES))
        except OSError:
            return False  # gone, or a kernel thread racing: the listing settles it
        rule = matching_rule(argv, self.rules)
        command = " ".join(argv)[:200]
        if rule is None:
            return self._check_member(pid, first_seen, command)
        cannot = self.may_load(pid)
        if cannot is not None:
            # Not final while it is young: a runtime drops capabilities before the exec
            # that makes the entrypoint, never after; a process gone reads unreadable.
            self._not_yet[pid] = (command, f"{cannot}; not marked")
            return False
        root = f"{self.proc}/{pid}/root"
        opened = self.open_root(root)
        if opened is None:
            self._not_yet[pid] = (command, f"cannot open {root}")
            return False
        try:
            return self._mark(pid, first_seen, rule, command, opened)
        finally:
            opened.close()

    def _check_member(self, pid: int, first_seen: float, command: str) -> bool:
        """A process of a marked driver container whose root is a new filesystem: that
        root checked and marked like the container's first. True once handled.

        A driver container's process that ``chroot``s into a new overlay (or is
        ``exec``'d into the container, then does) loads from a root nobody marked, and its
        command line matches no rule. Its mount namespace is the container's (a
        ``chroot`` keeps it; joining it takes ``CAP_SYS_ADMIN`` over it). Asked only while
        a root is marked: a ``stat`` of ``/proc/<pid>/ns/mnt`` (and of its root when the
        namespace is a marked container's) per process looked at. A new root that cannot
        be marked (the host's, the agent's, not an overlay) is named once per container
        and filesystem, not each time a process runs there; a process that can never
        load a module is left alone."""
        with self._lock:
            marked = {r.mount_ns: r for r in self._roots.values() if r.mount_ns is not None}
        if not marked:
            return False
        ns = procfs.ns_id(f"{self.proc}/{pid}/ns/mnt")
        container = marked.get(ns) if ns is not None else None
        if container is None:
            return False
        dev = self._dev(f"{self.proc}/{pid}/root")
        with self._lock:
            if dev is None or dev in self._roots:
                return dev is not None  # a root already marked: nothing new
        if self.may_load(pid) is not None:
            return True
        opened = self.open_root(f"{self.proc}/{pid}/root")
        if opened is None:
            return False
        try:
            what = self._unmarkable(opened)
            if what is not None:
                self._problem(
                    f"a process of the driver container pid {container.pid} runs in "
                    f"{os.major(opened.dev)}:{os.minor(opened.dev)}, {what}: its loads "
                    "from there are not held"
                )
                return True
            rule = f"{container.rule} (a new root in its container, pid {container.pid})"
            return self._mark(pid, first_seen, rule, command, opened)
        finally:
            opened.close()

    def _unmarkable(self, opened: OpenedRoot) -> str | None:
        """Why a root may not be marked (the host's, the agent's, not an overlay), or None."""
        if opened.dev == self._host_dev:
            return "the host's own root"
        if opened.dev == self._own_dev:
            return "the agent's own root"
        if opened.fs_type != OVERLAYFS_SUPER_MAGIC:
            return "not an overlay"
        return None

    def _mark(
        self, pid: int, first_seen: float, rule: str, command: str, opened: OpenedRoot
    ) -> bool:
        """Check and mark one resolution of a matching process's root."""
        dev = opened.dev
        with self._lock:
            known = dev in self._roots
        marks = self._kernel_marks() if known else None
        if known and (marks is None or dev in marks):
            return True  # another process of a container already marked
        what = self._unmarkable(opened)
        if what is not None:
            # Not final while it is young: a wrapper (``chroot DIR nvidia-driver init``)
            # matches before its chroot; the entrypoint after it has the overlay root.
            self._not_yet[pid] = (command, f"its root is {what}; not marked")
            return False
        try:
            opened.mark()
        except OSError as exc:
            # Retried at full scans while the process runs (ENOSPC: the marks of
            # ``max_user_marks`` may free up); named once, not at every try.
            if pid not in self._mark_failed:
                self._refuse(
                    pid,
                    command,
                    f"cannot mark its root: {exc.strerror or exc}; tried again every "
                    f"{self.full_scan_s:g} s while it runs",
                )
            self._mark_failed[pid] = (first_seen, self.clock())
            return True
        if self._mark_failed.pop(pid, None) is not None:  # no longer "not marked"
            kept = [r for r in self.refused if r[0] != pid]
            self.refused.clear()
            self.refused.extend(kept)
        after = self._kernel_marks()
        if after is not None and dev not in after:  # what was checked is not what is marked
            with contextlib.suppress(OSError):
                opened.unmark()
            self._refuse(pid, command, "the kernel lists no mark on the root checked; unmarked")
            return True
        now = self.clock()
        mount_ns = procfs.ns_id(f"{self.proc}/{pid}/ns/mnt")
        started = procfs.start_time(self.proc, pid)
        marked = ContainerRoot(dev, pid, rule, command, now, now - first_seen, mount_ns, started)
        with self._lock:
            self._roots[dev] = marked
        self._report(
            {
                "kind": "hold-root-marked",
                "pid": pid,
                "dev": marked.dev_text(),
                "rule": rule,
                "command": command,
                "noticed_ms": round(marked.noticed_s * 1000, 1),
            }
        )
        return True

    def _retire(self) -> None:
        """Drop roots the kernel no longer marks (their superblock went with the container)."""
        with self._lock:
            if not self._roots:
                return
        kernel = self._kernel_marks()
        if kernel is None:
            return
        with self._lock:
            gone = [r for dev, r in self._roots.items() if dev not in kernel]
            for r in gone:
                del self._roots[r.dev]
        for r in gone:
            self._report(
                {
                    "kind": "hold-root-gone",
                    "pid": r.pid,
                    "dev": r.dev_text(),
                    "container_alive": self._alive(r),
                    "seconds": round(self.clock() - r.marked_at, 3),
                }
            )

    def _alive(self, root: ContainerRoot) -> bool:
        """Whether the process that led to ``root`` still runs, asked after the kernel's
        marks were read: its pid's root resolves, and the pid is still that process (its
        start time as at the mark; a pid reused within one scan is another process).

        Not "listed in ``/proc``": a zombie is listed until its parent reaps it, and
        the listing was taken before the marks, so a container that exited between
        the two was listed but its overlay already gone. The kernel lets go of a
        process's root (``exit_fs``) before its mount namespace, so once a mark went
        with the namespace, a root that still resolves is a process still running.
        """
        if self._dev(f"{self.proc}/{root.pid}/root") is None:
            return False
        return root.start_time is None or procfs.start_time(self.proc, root.pid) == root.start_time

    def _kernel_marks(self) -> set[int] | None:
        try:
            return self.marked_devices()
        except OSError as exc:
            self._problem(f"cannot read the group's marks: {exc.strerror or exc}")
            return None

    def _refuse(self, pid: int, command: str, why: str) -> None:
        self.refused.append((pid, command, why))
        self._report(
            {
                "kind": "state-problem",
                "problem": f"peermem.hold_containers: {command} (pid {pid}): {why}",
            }
        )

    def _problem(self, text: str) -> None:
        if text not in self._problem_said:  # once: the scan repeats every interval
            self._problem_said.add(text)
            self._report({"kind": "state-problem", "problem": f"peermem.hold_containers: {text}"})

    def _report(self, rec: dict[str, Any]) -> None:
        self.reports.append(rec)
        self.reported += 1
        with contextlib.suppress(Exception):
            self.on_report()
