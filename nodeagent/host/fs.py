"""Files under the host root: resolved as if chrooted, read bounded, written atomically.

The DaemonSet mounts the node's ``/`` at ``/host``; an absolute symlink under it
(RHEL's ``weak-updates/`` module links, merged-``/usr`` hosts, a driver root
that links elsewhere) means a path on the *node*, not in the container. Every
path is therefore resolved inside the host root: ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)`` (Linux >= 5.6, through a ctypes syscall), else a
component-by-component walk with the same semantics (``..`` stops at the root,
an absolute link restarts at the root, at most 40 links). Nothing resolves
outside the root.

Reads open with ``O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC`` (``.ko`` files follow a
final symlink, inside the root), ``fstat`` the descriptor and refuse anything
that is not a regular file (a FIFO, a device, a directory), so no read can
block; each read has a size cap. Writes go to a temp file in the same
directory (created ``O_EXCL``), are fsynced, renamed over the target, and the
directory is fsynced: a crash leaves either the old or the new file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from nodeagent.core.snapshot import FileFact, FileId
from nodeagent.errors import NodeagentError

# Size caps per kind of file (bytes).
SYSFS_ATTR_MAX = 4096
MARKER_MAX = 64 * 1024
STATE_MAX = 1 << 20
STATUS_MAX = 4 << 20

_SYS_OPENAT2 = 437  # the same number on every architecture (generic syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_MAX_LINKS = 40
# openat2 answers EAGAIN when a rename anywhere raced a '..' of the path; tries before
# the walk (openat2(2): "the caller may choose to retry").
OPENAT2_TRIES = 4
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    # openat2's arguments typed once: plain ints and bytes convert in C, not through a
    # ctypes object each (every read of a pass is one call).
    fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


# One open_how per flags value, made once and never written again (threads share it).
_HOWS: dict[int, tuple[_OpenHow, int]] = {}


_syscall = _load_syscall()
_HOW_SIZE = ctypes.sizeof(_OpenHow)
# None: not probed yet; False: this kernel (or seccomp profile) has no openat2.
_have_openat2: bool | None = None


def openat2_in_root(root_fd: int, rel: str, flags: int) -> int:
    """openat2(root_fd, rel, {flags, RESOLVE_IN_ROOT|RESOLVE_NO_MAGICLINKS}); OSError on failure.

    Raises OSError(ENOSYS) where the kernel has no openat2 (callers fall back).
    """
    global _have_openat2
    if _syscall is None or _have_openat2 is False:
        raise OSError(errno.ENOSYS, "openat2 unavailable")
    made = _HOWS.get(flags)
    if made is None:
        how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        made = _HOWS.setdefault(flags, (how, ctypes.addressof(how)))
    fd = _syscall(_SYS_OPENAT2, root_fd, os.fsencode(rel or "."), made[1], _HOW_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM) and _have_openat2 is None:
            _have_openat2 = False  # seccomp answers EPERM for unknown syscalls
            raise OSError(errno.ENOSYS, "openat2 unavailable")
        raise OSError(err, os.strerror(err), rel)
    _have_openat2 = True
    return int(fd)


def walk_in_root(root_fd: int, rel: str, flags: int) -> int:
    """The fallback: resolve ``rel`` one component at a time with chroot semantics.

    Each component is opened ``O_PATH|O_NOFOLLOW`` relative to the directory
    before it; a symlink's text is spliced into the remaining path (an
    absolute one restarting at the root); ``..`` never climbs above the root.
    The final component is opened with ``flags`` (``O_NOFOLLOW`` in ``flags``
    refuses a final symlink with ELOOP, as openat2 does).
    """
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    stack = [os.dup(root_fd)]  # directory fds from the root down
    links = 0
    try:
        while parts:
            comp = parts.pop(0)
            if comp == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            last = not parts
            try:
                st = os.stat(comp, dir_fd=stack[-1], follow_symlinks=False)
            except FileNotFoundError:
                if last and flags & os.O_CREAT:
                    return os.open(comp, flags, 0o644, dir_fd=stack[-1])
                raise
            if stat.S_ISLNK(st.st_mode) and not (last and flags & os.O_NOFOLLOW):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", rel)
                target = os.readlink(comp, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                continue
            if last:
                return os.open(comp, flags | os.O_NOFOLLOW, dir_fd=stack[-1])
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), rel)
            stack.append(
                os.open(comp, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=stack[-1])
            )  # fmt: skip
        return os.open(".", flags, dir_fd=stack[-1])  # rel named the root itself
    finally:
        for fd in stack:
            os.close(fd)


def reopen(fd: int) -> int:
    """A readable, non-blocking descriptor of the file an ``O_PATH`` descriptor names (the
    same inode, through /proc/self/fd: nothing is resolved again); others are dup'ed."""
    if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_PATH:
        return os.dup(fd)
    return os.open(f"/proc/self/fd/{fd}", _READ_FLAGS)


