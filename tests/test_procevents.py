"""The kernel's process events connector as the container scanner uses it, on this kernel.

Run inside the Debian 6.1 guest too (the facts in ``nodeagent/host/procevents.py``)::

    .venv/bin/python -m tests.realkernel.vm .venv/bin/python -m pytest -q tests/test_procevents.py

A subscription is real (``NETLINK_CONNECTOR``); where this process cannot subscribe
(no ``CAP_NET_ADMIN``, not in the host's namespaces) the tests that need one are skipped
with the connector's own reason. The refusals themselves are real too: a child in a new
pid namespace, or a new network namespace, asks the same kernel.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.core.hold import DRIVER_CONTAINER_RULES
from nodeagent.guards.peermem.roots import BURST_LOOKS, RootScanner
from nodeagent.host.fanotify import OpenedRoot
from nodeagent.host.procevents import (
    CN_IDX_PROC,
    CN_MSG,
    CN_VAL_PROC,
    EVENT_HEAD,
    EXEC_DATA,
    NLMSG_DONE,
    NLMSGHDR,
    PROC_EVENT_EXEC,
    PROC_EVENT_NONE,
    ConnectorRefused,
    ExecEvents,
    _attach_filter,
    parse,
)
from tests.waiting import until


@pytest.fixture
def events() -> Iterator[ExecEvents]:
    try:
        ev = ExecEvents()
    except ConnectorRefused as exc:
        print(f"the connector refuses this process: {exc}")
        pytest.skip(f"the connector refuses this process: {exc}")
    try:
        yield ev
    finally:
        ev.close()


def _seen(ev: ExecEvents, pid: int) -> bool:
    return pid in ev.read()[0]


def test_a_real_exec_of_a_child_is_seen_with_its_new_command_line(events: ExecEvents) -> None:
    """The event comes after the new image is in place: the command line read then is the
    new one, a ``#!`` script's included (one event, after its interpreter is loaded)."""
    child = subprocess.Popen(["/bin/sh", "-c", "read x"], stdin=subprocess.PIPE)
    try:
        until(lambda: _seen(events, child.pid), "the child's exec was not seen")
        assert Path(f"/proc/{child.pid}/cmdline").read_bytes() == b"/bin/sh\0-c\0read x\0"
    finally:
        child.communicate(b"\n")
    assert events.execs >= 1 and events.overruns == 0


def _refusal_in(prefix: list[str]) -> str:
    code = (
        "from nodeagent.host.procevents import ExecEvents, ConnectorRefused\n"
        "try:\n    ExecEvents(ack_timeout_s=1.0).close(); print('SUBSCRIBED')\n"
        "except ConnectorRefused as e:\n    print('REFUSED', e)\n"
    )
    p = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
    )
    if p.returncode != 0:
        pytest.skip(f"{' '.join(prefix)} does not run here: {p.stderr.strip()[-200:]}")
    return p.stdout.strip()


@pytest.mark.parametrize(
    ("prefix", "why"),
    [
        # The kernel answers nothing outside the initial pid namespace.
        (["unshare", "--pid", "--fork"], "no answer to the subscription"),
        # 6.1 refuses to bind the group outside the host's user namespace; 6.6+ bind and
        # answer nothing: either way a refusal.
        (["unshare", "--user", "--map-root-user"], ""),
        # No connector in a network namespace other than the initial one.
        (["unshare", "--net"], "Connection refused"),
    ],
)
def test_outside_the_hosts_namespaces_the_connector_refuses(
    events: ExecEvents, prefix: list[str], why: str
) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    out = _refusal_in(prefix)
    assert out.startswith("REFUSED") and why in out, out


