"""Each ``exec`` on the host, as it happens: the kernel's process events connector.

A raw ``NETLINK_CONNECTOR`` socket bound to the ``CN_IDX_PROC`` group, a
``PROC_CN_MCAST_LISTEN`` sent to the kernel, then ``PROC_EVENT_EXEC`` messages
(the exec'd process's pid) read as they come. The container scanner
(``host/containers.py``) reads the command line of exec'd processes only.

Kernel facts this relies on, each checked on this machine's kernel (6.18) and in
the Debian 6.1 guest (``tests/test_procevents.py``, run in both: the command is
in ``docs/design.md``, "Container scan: exec events"):

- The subscription is acknowledged by a ``PROC_EVENT_NONE`` message whose
  ``cn_msg.ack`` is ours plus one and whose ``err`` is the verdict (0
  accepted; 6.1 answers ``EPERM`` without ``CAP_NET_ADMIN``). Its ``seq`` is
  not ours: the kernel writes its own per-CPU counter there. The ack is
  multicast to the group, so every listener sees every other's acks: ours is
  told apart by a random ``ack``.
- A subscriber outside the initial user or pid namespace gets no ack at all
  (``cn_proc_mcast_ctl`` returns before acking): no ack within
  ``ACK_TIMEOUT_S`` means refused. Binding the group outside the initial user
  namespace fails on 6.1 already (``EPERM``: ``CAP_NET_ADMIN`` over the
  network namespace); 6.6+ lets anyone bind ``CN_IDX_PROC`` and still never
  acks. In a network namespace other than the initial one the kernel has no
  connector socket: the ``sendto`` fails (``ECONNREFUSED``), hence
  ``hostNetwork``.
- ``pid`` and ``tgid`` in the events are the initial pid namespace's
  (``hostPID``, which the hold needs anyway). The event is sent once the new
  image is loaded: ``/proc/<pid>/cmdline`` already reads the new command
  line (a ``#!`` script's too: one event after its interpreter is loaded).
- A socket that cannot queue an event loses it and its next ``recv`` fails
  once with ``ENOBUFS``; reading then goes on. ``overruns`` counts those, and
  the reader must look at everything again (the scanner rescans at once).
  The kernel also drops an event silently when it cannot allocate it
  (``GFP_NOWAIT``): the scanner keeps a slow full scan for that.
- 6.6+ take an 8-byte request (``struct proc_input``: the op and an event
  mask) and then send this socket ``EXEC`` events only: fork and exit, twice
  as many, never reach it, and neither do acks (``PROC_EVENT_NONE`` is
  filtered out too, its own included). 6.1 ignores that length without an
  ack. So the 4-byte ``LISTEN`` (every kernel) goes first and its ack
  decides; the filtered one follows, answered by nothing.
- On 6.1 a socket closed while listening leaves the kernel's listener count
  raised (6.6+ drop it on release): ``close`` sends ``IGNORE`` first.

Why not pyroute2's ``ProcEventSocket`` (a dependency already): its
``control(listen=True)`` waits for an answer without a timeout (a refused
subscription never gets one: the agent's scanner would hang), takes any
listener's ack as its own, and decodes every event into a message object,
while the scanner needs two integers from one message in three.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0
PROC_EVENT_EXEC = 0x2
NLMSG_DONE = 3
SO_RCVBUFFORCE = 33

NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
EVENT_HEAD = struct.Struct("=IIQ")  # what, cpu, timestamp_ns (aligned 8 in the kernel)
EXEC_DATA = struct.Struct("=II")  # process_pid, process_tgid
ACK_DATA = struct.Struct("=I")  # err
CN_OFFSET = NLMSGHDR.size
EVENT_OFFSET = NLMSGHDR.size + CN_MSG.size

ACK_TIMEOUT_S = 1.0
RECV_BYTES = 8192  # one event is 76 bytes; a datagram carries one
DRAIN_MAX = 512  # datagrams read in one drain, at most (then the caller loops)
RCVBUF_BYTES = 1 << 20  # room for a few thousand events while the reader is late


class ConnectorRefused(Exception):
    """The connector would not subscribe this process; the message says why."""


class NetlinkSocket(Protocol):
    """What ``ExecEvents`` uses of a socket (a test passes one that never acks)."""

    def bind(self, address: tuple[int, int], /) -> None: ...
    def sendto(self, data: bytes, address: tuple[int, int], /) -> int: ...
    def recv(self, bufsize: int, /) -> bytes: ...
    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...
    def setblocking(self, flag: bool, /) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


def _raw_socket() -> NetlinkSocket:
    return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)


def _request(op: int, tag: int, *, event_mask: int | None = None) -> bytes:
    """A request to the connector; its ack comes back with ``ack`` = ``tag + 1``."""
    payload = struct.pack("=I", op) if event_mask is None else struct.pack("=II", op, event_mask)
    cn = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, tag, len(payload), 0) + payload
    return NLMSGHDR.pack(NLMSGHDR.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def parse(data: bytes) -> list[tuple[int, int, int]]:
    """The proc events in one datagram: (what, cn ack, value): for EXEC the exec'd
    process's tgid, for NONE (an ack) its err, else -1."""
    out = []
    at = 0
    while at + EVENT_OFFSET + EVENT_HEAD.size <= len(data):
        length = NLMSGHDR.unpack_from(data, at)[0]
        if length < EVENT_OFFSET + EVENT_HEAD.size or at + length > len(data):
            break
        idx, val, _seq, ack, _len, _flags = CN_MSG.unpack_from(data, at + CN_OFFSET)
        if (idx, val) == (CN_IDX_PROC, CN_VAL_PROC):
            what = EVENT_HEAD.unpack_from(data, at + EVENT_OFFSET)[0]
            body = at + EVENT_OFFSET + EVENT_HEAD.size
            value = -1
            if what == PROC_EVENT_EXEC and body + EXEC_DATA.size <= at + length:
                value = EXEC_DATA.unpack_from(data, body)[1]
            elif what == PROC_EVENT_NONE and body + ACK_DATA.size <= at + length:
                value = ACK_DATA.unpack_from(data, body)[0]
            out.append((what, ack, value))
        at += (length + 3) & ~3
    return out


