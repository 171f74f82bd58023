"""Adoption (issue 52): a responder process whose agent died without a stop waits on
``ADOPT_SOCKET`` in the state directory; the next agent connects, checks it is the
responder (its credentials), and takes back the group, the lease and the eventfd over
``SCM_RIGHTS`` (``adopt``), seeing it through a pidfd from then on (``Adopted``)."""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import struct
import subprocess

# In the agent's state directory while a responder may be adopted (root-only, 0600, its
# name never followed through a symlink): a responder whose agent died without a stop
# waits there for the next agent (issue 52).
ADOPT_SOCKET = "hold.sock"
ADOPT_TIMEOUT_S = 2.0  # the responder's answer to an adopting agent
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Adopted:
    """A responder process this agent adopted: not its child (the supervisor reaps it), seen
    through a pidfd (no pid reuse). ``Popen``'s face as ``ResponderProcess`` uses it."""

    ENDED = "ended (an adopted responder: its exit status went to its reaper)"

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.fd < 0:
            return 0
        ready = select.poll()
        ready.register(self.fd, select.POLLIN)
        return 0 if ready.poll(0) else None  # (readable: it ended)

    def wait(self, timeout: float | None = None) -> int | None:
        if self.fd < 0:
            return 0
        ready = select.poll()
        ready.register(self.fd, select.POLLIN)
        if not ready.poll(None if timeout is None else int(timeout * 1000) + 1):
            raise subprocess.TimeoutExpired(f"responder {self.pid}", timeout or 0.0)
        return 0

    def kill(self) -> None:
        if self.fd >= 0:
            signal.pidfd_send_signal(self.fd, signal.SIGKILL)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def open_state_dir(path: str) -> int:
    """The state directory, opened without following a symlink, checked root-only (owned by
    us, writable by nobody else): the adoption socket lives only there."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise OSError(f"{path}: not owned by this agent's user alone: no adoption socket there")
    return fd


def socket_path(dirfd: int) -> str:
    return f"/proc/self/fd/{dirfd}/{ADOPT_SOCKET}"  # (the opened directory, no lookup again)


def bind_adopt_socket(state_dir: str) -> socket.socket:
    """A new socket bound at ``ADOPT_SOCKET`` (0600; a stale one removed), not listening:
    the responder listens on it, so a connecting agent's ``SO_PEERCRED`` names it."""
    dirfd = open_state_dir(state_dir)
    try:
        remove_socket_at(dirfd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            os.fchmod(sock.fileno(), 0o600)  # the file bind makes takes the socket's mode
            sock.bind(socket_path(dirfd))
        except OSError:
            sock.close()
            raise
        return sock
    finally:
        os.close(dirfd)


def remove_socket_at(dirfd: int) -> None:
    """Remove ``ADOPT_SOCKET`` if it is there and a socket (anything else: refused)."""
    try:
        st = os.stat(ADOPT_SOCKET, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{ADOPT_SOCKET} in the state directory is not a socket: left alone")
    os.unlink(ADOPT_SOCKET, dir_fd=dirfd)


def remove_adopt_socket(state_dir: str) -> None:
    dirfd = open_state_dir(state_dir)
    try:
        remove_socket_at(dirfd)
    finally:
        os.close(dirfd)