class NeverAcks:
    """A socket the kernel never answers (as outside the host's namespaces): every call
    takes, nothing ever arrives. The seam is ``ExecEvents(make_socket=...)``."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)

    def bind(self, address: tuple[int, int], /) -> None:
        pass

    def sendto(self, data: bytes, address: tuple[int, int], /) -> int:
        return len(data)

    def recv(self, bufsize: int, flags: int = 0, /) -> bytes:
        return self.a.recv(bufsize, flags)

    def setsockopt(self, level: int, optname: int, value: int | bytes, /) -> None:
        pass

    def getsockname(self) -> tuple[int, int]:
        return (0, 0)

    def setblocking(self, flag: bool, /) -> None:
        self.a.setblocking(flag)

    def fileno(self) -> int:
        return self.a.fileno()

    def close(self) -> None:
        self.a.close()
        self.b.close()


class FakeProc:
    """A ``/proc`` holding one process, pid 4242, whose root is an overlay (device 77)."""

    def __init__(self, tmp: Path, argv: bytes) -> None:
        self.dir = tmp / "proc"
        (self.dir / "4242").mkdir(parents=True)
        self.set_cmdline(argv)
        self.marks: set[int] = set()

    def set_cmdline(self, argv: bytes) -> None:
        (self.dir / "4242" / "cmdline").write_bytes(argv)

    def scanner(self, **kw: object) -> RootScanner:
        def dev_of(path: str) -> int | None:
            return {"1": 1, "self": 2}.get(path.split("/")[-2], 77)

        def open_root(path: str) -> OpenedRoot | None:
            return OpenedRoot(
                77, 0x794C7630, lambda: self.marks.add(77), lambda: None, lambda: None
            )

        return RootScanner(
            open_root,
            lambda: set(self.marks),
            DRIVER_CONTAINER_RULES,
            proc=str(self.dir),
            dev_of=dev_of,
            may_load=lambda pid: None,
            **kw,  # type: ignore[arg-type]
        )


DRIVER = b"/bin/sh\0/usr/local/bin/nvidia-driver\0init\0"


def test_no_ack_means_refused_and_the_scanner_polls_every_interval(tmp_path: Path) -> None:
    with pytest.raises(ConnectorRefused, match=r"no answer to the subscription within 0\.2 s"):
        ExecEvents(make_socket=NeverAcks, ack_timeout_s=0.2)
    fake = FakeProc(tmp_path, b"sleep\0")
    scanner = fake.scanner(exec_events=lambda: ExecEvents(make_socket=NeverAcks, ack_timeout_s=0.2))
    scanner.start()
    try:
        until(lambda: scanner.mode != "starting", "the scanner did not choose a mode")
        assert scanner.mode.startswith("polling /proc every 0.1 s: the process events connector")
        assert "no answer to the subscription" in scanner.mode
        problems = [r["problem"] for r in list(scanner.reports) if r["kind"] == "state-problem"]
        assert any("polling /proc every 0.1 s" in p for p in problems)
        fake.set_cmdline(DRIVER)  # young: the poll reads it again and marks it
        until(lambda: scanner.roots(), "the polling scanner did not mark the root")
        assert scanner.status()["mode"] == scanner.mode
    finally:
        scanner.stop()


def test_events_lost_are_a_full_rescan_that_reads_every_command_line(tmp_path: Path) -> None:
    """Pure bookkeeping: a process read and settled that exec'd while events were lost is
    read again by ``scan(reread_all=True)``, never by a plain scan."""
    fake = FakeProc(tmp_path, b"runc\0init\0")
    scanner = fake.scanner(recheck_s=0.0, exec_events=None)
    scanner.prepare()
    scanner.scan()  # read once, too old to be read again
    fake.set_cmdline(DRIVER)  # its exec, whose event was lost
    scanner.scan()
    assert scanner.roots() == []
    scanner.scan(reread_all=True)
    assert [r.pid for r in scanner.roots()] == [4242]


def test_a_real_overrun_is_counted_and_rescanned_at_once(
    tmp_path: Path, events: ExecEvents
) -> None:
    """A real ``ENOBUFS``: a receive buffer of the kernel's minimum, the scanner held inside
    one exec's handling (its clock blocks) while 200 children exec. The full scan's period
    is an hour, so only the rescan on the loss reads the settled process that exec'd into
    the entrypoint meanwhile."""
    fake = FakeProc(tmp_path, b"runc\0init\0")
    gate = threading.Event()
    gate.set()
    blocked = threading.Event()

    def clock() -> float:
        if not gate.is_set():
            blocked.set()
            gate.wait()
        return 0.0

    scanner = fake.scanner(
        recheck_s=0.0,
        full_scan_s=3600.0,
        clock=clock,
        exec_events=lambda: ExecEvents(rcvbuf=1),
    )
    scanner.start()
    try:
        until(lambda: scanner.mode == "exec events", f"no exec events: {scanner.mode}")
        until(lambda: 4242 in scanner._settled, "the first full scan did not read pid 4242")
        gate.clear()
        subprocess.run(["/bin/true"])
        until(blocked.is_set, "the scanner did not take the exec")
        for _ in range(200):
            subprocess.run(["/bin/true"])
        fake.set_cmdline(DRIVER)
        gate.set()
        until(lambda: scanner.roots(), "the root was not marked after the loss")
        status = scanner.status()
        assert status["overruns"] >= 1 and status["rescans_after_loss"] >= 1, status
    finally:
        gate.set()
        scanner.stop()


def _event(what: int, tgid: int) -> bytes:
    """A connector message as the kernel sends one: nlmsghdr, cn_msg, proc_event."""
    body = EVENT_HEAD.pack(what, 0, 0) + EXEC_DATA.pack(tgid, tgid)
    cn = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(body), 0) + body
    return NLMSGHDR.pack(NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def test_the_socket_filter_keeps_exec_events_and_acks_only() -> None:
    """The classic BPF program the subscription attaches, on a socket pair of this
    kernel (a filter on any socket runs the same): an exec and an ack pass, a fork, an
    exit and a message too short to hold an event are dropped before they are queued,
    so they never wake the reader (6.1 sends every fork and exit to a listener)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _attach_filter(a)
        a.setblocking(False)
        PROC_EVENT_FORK, PROC_EVENT_EXIT = 0x1, 0x80000000
        for what, tgid in ((PROC_EVENT_FORK, 11), (PROC_EVENT_EXEC, 12), (PROC_EVENT_EXIT, 13)):
            b.send(_event(what, tgid))
        b.send(_event(PROC_EVENT_NONE, 14))
        b.send(b"\x10\0\0\0" + bytes(12))  # a bare nlmsghdr: the load past its end drops it
        got = []
        while True:
            try:
                got += parse(a.recv(8192))
            except BlockingIOError:
                break
        assert [(what, value) for what, _ack, value in got] == [
            (PROC_EVENT_EXEC, 12),
            (PROC_EVENT_NONE, 14),  # an ack's err is where an exec's pid would be
        ]
    finally:
        a.close()
        b.close()


