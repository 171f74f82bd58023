"""Files under the host root: read without following links, write atomically.

Every path the agent touches is relative to one host root. Markers and state
files are opened with O_NOFOLLOW: a symlink planted at ``.driver-ready`` or at
the agent's own state file is reported, never followed. Writes go to a temp
file in the same directory, are fsynced, then renamed over the target, and the
directory is fsynced: a crash leaves either the old or the new file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from nodeagent.core.snapshot import FileFact, FileId
from nodeagent.errors import NodeagentError


class HostRoot:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        rel = rel.lstrip("/")
        if ".." in Path(rel).parts:
            raise NodeagentError(f"path {rel!r} escapes the host root")
        return self.root / rel

    # -- reading ------------------------------------------------------------

    def read_text(self, rel: str, limit: int = 65536) -> str:
        """Read a small file without following a final symlink. Raises OSError."""
        return self.read_bytes(rel, limit).decode("utf-8", errors="replace")

    def read_bytes(self, rel: str, limit: int = 65536) -> bytes:
        fd = os.open(self.path(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            chunks = []
            left = limit
            while left > 0:
                chunk = os.read(fd, min(left, 65536))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def file_fact(self, rel: str) -> FileFact:
        """A marker file: presence and identity; a symlink or non-file is absent, with a problem."""
        p = self.path(rel)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return FileFact(path=rel, present=False)
        except OSError as exc:
            return FileFact(path=rel, present=False, problem=f"cannot stat: {exc.strerror}")
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(p)
            except OSError:
                target = "?"
            return FileFact(
                path=rel, present=False, problem=f"is a symlink to {target!r}, not a file; ignored"
            )
        if not stat.S_ISREG(st.st_mode):
            return FileFact(path=rel, present=False, problem="is not a regular file; ignored")
        return FileFact(
            path=rel,
            present=True,
            ident=FileId(st.st_ino, st.st_mtime_ns, st.st_ctime_ns),
            device=(os.major(st.st_dev), os.minor(st.st_dev)),
        )

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    # -- writing ------------------------------------------------------------

    def ensure_dir(self, rel: str) -> Path:
        """Create ``rel`` and its parents as real directories; refuse a symlink on the way."""
        cur = self.root
        for part in Path(rel.lstrip("/")).parts:
            cur = cur / part
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(cur, 0o755)
                st = os.lstat(cur)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise NodeagentError(f"{cur} is not a directory (a symlink or a file); refusing")
        return cur

    def write_atomic(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        target = self.path(rel)
        parent = (
            self.ensure_dir(str(Path(rel).parent)) if Path(rel).parent != Path(".") else self.root
        )
        try:
            st = os.lstat(target)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
                raise NodeagentError(
                    f"{target} is a symlink or not a regular file; refusing to write"
                )
        except FileNotFoundError:
            pass
        tmp = parent / f".{target.name}.tmp.{os.getpid()}"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, target)
        _fsync_dir(parent)

    def remove(self, rel: str) -> bool:
        """Remove a file (never a directory); a missing file is fine. True when something went."""
        target = self.path(rel)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            raise NodeagentError(f"{target} is a directory; refusing to remove")
        os.unlink(target)
        _fsync_dir(target.parent)
        return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