def _kind(mode: int) -> str:
    kinds = {
        stat.S_IFDIR: "a directory",
        stat.S_IFIFO: "a FIFO",
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
        stat.S_IFSOCK: "a socket",
        stat.S_IFLNK: "a symlink",
    }
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


class NotRegularFile(OSError):
    """A path that is a FIFO, device, directory or socket where a file was expected."""


_ORPHAN_TEMP = re.compile(r"\..+\.tmp\.[0-9]{1,10}")


class HostRoot:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._root_fd: int | None = None
        # rel_of's shortcut: a plain spelling under an absolute, normal root needs no relpath.
        text = str(self.root)
        normal = self.root.is_absolute() and os.path.normpath(text) == text
        self._prefix = (text.rstrip("/") + "/") if normal else None

    @property
    def root_fd(self) -> int:
        """An O_PATH descriptor of the root, opened once (reopened if closed)."""
        if self._root_fd is None:
            self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._root_fd

    def close(self) -> None:
        fd, self._root_fd = self._root_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()

    @staticmethod
    def _inside(rel: str) -> str:
        """``rel`` without a leading '/'; refused when a component is '..'.

        String splitting, not pathlib: it runs for every read of a pass (hundreds
        on a node with many VFs) and pathlib's parsing was most of their cost.
        """
        rel = rel.lstrip("/")
        if ".." in rel.split("/"):
            raise NodeagentError(f"path {rel!r} escapes the host root")
        return rel

    def path(self, rel: str) -> Path:
        """``rel`` as a path under the root, for naming and for watches (not for opening)."""
        return self.root / self._inside(rel)

    def path_text(self, rel: str) -> str:
        """``path`` as a string, without pathlib's parsing (a pass asks for it per module)."""
        root = self._prefix or f"{self.root}/"
        return root + self._inside(rel)

    def rel_of(self, path: str | os.PathLike[str]) -> str:
        """The root-relative spelling of a path under ``self.root``."""
        text = os.fspath(path)
        prefix = self._prefix
        if prefix and text.startswith(prefix) and "/." not in text and "//" not in text:
            return text[len(prefix) :]  # nothing to normalize ('..', '.', '//'): as relpath
        return os.path.relpath(os.path.abspath(path), os.path.abspath(self.root))

    # -- opening ------------------------------------------------------------

    def open(self, rel: str, flags: int = _READ_FLAGS, *, follow: bool = False) -> int:
        """A descriptor for ``rel`` resolved inside the root. Raises OSError.

        ``follow=False`` refuses a final symlink (ELOOP); intermediate links are
        always followed, inside the root.
        """
        rel = self._inside(rel)  # refuse '..' in configured paths up front
        flags |= os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        for _ in range(OPENAT2_TRIES):
            try:
                return openat2_in_root(self.root_fd, rel, flags)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    break
                if exc.errno != errno.EAGAIN:
                    raise
                # A '..' on the way (sysfs's device links are full of them) raced a
                # rename anywhere on the machine: the kernel cannot vouch the walk stayed
                # inside, and says try again. Not "absent".
        # No openat2, or renames kept racing it (a pod renaming in a loop must not blind
        # the agent): the component-wise walk, which never climbs above the root.
        return walk_in_root(self.root_fd, rel, flags)

    def open_regular(self, rel: str, *, follow: bool = False) -> tuple[int, os.stat_result]:
        """Open for reading, non-blocking; refuse anything but a regular file."""
        return self._regular(self.open(rel, _READ_FLAGS, follow=follow))

    def identify(self, rel: str, *, follow: bool = False) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` descriptor of the regular file at ``rel`` and its stat: the file is
        not opened (no fanotify permission event on a marked filesystem, no FIFO to block
        on), so a cached read can be validated for a path walk and a stat. ``reopen``
        gives a readable descriptor of the very same file when it must be read."""
        return self._regular(self.open(rel, os.O_PATH, follow=follow))

    @staticmethod
    def _regular(fd: int) -> tuple[int, os.stat_result]:
        """``fd`` and its stat if it is a regular file; else it is closed and refused."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(errno.EINVAL, f"is {_kind(st.st_mode)}, not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    # -- reading ------------------------------------------------------------

    def read_text(self, rel: str, limit: int = SYSFS_ATTR_MAX) -> str:
        """Read a small file without following a final symlink. Raises OSError."""
        return self.read_bytes(rel, limit).decode("utf-8", errors="replace")

    def read_bytes(self, rel: str, limit: int = SYSFS_ATTR_MAX, *, follow: bool = False) -> bytes:
        """The whole file, at most ``limit`` bytes (EFBIG beyond; sysfs sizes are not real)."""
        fd, _st = self.open_regular(rel, follow=follow)
        try:
            return read_capped(fd, limit)
        finally:
            os.close(fd)

    def file_fact(self, rel: str, *, odd_is_present: bool = False) -> FileFact:
        """A marker file: presence and identity.

        A symlink, directory, FIFO or unreadable entry is "odd": it counts as
        absent by default (a ready flag must be a real file) and as present with
        ``odd_is_present`` (a marker whose presence means "stop"), with a problem
        naming what it is either way.
        """
        return self.file_facts([rel], odd=(rel,) if odd_is_present else ())[rel]

    def file_facts(self, rels: Iterable[str], *, odd: Collection[str] = ()) -> dict[str, FileFact]:
        """``file_fact`` of each of ``rels`` (``odd``: those whose odd form counts as present);
        each directory opened once for the files in it (a pass asks again before its gate)."""
        rels = list(rels)
        by_parent: dict[str, list[tuple[str, str]]] = {}
        for rel in rels:
            parent, _, name = rel.strip("/").rpartition("/")
            by_parent.setdefault(parent, []).append((rel, name))
        facts: dict[str, FileFact] = {}
        for parent, files in by_parent.items():
            try:
                dfd = self.open(parent or ".", os.O_PATH | os.O_DIRECTORY, follow=True)
            except FileNotFoundError:
                facts.update((rel, FileFact(path=rel, present=False)) for rel, _ in files)
                continue
            except OSError as exc:
                why = f"cannot open its directory: {exc.strerror}"
                facts.update((rel, self._odd(rel, why, rel in odd)) for rel, _ in files)
                continue
            try:
                for rel, name in files:
                    facts[rel] = self._fact_at(dfd, rel, name, rel in odd)
            finally:
                os.close(dfd)
        return {rel: facts[rel] for rel in rels}  # in the order asked

    def _fact_at(self, dfd: int, rel: str, name: str, odd_is_present: bool) -> FileFact:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else ""
        except FileNotFoundError:
            return FileFact(path=rel, present=False)
        except OSError as exc:
            return self._odd(rel, f"cannot stat: {exc.strerror}", odd_is_present)
        if stat.S_ISLNK(st.st_mode):
            return self._odd(rel, f"is a symlink to {target!r}, not a file", odd_is_present)
        if not stat.S_ISREG(st.st_mode):
            return self._odd(rel, f"is {_kind(st.st_mode)}, not a regular file", odd_is_present)
        return FileFact(
            path=rel,
            present=True,
            ident=FileId(st.st_ino, st.st_mtime_ns, st.st_ctime_ns),
            device=(os.major(st.st_dev), os.minor(st.st_dev)),
        )

    @staticmethod
    def _odd(rel: str, what: str, present: bool) -> FileFact:
        counted = "counted as present" if present else "ignored"
        return FileFact(path=rel, present=present, problem=f"{what}; {counted}")

    def listdir(self, rel: str, *, strict: bool = False) -> list[str]:
        """Sorted names in a directory (inside the root); [] when it is missing.

        Also [] when it is not a directory, unless ``strict`` (then NotADirectoryError).
        """
        try:
            fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK, follow=True)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            if strict:
                raise
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def listing(self, rel: str, problems: list[str]) -> list[str]:
        """``listdir``, with an unreadable directory (a symlink loop, a file, a FIFO) as a
        problem; a missing one is empty."""
        try:
            return self.listdir(rel, strict=True)
        except (OSError, NodeagentError) as exc:
            problems.append(f"{rel} unreadable: {getattr(exc, 'strerror', None) or exc}")
            return []

    # -- writing ------------------------------------------------------------

    def open_dir(self, rel: str, *, create: bool) -> int:
        """A descriptor of directory ``rel``; parts created when asked; symlinks refused.

        The agent's own directories are real directories: a symlink on the way
        (even one that stays inside the root) is refused, not followed.
        """
        fd = os.dup(self.root_fd)
        cur = self.root
        try:
            for part in Path(rel.strip("/")).parts:
                if part == "..":
                    raise NodeagentError(f"path {rel!r} escapes the host root")
                cur = cur / part
                flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    try:
                        nxt = os.open(part, flags, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise
                        # Created only when missing (every pass opens the same ones: a
                        # mkdir each time was a syscall and an exception per component).
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o755, dir_fd=fd)
                        nxt = os.open(part, flags, dir_fd=fd)
                except (NotADirectoryError, OSError) as exc:
                    if isinstance(exc, FileNotFoundError):
                        raise
                    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                        raise NodeagentError(
                            f"{cur} is not a directory (a symlink or a file); refusing"
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def ensure_dir(self, rel: str) -> Path:
        """Create ``rel`` and its parents as real directories; refuse a symlink on the way."""
        os.close(self.open_dir(rel, create=True))
        return self.path(rel)

    def write_atomic(
        self,
        rel: str,
        data: bytes,
        mode: int = 0o644,
        *,
        commit: Callable[[], bool] | None = None,
        durable: bool = True,
    ) -> bool:
        """Temp file, fsync, rename into place. ``commit``, when given, is asked last, after
        the fsync and right before the rename: False leaves the old file (False returned).
        ``durable=False`` skips both fsyncs, for a file that means nothing after a reboot
        (a lease or heartbeat stamped with the boot's id and clock): readers still see the
        old file or the new one whole, and the page cache outlives the writer's crash."""
        parent, _, name = rel.strip("/").rpartition("/")
        dfd = self.open_dir(parent, create=True)
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise NodeagentError(
                        f"{self.path(rel)} is {_kind(st.st_mode)}, not a regular file; "
                        "refusing to write"
                    )
            except FileNotFoundError:
                pass
            tmp = f".{name}.tmp.{os.getpid()}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(tmp, flags | os.O_NONBLOCK, mode, dir_fd=dfd)
            except FileExistsError:  # a leftover of a crashed writer with our pid
                os.unlink(tmp, dir_fd=dfd)  # (only then: a beat writes this way every second)
                fd = os.open(tmp, flags | os.O_NONBLOCK, mode, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            os.close(fd)
            if commit is not None and not commit():
                os.unlink(tmp, dir_fd=dfd)
                return False
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if durable:
                with contextlib.suppress(OSError):
                    os.fsync(dfd)
            return True
        finally:
            os.close(dfd)

    def remove_orphaned_temps(self, rel: str, only: Collection[str] | None = None) -> list[str]:
        """Remove what killed writers left in directory ``rel``: ``write_atomic``'s temp
        files (``.<name>.tmp.<pid>``, regular files only, never followed); with ``only``,
        just those of these file names (a directory shared with other writers). Call it
        holding the single-agent lock, so no live writer's file goes. Returns the names
        removed."""
        try:
            names = [
                n
                for n in self.listdir(rel, strict=True)
                if _ORPHAN_TEMP.fullmatch(n)
                and (only is None or n[1:].rpartition(".tmp.")[0] in only)
            ]
            if not names:
                return []
            dfd = self.open_dir(rel, create=False)
        except (OSError, NodeagentError):
            return []  # no directory yet (or not one: its writes say so)
        removed: list[str] = []
        try:
            for name in names:
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=dfd)
                        removed.append(name)
        finally:
            os.close(dfd)
        return removed

    def set_aside(self, rel: str, new_name: str) -> None:
        """Rename file ``rel`` to ``new_name`` in the same directory (a bad file kept, not lost).

        Through the directory's descriptor, as every agent write: a symlinked
        directory on the way is refused, never followed out of the root.
        """
        parent, _, name = rel.strip("/").rpartition("/")
        if "/" in new_name or new_name in ("", ".", ".."):
            raise NodeagentError(f"{new_name!r} is not a file name")
        dfd = self.open_dir(parent, create=False)
        try:
            os.replace(name, new_name, src_dir_fd=dfd, dst_dir_fd=dfd)
            with contextlib.suppress(OSError):
                os.fsync(dfd)
        finally:
            os.close(dfd)

    def remove(self, rel: str) -> bool:
        """Remove a file (never a directory); a missing file is fine. True when something went."""
        parent, _, name = rel.strip("/").rpartition("/")
        try:
            dfd = self.open_dir(parent, create=False)
        except FileNotFoundError:
            return False
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(st.st_mode):
                raise NodeagentError(f"{self.path(rel)} is a directory; refusing to remove")
            os.unlink(name, dir_fd=dfd)
            with contextlib.suppress(OSError):
                os.fsync(dfd)
            return True
        finally:
            os.close(dfd)


def reason(exc: BaseException) -> str:
    """An error in a problem line: the OS's words when there are some."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def read_capped(fd: int, limit: int) -> bytes:
    """Read to EOF from ``fd``; OSError(EFBIG) past ``limit`` bytes (no up-front buffer)."""
    chunks: list[bytes] = []
    total = 0
    while True:
        try:
            chunk = os.read(fd, min(65536, limit + 1 - total))
        except BlockingIOError:
            raise OSError(errno.EAGAIN, "would block") from None
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes")
    return b"".join(chunks)