def test_a_fork_and_exit_without_exec_queues_nothing(events: ExecEvents) -> None:
    """On this kernel: a child that forks and exits without an exec leaves nothing in the
    subscription's queue (6.6+ by the event mask, 6.1 by the socket filter), and the
    exec that follows is the one thing there."""
    assert events.filtered
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    pids, lost = events.wait(10.0)  # the exec's event, or the hang detector's bound
    assert (pids, lost) == ([child.pid], False)
    with pytest.raises(BlockingIOError):
        events.sock.recv(8192, socket.MSG_DONTWAIT)


def test_wake_returns_a_waiter_blocked_in_the_sockets_recv(events: ExecEvents) -> None:
    """``wait`` blocks in ``recv`` itself, with an hour's timeout here; ``wake`` from
    another thread returns it (a message to the socket's own port id), with no event."""
    out: list[tuple[list[int], bool]] = []
    waiter = threading.Thread(target=lambda: out.append(events.wait(3600.0)), daemon=True)
    waiter.start()
    until(lambda: events.wakes == 0 and waiter.is_alive(), "the waiter did not start")
    events.wake()
    waiter.join(10.0)  # a hang detector: without the wake, an hour
    assert not waiter.is_alive() and events.wakes == 1
    assert out[0][1] is False and all(p > 0 for p in out[0][0])  # no event made up


def test_a_stream_of_execs_is_looked_at_a_bounded_number_of_times(tmp_path: Path) -> None:
    """A lone exec is looked at at once; a stream (here 300 execs as fast as this machine
    makes them) at most once every ``batch_s`` after a burst of ``BURST_LOOKS``: the scanner's
    cost under an exec storm is bounded, whoever makes it. Every event is still read
    (the subscription's count)."""
    fake = FakeProc(tmp_path, b"sleep\0")
    scanner = fake.scanner(batch_s=0.2, full_scan_s=3600.0)
    scanner.start()
    try:
        until(lambda: scanner.mode != "starting", "no mode")
        if scanner.mode != "exec events":
            print(f"no exec events here: {scanner.mode}")
            pytest.skip(f"no exec events here: {scanner.mode}")
        before = scanner.status()
        start = time.monotonic()
        for _ in range(300):
            subprocess.run(["/bin/true"], check=True)

        def read_all() -> bool:
            return scanner.status()["exec_events"] - before["exec_events"] >= 300

        until(read_all, "not every exec was read")
        elapsed = time.monotonic() - start
        looks = scanner.status()["looks"] - before["looks"]
        assert looks <= 3 + BURST_LOOKS + elapsed / 0.2, (looks, elapsed)
        assert looks < 100, looks  # one a wake would be about one an exec
    finally:
        scanner.stop()


