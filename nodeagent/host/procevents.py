"""Each ``exec`` on the host, as it happens: the kernel's process events connector.

A raw ``NETLINK_CONNECTOR`` socket bound to the ``CN_IDX_PROC`` group, a
``PROC_CN_MCAST_LISTEN`` sent to the kernel, then ``PROC_EVENT_EXEC`` messages
(the exec'd process's pid) read as they come. The container scanner
(``guards/peermem/roots.py``) reads the command line of exec'd processes only.

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
- 6.1 sends every fork and exit too (about three events a process). A classic
  BPF filter on the socket (``SO_ATTACH_FILTER``, no privilege needed) keeps
  ``EXEC`` and ``NONE`` (the acks) only, so the kernel never queues the rest
  and the reader is never woken for them, on every kernel.
- The reader blocks in ``recv`` itself with ``SO_RCVTIMEO`` as its timeout: one
  system call a wake, where ``poll`` then ``recv`` took two (about 40 against
  80 µs of the thread's CPU a wake here). ``wake`` interrupts it: a unicast to
  the socket's own port id from a second connector socket. Sending to a port id
  needs ``CAP_NET_ADMIN`` over the network namespace (the connector's kernel
  socket does not set ``NL_CFG_F_NONROOT_SEND``), so no other user of the node
  can put a message in this queue; without it, ``wait`` returns at its timeout.

Why not pyroute2's ``ProcEventSocket`` (a dependency already): its
``control(listen=True)`` waits for an answer without a timeout (a refused
subscription never gets one: the agent's scanner would hang), takes any
listener's ack as its own, and decodes every event into a message object,
while the scanner needs two integers from one message in three.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import select
import socket
import struct
import sys
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
SO_ATTACH_FILTER = 26

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


def _sock_filter_program() -> list[tuple[int, int, int, int]]:
    """Classic BPF: keep a message whose event (the word after the nlmsghdr and the
    cn_msg) is ``EXEC`` or ``NONE``; drop the rest (fork, exit, uid, comm...). A load
    past a message's end drops it, so the kernel's messages are all long enough and
    ``wake``'s is padded. ``BPF_ABS`` loads in network order: the constants are
    swapped to compare with the host's."""
    bpf_ld_w_abs, bpf_jeq_k, bpf_ret_k = 0x20, 0x15, 0x06

    def net(v: int) -> int:
        return int.from_bytes(v.to_bytes(4, sys.byteorder), "big")

    return [
        (bpf_ld_w_abs, 0, 0, EVENT_OFFSET),
        (bpf_jeq_k, 2, 0, net(PROC_EVENT_EXEC)),  # jt: to "keep"
        (bpf_jeq_k, 1, 0, net(PROC_EVENT_NONE)),
        (bpf_ret_k, 0, 0, 0),  # drop
        (bpf_ret_k, 0, 0, 0xFFFFFFFF),  # keep, whole
    ]


def _attach_filter(sock: NetlinkSocket) -> None:
    prog = _sock_filter_program()
    insns = (ctypes.c_ubyte * (8 * len(prog)))()
    for i, (code, jt, jf, k) in enumerate(prog):
        struct.pack_into("=HBBI", insns, 8 * i, code, jt, jf, k)
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }: the kernel
    # copies the instructions during the call, while ``insns`` is alive.
    fprog = struct.pack("@HP", len(prog), ctypes.addressof(insns))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


class ConnectorRefused(Exception):
    """The connector would not subscribe this process; the message says why."""


