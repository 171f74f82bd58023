"""Starting the hold: where it meets a kernel (``HoldHost``: the running one, or the
simulator's), the protocols its side drives, marking the roots, and ``start_hold`` (the
descriptor limit raised first, the caps fitted in it)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nodeagent.core.snapshot import HeldFileKey
from nodeagent.guards.peermem.adopt import (
    ADOPT_SOCKET,
    ADOPT_TIMEOUT_S,
    PEERCRED,
    open_state_dir,
    remove_socket_at,
    socket_path,
)
from nodeagent.guards.peermem.budget import Caps, DescriptorBudget, descriptor_budget
from nodeagent.guards.peermem.lease import HeldVerdicts, HoldLease
from nodeagent.guards.peermem.openers import Openers, event_path
from nodeagent.guards.peermem.process import ResponderProcess
from nodeagent.guards.peermem.reports import HoldReport
from nodeagent.guards.peermem.responder import Responder, Rounds
from nodeagent.host.fanotify import (
    EventSource,
    FanotifyGroup,
    OpenedRoot,
    PermEvent,
)


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
    apart (``guards/peermem/process.ResponderProcess``)."""

    reports: collections.deque[HoldReport]
    notices: collections.deque[dict[str, Any]]
    reported: int
    reports_lost: int  # reports pushed out before the loop read them
    descriptors: DescriptorBudget | None
    pid: int | None  # its own process's, or None (a thread of the agent's)
    adopted_from: dict[str, Any] | None  # what it said when this agent adopted it
    died: str | None  # how its process ended, if it did while it mattered

    def held_count(self) -> int:
        """Exact, where ``held`` may list only some."""
        ...

    def ignore_status(self) -> dict[str, Any] | None:
        """Its ignore marks (mode, how many), or None without them."""
        ...

    def descriptors_in_use(self) -> int | None:
        """Descriptors its own process holds, or None (a thread's are the agent's)."""
        ...

    @property
    def counts(self) -> dict[str, int]: ...

    def held(self) -> list[tuple[int, str, str, float]]: ...

    def alive(self) -> bool: ...

    def follow(
        self,
        is_open: bool,
        verdicts: Mapping[HeldFileKey, int] | None = None,
        judge_all: bool = False,
    ) -> None:
        """The gate now, and the verdicts on held files (a file not listed goes by the
        gate, unless ``judge_all``: it waits for one)."""
        ...

    def held_files(self) -> list[dict[str, Any]]:
        """What it read of each distinct nvidia-peermem file it holds now."""
        ...

    def wake(self) -> None: ...

    def stop(self, timeout: float = ...) -> None: ...


class HoldGroup(EventSource, Protocol):
    """A permission group the hold can mark: the kernel's fanotify group, or the
    simulator's."""

    unlimited_queue: bool  # the kernel took FAN_UNLIMITED_QUEUE (else overflows let opens go)
    queue_problem: str | None  # what a bounded queue means, said once

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
    # bounding set and user namespace under ``proc``; procfs.py).
    may_load: Callable[[int], str | None] | None = None
    # Why an opener cannot load a module now (default: ``opener_may_load`` under ``proc``).
    opener_may_load: Callable[[int], str | None] | None = None
    threaded: bool = True
    clock: Callable[[], float] = time.monotonic  # budgets and ages
    # What the gate judges of a held nvidia-peermem file (default: read from the event's
    # descriptor; the simulator's events carry none: ``heldfiles.read_held_path``).
    facts_of: Callable[[PermEvent, str], dict[str, Any]] | None = None
    # The responder in a process of its own (``guards/peermem/process.py``) when threaded:
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
    verdicts: Callable[[], HeldVerdicts | None] | None = None,
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
    (``spawner``; OSError when it does not answer); without it, a
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
            verdicts=verdicts,
            openers=Openers(
                proc=host.proc,
                path_of=host.path_of,
                may_load=host.opener_may_load,
                facts_of=host.facts_of,
            ),
            caps=Caps(budget.held_per_container, budget.held_total, descriptors=budget),
            rounds=Rounds(on_report=on_report),
            clock=host.clock,
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