def test_a_container_root_whose_mark_failed_is_marked_once_marks_free_up(tmp_path: Path) -> None:
    """``ENOSPC`` (``max_user_marks`` spent): the match is named once, then tried again at
    full scans a period apart while it runs, and marked when the kernel takes the mark.
    Before, a failed mark settled the pid: its loads went unheld for its whole life."""
    fake = FakeProc(tmp_path, DRIVER)
    full = 0.0
    scanner = fake.scanner(exec_events=None, full_scan_s=2.0, clock=lambda: full)
    refuse = [True]

    def mark() -> None:
        if refuse[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fake.marks.add(77)

    scanner.open_root = lambda path: OpenedRoot(77, 0x794C7630, mark, lambda: None, lambda: None)
    scanner.prepare()
    scanner.scan()
    assert scanner.roots() == []
    (said,) = [r["problem"] for r in scanner.reports if r["kind"] == "state-problem"]
    assert "cannot mark its root: No space left on device; tried again every 2 s" in said
    full = 1.0
    scanner.scan()  # within the period: not tried again, not named again
    full = 2.5
    scanner.scan()  # tried again, refused again: still said once
    assert scanner.roots() == [] and len(scanner.refused) == 1
    refuse[0] = False  # marks freed
    full = 5.0
    scanner.scan()
    assert [r.pid for r in scanner.roots()] == [4242] and fake.marks == {77}
    assert [r["kind"] for r in scanner.reports] == ["state-problem", "hold-root-marked"]
    assert not scanner.refused  # status's "not_marked" no longer lists it


def test_a_starts_burst_of_execs_is_looked_at_exec_by_exec(tmp_path: Path) -> None:
    """A container's start is a burst of a few execs (runtime, ``runc init``, the
    entrypoint): each of the first ``BURST_LOOKS`` is a look of its own, waiting for
    nothing; then, a stream now, the scanner waits for the pace (``batch_s``) before it
    reads again. Stepped with a fake subscription: the scanner's every pause is recorded."""

    pauses: list[float] = []

    def pause(seconds: float) -> bool:
        pauses.append(seconds)
        return True  # stopping: the test ends at the first pause

    class Events:
        execs = overruns = 0

        def __init__(self) -> None:
            self.n = 0

        def wait(self, timeout_s: float) -> tuple[list[int], bool]:
            self.n += 1
            return [10_000 + self.n], False

        def read(self, most: int = 512) -> tuple[list[int], bool]:
            return [], False

    fake = FakeProc(tmp_path, b"sleep\0")
    scanner = fake.scanner(batch_s=60.0, full_scan_s=3600.0)
    scanner.prepare()
    scanner._pause = pause  # type: ignore[method-assign]
    events = Events()
    scanner._follow_execs(events)  # type: ignore[arg-type]
    assert scanner.looks == BURST_LOOKS  # each at once, no wait among them
    assert events.n == BURST_LOOKS and len(pauses) == 1
    assert 59.0 < pauses[0] <= 60.0  # the bucket empty: the next look waits its token


def test_a_long_pace_ends_at_stop(tmp_path: Path) -> None:
    """The pace sleeps in slices (``PAUSE_SLICE_S``), so a stop is seen within one, even
    with the longest ``hold_scan_seconds``. A hang detector: the bound is seconds, the
    failure (no slices) a minute."""
    scanner = FakeProc(tmp_path, b"sleep\0").scanner(batch_s=60.0, full_scan_s=3600.0)
    said: list[bool] = []
    sleeper = threading.Thread(target=lambda: said.append(scanner._pause(60.0)))
    sleeper.start()
    scanner._stop.set()
    sleeper.join(10.0)
    assert not sleeper.is_alive() and said == [True]