class NetlinkSocket(Protocol):
    """What ``ExecEvents`` uses of a socket (a test passes one that never acks)."""

    def bind(self, address: tuple[int, int], /) -> None: ...
    def sendto(self, data: bytes, address: tuple[int, int], /) -> int: ...
    def recv(self, bufsize: int, flags: int = 0, /) -> bytes: ...
    def setsockopt(self, level: int, optname: int, value: int | bytes, /) -> None: ...
    def getsockname(self) -> tuple[int, int]: ...
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
    """A subscription to the connector's process events: ``wait`` blocks for the next
    one, ``read`` takes what is queued; each gives the pids that exec'd and whether any
    event was lost on the way."""

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
        self.wakes = 0  # returns from ``wait`` (an event, a timeout or ``wake``)
        self.filtered = False  # the kernel drops what is not EXEC or an ack (BPF)
        # Our acks are told apart by their ``ack`` field (the kernel echoes it plus one;
        # it overwrites ``seq`` with its own per-CPU counter).
        self._tag = secrets.randbits(30) * 4
        self._pending: list[int] = []  # exec'd pids read, not yet given out
        self._lost = False  # ENOBUFS since the last read
        self._verdict: int | None = None  # the err our LISTEN's ack carries
        self._timeout_ms = 0  # SO_RCVTIMEO as last set (0: never, blocks forever)
        self._make_socket = make_socket
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
        with contextlib.suppress(OSError):  # without it every fork and exit wakes the reader
            _attach_filter(s)
            self.filtered = True
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
        s.setblocking(True)  # ``wait`` blocks in ``recv``; ``read`` asks MSG_DONTWAIT

    def _take(self, data: bytes) -> None:
        for what, ack, value in parse(data):
            if what == PROC_EVENT_EXEC:
                self.execs += 1
                self._pending.append(value)
            elif what == PROC_EVENT_NONE and ack == self._tag + 1:
                self._verdict = value

    def _recv(self, flags: int) -> bool:
        """One datagram taken; False when there was none (``EAGAIN``: nothing queued,
        or ``SO_RCVTIMEO`` passed). A loss (``ENOBUFS``) is counted and marked."""
        try:
            data = self.sock.recv(RECV_BYTES, flags)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno != errno.ENOBUFS:
                raise
            self.overruns += 1
            self._lost = True
            return True
        self._take(data)
        return True

    def _drain(self, most: int = DRAIN_MAX) -> None:
        """Take what is queued (at most ``most`` datagrams), never blocking."""
        for _ in range(most):
            if not self._recv(socket.MSG_DONTWAIT):
                return

    def _give(self) -> tuple[list[int], bool]:
        pids, self._pending = self._pending, []
        lost, self._lost = self._lost, False
        return list(dict.fromkeys(pids)), lost

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self, most: int = DRAIN_MAX) -> tuple[list[int], bool]:
        """The pids that exec'd (in order, repeats kept out) and whether events were lost
        (``ENOBUFS``) since the last read. Never blocks; reads at most ``most`` datagrams."""
        self._drain(most)
        return self._give()

    def wait(self, timeout_s: float) -> tuple[list[int], bool]:
        """Like ``read``, after blocking up to ``timeout_s`` for one datagram: the one
        system call of a wake. The timeout is set on the socket only when it changes
        (a caller passes the same few values), rounded to the millisecond."""
        ms = max(1, round(timeout_s * 1000))
        if ms != self._timeout_ms:
            tv = struct.pack("@ll", ms // 1000, ms % 1000 * 1000)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self._timeout_ms = ms
        self._recv(0)
        self.wakes += 1
        return self._give()

    def wake(self) -> None:
        """Interrupt a ``wait`` in another thread: a message to this socket's own port id
        (no event: ``parse`` skips it). Needs ``CAP_NET_ADMIN``; without it the waiter
        returns at its timeout."""
        with contextlib.suppress(OSError):
            port = self.sock.getsockname()[0]
            sender = self._make_socket()
            try:
                # As long as an event, so the filter's load stays inside it; zeros: NONE.
                size = EVENT_OFFSET + EVENT_HEAD.size
                head = NLMSGHDR.pack(size, NLMSG_DONE, 0, 0, 0)
                sender.sendto(head + bytes(size - len(head)), (port, 0))
            finally:
                sender.close()

    def close(self) -> None:
        """Unsubscribe (6.1 keeps a listener counted for a socket closed while listening)."""
        with contextlib.suppress(OSError):
            self.sock.sendto(_request(PROC_CN_MCAST_IGNORE, self._tag + 2), (0, 0))
        self.sock.close()
