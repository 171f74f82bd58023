"""The hold's gate as its responder process reads it: a lease in a memfd.

The agent's loop writes ``(open, until)`` with one ``pwrite`` whenever the
guard's gate changes and at every heartbeat while it stays open (``RENEW_S``);
the responder reads it with ``pread`` on a descriptor it was given at start.
Neither side opens a file: a memfd lives on the kernel's internal shmem mount,
which no mark can cover, so the responder never waits on its own hold.

``until`` is on ``CLOCK_BOOTTIME`` (one clock for every process on the node,
the gate files' clock). A lease that has run out, one longer than
``LEASE_S`` from now, or one that does not read back whole (a write the
reader saw half of: its check word disagrees) reads **closed**: a stalled loop
stops renewing, and a module load waits as ``nodeagent wait`` would, while
every other open is answered at once.
"""

from __future__ import annotations

import os
import struct
import time

from nodeagent.host.gatefile import LEASE_S, LEASE_SLACK_S

LEASE = struct.Struct("=QdQ")  # open (0/1), until (boot-time seconds), check word
_CHECK = 0x6E6F6465_6167656E  # "nodeagen": a torn read's check word disagrees


def _check(is_open: int, until: float) -> int:
    (bits,) = struct.unpack("=Q", struct.pack("=d", until))
    return (bits ^ (is_open * 0x9E3779B97F4A7C15) ^ _CHECK) & 0xFFFFFFFFFFFFFFFF


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class HoldLease:
    """The writer's side (the agent): a memfd holding the gate, closed until written."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("nodeagent-hold-gate", os.MFD_CLOEXEC)
        self.write(False)

    @classmethod
    def adopt(cls, fd: int) -> HoldLease:
        """The lease of a responder this agent adopted (its memfd, as it is: read closed
        while it was an orphan)."""
        lease = cls.__new__(cls)
        lease.fd = fd
        return lease

    def fileno(self) -> int:
        return self.fd

    def write(self, is_open: bool, lease_s: float = LEASE_S) -> None:
        """The gate as of now: open for ``lease_s`` more seconds, or closed."""
        until = boottime() + lease_s if is_open else 0.0
        flag = int(is_open)
        os.pwrite(self.fd, LEASE.pack(flag, until, _check(flag, until)), 0)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def read_lease(fd: int, now: float | None = None) -> bool:
    """The gate as the responder sees it: open only while a whole, current lease says so."""
    for _ in range(2):  # a torn read is read once more, then taken as closed
        try:
            raw = os.pread(fd, LEASE.size, 0)
        except OSError:
            return False
        if len(raw) != LEASE.size:
            return False
        flag, until, check = LEASE.unpack(raw)
        if check != _check(flag, until):
            continue
        if flag != 1:
            return False
        t = boottime() if now is None else now
        return t < until <= t + LEASE_S + LEASE_SLACK_S
    return False
