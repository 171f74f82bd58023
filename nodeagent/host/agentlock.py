"""One agent per node: an exclusive ``flock`` on ``<root>/run/nodeagent/agent.lock``.

Our own file, never MOFED's ``.lock``, and at that one place whatever
``[paths] state_dir`` says: two agents configured with different state
directories on one host root still exclude each other. The holder writes its
pid into it so a second ``nodeagent run`` can name it in its one-line refusal
(best effort: a full ``/run`` leaves the lock held and the pid unwritten). The
kernel drops the lock when the holder dies (even by kill -9), so a stale file
never blocks a restart. ``check``, ``status`` and ``wait`` do not touch it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from nodeagent.core.names import is_decimal
from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot

log = logging.getLogger("nodeagent.lock")


class AgentRunning(NodeagentError):
    """Another agent holds the lock on this host root."""


LOCK_DIR = "run/nodeagent"  # per host root; not the configurable state dir


class AgentLock:
    def __init__(self, host: HostRoot, lock_dir: str = LOCK_DIR) -> None:
        self.host = host
        self.dir = lock_dir
        self.rel = f"{lock_dir}/agent.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise AgentRunning (naming the holder) / NodeagentError."""
        try:
            dfd = self.host.open_dir(self.dir, create=True)
        except OSError as exc:  # a read-only or full /run, a file where the dir should be
            raise NodeagentError(f"{self.dir}: cannot create the agent lock's directory: "
                                 f"{exc.strerror}") from None  # fmt: skip
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open("agent.lock", flags, 0o644, dir_fd=dfd)
            except OSError as exc:
                raise NodeagentError(f"{self.rel}: cannot open: {exc.strerror}") from None
        finally:
            os.close(dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NodeagentError(f"{self.rel} is not a regular file; refusing")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise NodeagentError(f"{self.rel}: cannot lock: {exc.strerror}") from None
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                who = f"pid {holder}" if is_decimal(holder) else "unknown pid"
                raise AgentRunning(
                    f"another nodeagent ({who}) is running on this host root (it holds {self.rel})"
                ) from None
            try:  # who holds it, for a second agent's refusal: not worth failing over
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                log.warning("%s: holding the lock, pid not written: %s", self.rel, exc.strerror)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> AgentLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