class ExecEvents:
    """A subscription to the connector's process events: ``read`` gives the pids that
    exec'd since the last read, and whether any event was lost on the way."""

    def __init__(
        self,
        *,
        ack_timeout_s: float = ACK_TIMEOUT_S,
        make_socket: Callable[[], NetlinkSocket] = _raw_socket,
        rcvbuf: int = RCVBUF_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Subscribe, or raise ``ConnectorRefused``. ``make_socket``: the test seam (a
        socket that never acks); ``rcvbuf``: the socket's receive buffer (a test overruns
        a small one)."""
        self.overruns = 0  # recv failed with ENOBUFS: events lost
        self.execs = 0  # exec events read
        # Our acks are told apart by their ``ack`` field (the kernel echoes it plus one;
        # it overwrites ``seq`` with its own per-CPU counter).
        self._tag = secrets.randbits(30) * 4
        self._pending: list[int] = []  # exec'd pids read while waiting for the ack
        self._lost = False  # ENOBUFS since the last read
        self._verdict: int | None = None  # the err our LISTEN's ack carries
        try:
            self.sock = make_socket()
        except OSError as exc:
            raise ConnectorRefused(f"no NETLINK_CONNECTOR socket: {exc.strerror or exc}") from exc
        try:
            self._subscribe(ack_timeout_s, rcvbuf, clock)
        except BaseException:
            self.sock.close()
            raise

    def _subscribe(self, timeout_s: float, rcvbuf: int, clock: Callable[[], float]) -> None:
        s = self.sock
        for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):  # FORCE needs CAP_NET_ADMIN
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, rcvbuf)
                break
            except OSError:
                continue
        try:
            s.bind((0, CN_IDX_PROC))
        except OSError as exc:
            raise ConnectorRefused(
                f"cannot join the proc events group: {exc.strerror or exc} "
                "(needs CAP_NET_ADMIN in the host's user namespace)"
            ) from exc
        s.setblocking(False)
        try:
            s.sendto(_request(PROC_CN_MCAST_LISTEN, self._tag), (0, 0))
            # 6.6+: exec events only for this socket; 6.1 drops this length unanswered.
            s.sendto(
                _request(PROC_CN_MCAST_LISTEN, self._tag + 1, event_mask=PROC_EVENT_EXEC), (0, 0)
            )
        except OSError as exc:
            raise ConnectorRefused(
                f"the kernel's connector did not take the request: {exc.strerror or exc} "
                "(it lives in the host's network namespace only: hostNetwork)"
            ) from exc
        end = clock() + timeout_s
        while True:
            self._drain()
            if self._verdict is not None:
                break
            left = end - clock()
            if left <= 0:
                raise ConnectorRefused(
                    f"no answer to the subscription within {timeout_s:g} s (the kernel "
                    "answers nothing outside the host's user and pid namespaces)"
                )
            select.select([s.fileno()], [], [], left)
        if self._verdict != 0:
            raise ConnectorRefused(
                f"the kernel refused the subscription: {os.strerror(self._verdict)} "
                "(needs CAP_NET_ADMIN)"
            )

    def _drain(self, most: int = DRAIN_MAX) -> None:
        """Read what is queued (at most ``most`` datagrams): exec'd pids to ``_pending``,
        our ack's err to ``_verdict``, an overrun to ``_lost``."""
        for _ in range(most):
            try:
                data = self.sock.recv(RECV_BYTES)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                self.overruns += 1
                self._lost = True
                continue
            for what, ack, value in parse(data):
                if what == PROC_EVENT_EXEC:
                    self.execs += 1
                    self._pending.append(value)
                elif what == PROC_EVENT_NONE and ack == self._tag + 1:
                    self._verdict = value

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, most: int = DRAIN_MAX) -> tuple[list[int], bool]:
        """The pids that exec'd (in order, repeats kept out) and whether events were lost
        (``ENOBUFS``) since the last read. Never blocks; reads at most ``most`` datagrams
        (call again while the socket is readable: a caller that polls reads one a wake,
        and saves the ``recv`` that would only say ``EAGAIN``)."""
        self._drain(most)
        pids, self._pending = self._pending, []
        lost, self._lost = self._lost, False
        return list(dict.fromkeys(pids)), lost

    def close(self) -> None:
        """Unsubscribe (6.1 keeps a listener counted for a socket closed while listening)."""
        with contextlib.suppress(OSError):
            self.sock.sendto(_request(PROC_CN_MCAST_IGNORE, self._tag + 2), (0, 0))
        self.sock.close()
