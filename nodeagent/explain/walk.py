"""Walk a support bundle for ``nodeagent explain``: a directory, or a tar (``.tar``,
``.tar.gz``/``.tgz``, ``.tar.xz``), as the operators' tools write them.

Two passes, memory flat in the bundle's size: the first reads only the small files
the node map is made from (``nodes.py``: pod lists, pod YAML, ``hostname``), the
second streams every log through the explainer with the node it is about. A tar is
read as a stream (twice), never extracted: a member's name is only a label. In a
directory nothing is followed: a symlink, a FIFO or a device is not read, and each
file is opened ``O_NOFOLLOW|O_NONBLOCK`` and checked regular. A ``.gz`` inside
(``nvidia-bug-report_<node>.log.gz``, ``<node>_logs_kubelet.gz``) is read through
gzip (several gzip streams one after another, as nvidia-bug-report writes, too); what
any one file gives is cut at ``MEMBER_MAX`` bytes.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import os
import stat
import tarfile
import typing
from collections.abc import Callable, Iterator
from typing import IO

from nodeagent.explain.nodes import MAP_FILE_MAX, NodeMap, bundle_kind, is_log, is_map_file

MEMBER_MAX = 8 << 30  # what one file gives at most, decompressed (a gzip bomb ends here)
FILES_MAX = 200_000  # files looked at in one bundle
# What one bundle gives at most, decompressed, all its logs together: a small bundle of
# many compressed members each under MEMBER_MAX would otherwise read for hours.
BUNDLE_MAX = 32 << 30
# ... and at most RATIO times what it holds on disk (never less than READ_FLOOR): one
# gzip layer gives at most ~1032 times its size, logs 5-50 times; only layers inside
# layers (a .gz in a .tar.gz, repeated gzip streams) give more, and a 1 MB bundle that
# gives 128 GiB is a bomb, not a must-gather. `explain --max-read` sets it by hand.
RATIO = 200
READ_FLOOR = 256 << 20
DEPTH_MAX = 64  # directory levels read under a bundle's top (must-gathers use ~12)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2")

Feed = Callable[[str, IO[bytes], str], None]  # (label, stream, node)


def is_tar_name(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIXES)


class Capped(io.RawIOBase):
    """At most ``limit`` bytes of ``inner``; ``cut`` says whether more were there."""

    def __init__(self, inner: IO[bytes], limit: int) -> None:
        self.inner, self.left, self.cut = inner, limit, False

    def readable(self) -> bool:
        return True

    def readinto(self, buf: bytearray | memoryview) -> int:  # type: ignore[override]
        if self.left <= 0:
            self.cut = self.cut or bool(self.inner.read(1))
            return 0
        data = self.inner.read(min(len(buf), self.left))
        buf[: len(data)] = data
        self.left -= len(data)
        return len(data)


def gunzipped(fh: IO[bytes], name: str) -> IO[bytes]:
    """``fh`` read through gzip when ``name`` says it is one."""
    if name.lower().endswith(".gz"):
        return typing.cast(IO[bytes], gzip.GzipFile(fileobj=fh, mode="rb"))
    return fh


def read_budget(on_disk: int) -> int:
    """What a bundle or a compressed log of ``on_disk`` bytes may give, decompressed."""
    return min(BUNDLE_MAX, max(READ_FLOOR, RATIO * on_disk))


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def walk(
    path: str, feed: Feed, problems: list[str], *, budget: int | None = None
) -> dict[str, object]:
    """Feed every log of the bundle at ``path`` (a directory or a tar); what it was.
    ``budget``: the decompressed bytes all its logs may give together (by default
    ``read_budget`` of its size on disk); once spent, the rest is not read, said in one
    line with what was."""
    is_dir = os.path.isdir(path)  # the top as named (a link to it followed); nothing inside
    sizes: dict[str, int] = {}
    listed = list(_dir_files(path, problems, sizes)) if is_dir else []
    if budget is None:
        budget = read_budget(sum(sizes.values()) if is_dir else _size(path))

    def members(said: list[str] | None = None) -> Iterator[tuple[str, IO[bytes]]]:
        return _dir_open(path, listed) if is_dir else _tar_members(path, budget, said)

    # first pass: every name, and the node map from the small files (a tar is read
    # twice in all, as a stream each time)
    names: list[str] = list(listed)
    nodes = NodeMap()
    small = _dir_open(path, [n for n in listed if is_map_file(n)]) if is_dir else members(problems)
    for name, fh in small:
        if not is_dir:
            names.append(name)
        if is_map_file(name):
            nodes.learn(name, fh.read(MAP_FILE_MAX).decode("utf-8", errors="replace"))
    logs = 0
    seen_nodes: set[str] = set()
    left = budget
    for name, fh in members():
        if not is_log(name):
            continue
        node = nodes.node_of(name)
        capped = Capped(gunzipped(fh, name), min(MEMBER_MAX, left))
        label = os.path.join(path, name) if is_dir else f"{path}:{name}"
        try:
            feed(label, io.BufferedReader(capped), node)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            problems.append(f"{label}: {exc}; read in part")
        left -= min(MEMBER_MAX, left) - capped.left
        if capped.cut and left > 0:
            problems.append(f"{label}: cut at {MEMBER_MAX >> 30} GiB")
        logs += 1
        if left <= 0:
            problems.append(
                f"{path}: {size_text(budget)} decompressed read in {logs} logs, the bundle's "
                f"budget, up to {label}; the rest not read (--max-read to read more)"
            )
            if node:
                seen_nodes.add(node)
            break
        if node:
            seen_nodes.add(node)
    if logs == 0:
        problems.append(f"{path}: no log files in it")
    return {"bundle": path, "kind": bundle_kind(names), "logs": logs, "nodes": sorted(seen_nodes)}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _dir_files(top: str, problems: list[str], sizes: dict[str, int]) -> Iterator[str]:
    """Regular files under ``top`` (relative, sorted; ``sizes`` gets each one's), no link
    followed, at most ``DEPTH_MAX`` levels down (``os.walk`` recurses: a planted tree
    1,500 levels deep was a ``RecursionError``)."""
    count = 0
    base = top.rstrip(os.sep).count(os.sep)
    for here, dirs, files in os.walk(top, followlinks=False):
        dirs.sort()
        if here.count(os.sep) - base >= DEPTH_MAX and dirs:
            problems.append(f"{here}: more than {DEPTH_MAX} levels deep; not read below")
            dirs.clear()
        for f in sorted(files):
            full = os.path.join(here, f)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            count += 1
            if count > FILES_MAX:
                problems.append(f"{top}: more than {FILES_MAX} files; the rest not read")
                return
            name = os.path.relpath(full, top)
            sizes[name] = st.st_size
            yield name


def open_regular(path: str, *, follow: bool = True) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file: opened non-blocking (a FIFO
    does not wait for a writer), checked, then blocking; else OSError naming what it is."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise OSError(0, f"is {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _dir_open(top: str, names: list[str]) -> Iterator[tuple[str, IO[bytes]]]:
    for name in names:
        try:
            fh = open_regular(os.path.join(top, name), follow=False)
        except OSError:
            continue
        with fh:
            yield name, fh


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
    """``raw`` read through its compression (by its first bytes), for tarfile's plain
    stream mode: its own ``r|*`` keeps each decompressed piece and copies what is left of
    it at every read, so skipping a member of a highly compressed tar read 4 MB/s (a
    400-node bundle's first pass took 10 s; 1 s so)."""
    head = raw.read(6)
    raw.seek(0)
    if head.startswith(b"\x1f\x8b"):
        return typing.cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    if head.startswith(b"\xfd7zXZ\x00"):
        return typing.cast(IO[bytes], lzma.LZMAFile(raw))
    if head.startswith(b"BZh"):
        return typing.cast(IO[bytes], bz2.BZ2File(raw))
    return raw  # a plain tar (closed twice at the end: the second does nothing)


def _tar_members(path: str, budget: int, said: list[str] | None) -> Iterator[tuple[str, IO[bytes]]]:
    """(name, stream) of each regular member, read as a stream: never extracted. A
    stream is read through to reach the next member, so the tar itself gives at most
    ``budget`` bytes: the member that crosses it is the last (``said`` gets one line)."""
    with (
        open_regular(path) as raw,
        _decompressed(raw) as plain,
        tarfile.open(fileobj=plain, mode="r|", bufsize=1 << 16) as tar,
    ):
        for count, member in enumerate(tar, 1):
            if count > FILES_MAX:
                if said is not None:
                    said.append(f"{path}: more than {FILES_MAX} members; the rest not read")
                return
            name = member.name.removeprefix("./")
            fh = tar.extractfile(member) if member.isreg() else None
            if fh is not None:
                yield name, fh
                with contextlib.suppress(OSError):
                    fh.close()
            if member.offset_data + member.size > budget:
                if said is not None:
                    said.append(
                        f"{path}: its members give more than {size_text(budget)} "
                        f"decompressed, the bundle's budget; read up to {name}, the rest "
                        "not read (--max-read to read more)"
                    )
                return