def adopt(
    state_dir: str,
    *,
    budget_s: float,
    on_report: Callable[[], None] = lambda: None,
    proc: str = "/proc",
    timeout: float = ADOPT_TIMEOUT_S,
) -> ResponderProcess | None:
    """The responder a dead agent left in ``state_dir``, adopted: it goes on holding what it
    holds, answers this agent from now on, and gives it its group (to mark through), its
    lease and its eventfd. None when there is none to adopt (no socket; one nobody listens
    on is removed). OSError when one answered and the adoption failed: it was killed (what
    it held went on; the error says so), and the caller starts a new one; or it said its
    own agent lives (``busy``: left alone)."""
    try:
        dirfd = open_state_dir(state_dir)
    except FileNotFoundError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    got: list[int] = []
    pid = -1
    try:
        try:
            st = os.stat(ADOPT_SOCKET, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        try:
            sock.connect(socket_path(dirfd))
        except (ConnectionRefusedError, FileNotFoundError):  # its responder is gone: stale
            with contextlib.suppress(OSError):
                remove_socket_at(dirfd)
            return None
        pid, uid, _ = PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        )
        if uid != os.geteuid():
            raise OSError(f"the adoption socket's listener runs as uid {uid}")
        life_r, life_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        got += [life_w, out_r]
        try:
            request = json.dumps({"t": "adopt", "agent_pid": os.getpid()}).encode()
            socket.send_fds(sock, [request], [life_r, out_w])
        finally:
            os.close(life_r)
            os.close(out_w)
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        got += fds
        reply = json.loads(msg) if msg else {}
        if isinstance(reply, dict) and reply.get("t") == "busy":
            pid = -1  # its agent lives (never under the node's lock): left alone
            raise OSError("busy: the responder's own agent is alive; not adopted, not killed")
        if not isinstance(reply, dict) or reply.get("t") != "adopted" or len(fds) != 3:
            said = reply.get("t") if isinstance(reply, dict) else None
            raise OSError(f"answered {said!r}, not an adoption")
        if reply.get("pid") != pid:
            raise OSError(f"said pid {reply.get('pid')}, its socket another")
        group_fd, lease_fd, wake_fd = fds
        process = ResponderProcess(
            FanotifyGroup.adopt(group_fd),
            budget_s=budget_s,
            descriptors=None,  # (start_hold gives this agent's budget)
            on_report=on_report,
            proc=proc,
            adopt_dir=state_dir,
        )
        process._adopted(pid, HoldLease.adopt(lease_fd), wake_fd, life_w, out_r, reply)
        got.clear()  # (the process owns them now)
        return process
    except (OSError, ValueError) as exc:
        for fd in got:
            with contextlib.suppress(OSError):
                os.close(fd)
        if pid <= 0:
            raise OSError(str(exc)) from None
        with contextlib.suppress(OSError):  # it answered and could not be adopted: it must
            os.kill(pid, signal.SIGKILL)  # not hold on, unseen (what it held goes on)
        raise OSError(f"the responder {pid}: {exc}; killed") from None
    finally:
        sock.close()
        os.close(dirfd)


def spawner(
    group: FanotifyGroup,
    *,
    budget_s: float,
    on_report: Callable[[], None] = lambda: None,
    proc: str = "/proc",
    ignore_marks: str = "auto",
    track: Callable[[ResponderProcess], None] = lambda responder: None,
    adopt_dir: str | None = None,
) -> Callable[[DescriptorBudget], ResponderProcess]:
    """``start_hold``'s ``apart``: a responder process for ``group``, started (it answers
    before the hold marks anything); OSError when it does not. ``track``: given each one
    before it starts (a start off the loop thread keeps it to ``abort``; an OSError from
    it: not started)."""

    def start(descriptors: DescriptorBudget) -> ResponderProcess:
        responder = ResponderProcess(
            group,
            budget_s=budget_s,
            descriptors=descriptors,
            on_report=on_report,
            proc=proc,
            ignore_marks=ignore_marks,
            adopt_dir=adopt_dir,
        )
        track(responder)
        responder.start()
        return responder

    return start
