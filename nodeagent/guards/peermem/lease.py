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

After the gate, at ``TABLE_AT``, the verdicts on held files (issue 65,
``heldfiles.py``): a header (magic, count, until), one entry per file (its
``FileKey`` and ``GO``, ``REBUILD`` or ``WAIT``; a file not listed goes by the
gate), and a digest
over the gate and the table together, all in the same ``pwrite``. The table
counts only whole, with the gate it was written with, and while its own
``until`` is current: a torn read, a gate rewritten by a writer that knows no
table (an older agent) or a stalled loop leaves no verdict at all. The gate's
first ``LEASE.size`` bytes are as before, so an older responder reads the gate
alone.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from nodeagent.core.snapshot import HeldFileKey
from nodeagent.host.gatefile import LEASE_S, LEASE_SLACK_S

LEASE = struct.Struct("=QdQ")  # open (0/1), until (boot-time seconds), check word
_CHECK = 0x6E6F6465_6167656E  # "nodeagen": a torn read's check word disagrees
TABLE_AT = 32
TABLE = struct.Struct("=IIdQ")  # magic, count, until (boot-time seconds), flags
JUDGE_ALL = 1  # flags: a held nvidia-peermem file waits for its own verdict, gate or not
ENTRY = struct.Struct("=QQQqI4x")  # st_dev, st_ino, size, mtime_ns, verdict
_TABLE_MAGIC = 0x564C4448  # "HDLV"
_DIGEST = 8
VERDICTS_MAX = 256  # the hold's caps hold at most 256 opens
_READ = TABLE_AT + TABLE.size + VERDICTS_MAX * ENTRY.size + _DIGEST


@dataclass(frozen=True)
class HeldVerdicts:
    """What the agent said of held files: each judged one's verdict, and ``judge_all``:
    the gate, open or not, checked no file (its root not mounted), so an open of
    ``nvidia-peermem.ko`` is held until that file has a verdict of its own."""

    files: Mapping[HeldFileKey, int] = field(default_factory=dict)
    judge_all: bool = False


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

    def write(
        self,
        is_open: bool,
        lease_s: float = LEASE_S,
        verdicts: Mapping[HeldFileKey, int] | None = None,
        judge_all: bool = False,
    ) -> None:
        """The gate as of now: open for ``lease_s`` more seconds, or closed; and the
        verdicts on held files, for as long (a file not listed goes by the gate, unless
        ``judge_all``: then it waits for one)."""
        now = boottime()
        until = now + lease_s if is_open else 0.0
        flag = int(is_open)
        head = LEASE.pack(flag, until, _check(flag, until)).ljust(TABLE_AT, b"\0")
        entries = list((verdicts or {}).items())[:VERDICTS_MAX]
        flags = JUDGE_ALL if judge_all else 0
        table = TABLE.pack(_TABLE_MAGIC, len(entries), now + lease_s, flags) + b"".join(
            ENTRY.pack(*key, code) for key, code in entries
        )
        os.pwrite(self.fd, head + table + _digest(head, table), 0)

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


def _digest(head: bytes, table: bytes) -> bytes:
    return hashlib.blake2b(head + table, digest_size=_DIGEST).digest()


def read_verdicts(fd: int, now: float | None = None) -> HeldVerdicts | None:
    """The verdicts on held files, or None when there is no whole, current table (an
    older writer, a torn read twice, a stalled loop): then the gate alone decides."""
    for _ in range(2):
        try:
            raw = os.pread(fd, _READ, 0)
        except OSError:
            return None
        end = TABLE_AT + TABLE.size
        if len(raw) < end + _DIGEST:
            return None
        magic, count, until, flags = TABLE.unpack_from(raw, TABLE_AT)
        if magic != _TABLE_MAGIC or count > VERDICTS_MAX:
            return None
        stop = end + count * ENTRY.size
        if len(raw) < stop + _DIGEST:
            continue
        if _digest(raw[:TABLE_AT], raw[TABLE_AT:stop]) != raw[stop : stop + _DIGEST]:
            continue
        t = boottime() if now is None else now
        if not t < until <= t + LEASE_S + LEASE_SLACK_S:
            return None
        out: dict[HeldFileKey, int] = {}
        for i in range(count):
            dev, ino, size, mtime, code = ENTRY.unpack_from(raw, end + i * ENTRY.size)
            out[(dev, ino, size, mtime)] = code
        return HeldVerdicts(out, bool(flags & JUDGE_ALL))
    return None
