"""The append-only decision timeline: one JSON object a line, bounded, rotated.

The file is opened non-blocking, through the directory's descriptor, never
through a symlink, and refused unless it is a regular file. Each record is
written with a single O_APPEND write, so concurrent readers see
whole lines and a crash leaves at most the last line missing, never a torn
file. When the file passes its size bound it is rotated to ``.1``, ``.2``, ...
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot, NotRegularFile


class Timeline:
    def __init__(self, host: HostRoot, directory: str, max_bytes: int, keep: int) -> None:
        self.host = host
        self.rel = f"{directory}/timeline.jsonl"
        self.directory = directory
        self.max_bytes = max_bytes
        self.keep = keep
        self.skipped = 0  # lines the last records() skipped: torn, not JSON, not an object

    def append(self, record: Mapping[str, Any]) -> None:
        """One O_APPEND write. Raises OSError/NodeagentError (the caller reports it)."""
        self.append_many([record])

    def append_many(self, records: Sequence[Mapping[str, Any]], *, sync: bool = True) -> None:
        """Records in one O_APPEND write and one ``fdatasync`` (a pass's, together: on a
        disk each sync is milliseconds); ``sync=False``: the caller syncs later (``sync``).
        Raises OSError/NodeagentError."""
        if not records:
            return
        line = "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records).encode()
        name = self.rel.rsplit("/", 1)[-1]
        dfd = self.host.open_dir(self.directory, create=True)
        try:
            fd = self._open(dfd, name, os.O_CREAT)
            try:
                os.write(fd, line)
                size = os.fstat(fd).st_size
                if sync or size > self.max_bytes:  # (a file rotated away is synced first)
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if size > self.max_bytes:
                self._rotate(dfd, name)
        finally:
            os.close(dfd)

    def sync(self) -> None:
        """``fdatasync`` what was appended without it. Raises OSError/NodeagentError."""
        name = self.rel.rsplit("/", 1)[-1]
        dfd = self.host.open_dir(self.directory, create=True)
        try:
            try:
                fd = self._open(dfd, name, 0)
            except FileNotFoundError:
                return
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def _open(self, dfd: int, name: str, create: int) -> int:
        """The timeline for appending: non-blocking and a regular file only (a FIFO planted
        here must not hang a pass), never through a symlink."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags | create, 0o644, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFile(errno.EINVAL, f"{self.rel} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _rotate(self, dfd: int, name: str) -> None:
        for i in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{name}.{i}", f"{name}.{i + 1}", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.replace(name, f"{name}.1", src_dir_fd=dfd, dst_dir_fd=dfd)

    def records(self) -> Iterator[dict[str, Any]]:
        """Oldest first, across rotated files; a torn or foreign line is skipped and counted
        in ``skipped``. A file that is there but unreadable (a FIFO, a directory, a
        symlink) raises NodeagentError naming it: a reader never follows or blocks."""
        self.skipped = 0
        files = [f"{self.rel}.{i}" for i in range(self.keep, 0, -1)] + [self.rel]
        for rel in files:
            try:
                fd, _st = self.host.open_regular(rel)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise NodeagentError(f"{rel}: unreadable: {exc.strerror or exc}") from None
            with open(fd, encoding="utf-8", errors="replace", closefd=True) as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                    except (ValueError, RecursionError):  # torn, not JSON, nested too deep
                        rec = None
                    if isinstance(rec, dict):
                        yield rec
                    else:
                        self.skipped += 1


# Lists in status.json and in records are cut to this many items, with a note of
# how many were left out: the node decides their length (e.g. 10,000 validation
# markers), and status.json is rewritten and fsynced on every pass.
MAX_LIST_ITEMS = 64


def bounded(doc: Any, max_items: int = MAX_LIST_ITEMS) -> Any:
    """``doc`` with every list longer than ``max_items`` cut, saying how many were left out."""
    kind = type(doc)
    if kind is str or kind is int or kind is float or kind is bool or doc is None:
        return doc  # most of a record, and isinstance(Mapping) is an ABC check: not per leaf
    if kind is dict or isinstance(doc, Mapping):
        return {k: bounded(v, max_items) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        items = [bounded(v, max_items) for v in doc[:max_items]]
        if len(doc) > max_items:
            items.append(f"... {len(doc) - max_items} more left out")
        return items
    return doc
