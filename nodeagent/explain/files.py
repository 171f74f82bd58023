"""Log files read for ``nodeagent explain``: streamed in chunks, memory flat in their size.

A chunk with none of the evidence words (``may_have_evidence``) is counted, not
split into lines (while a few error lines are still wanted for "what it did
see", a chunk with "error" or "fail" in it is split anyway). A line longer than
``LINE_MAX`` is cut there; invalid UTF-8 is replaced; a FIFO or a file that cannot
be read is one line on stderr and the rest are read. A directory or a tar is a
support bundle (walk.py).
"""

from __future__ import annotations

import io
import lzma
import os
import stat
import sys
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import IO

from nodeagent.explain.matcher import LINE_MAX, Explainer, may_have_evidence
from nodeagent.explain.walk import (
    Capped,
    gunzipped,
    is_tar_name,
    open_regular,
    read_budget,
    size_text,
    walk,
)

CHUNK = 1 << 20


def lines_of(
    fh: IO[bytes],
    wanted: Callable[[memoryview], bool],
    total: list[int] | None = None,
) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines in chunks ``wanted`` says may matter; ``total``
    gets every line counted, skipped or not. A line is cut at LINE_MAX: what is held of
    an unfinished line never grows past that. A skipped chunk is looked at in place (a
    view, no copy of its megabyte)."""
    lineno = 0
    tail = b""
    while chunk := fh.read(CHUNK):
        data = tail + chunk if tail else chunk
        end = data.rfind(b"\n")
        if end < 0:
            tail = data[:LINE_MAX]  # an overlong line: its start is all that is kept
            continue
        tail = data[end + 1 :][:LINE_MAX]
        if not wanted(memoryview(data)[: end + 1]):
            lineno += data.count(b"\n", 0, end + 1)
            continue
        lines = data.split(b"\n")
        lines.pop()  # what follows the last newline: the tail
        for raw in lines:
            lineno += 1
            yield lineno, raw[:LINE_MAX].decode("utf-8", errors="replace")
    if tail:
        lineno += 1
        yield lineno, tail.decode("utf-8", errors="replace")
    if total is not None:
        total[0] += lineno


def explain_inputs(
    paths: list[str], ex: Explainer, max_read: int | None = None
) -> tuple[int, list[str]]:
    """Feed every input to ``ex``: a log file, stdin, a ``.gz`` log, or a support bundle
    (a directory or a tar: walk.py); (inputs read, one problem line per input
    not read or read in part). ``max_read``: what one bundle or ``.gz`` log may give,
    decompressed (default: ``read_budget`` of its size on disk)."""
    read = 0
    problems: list[str] = []

    started = [0]  # logs whose reading began (a bundle that fails before any: not read)

    def feed(name: str, fh: IO[bytes], node: str = "") -> None:
        started[0] += 1
        for n, line in lines_of(fh, lambda c: _wanted(c, ex), ex.total):
            ex.feed(name, n, line, node)

    for path in paths or ["-"]:
        name = "<stdin>" if path == "-" else path
        if path != "-" and (is_tar_name(path) or _is_dir(path)):
            before = started[0]
            try:
                ex.bundles.append(walk(path, feed, problems, budget=max_read))
                read += 1
            except (OSError, tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
                # an archive that gave no line was not read (all unread: exit 2)
                some = started[0] > before
                problems.append(f"{name}: {_why(exc)}; {'read in part' if some else 'not read'}")
                read += some
            continue
        try:
            fh = _open(path)
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror or exc}; not read")
            continue
        try:
            if path != "-" and path.lower().endswith(".gz"):
                budget = max_read or read_budget(os.fstat(fh.fileno()).st_size)
                capped = Capped(gunzipped(fh, path), budget)
                feed(name, io.BufferedReader(capped))
                if capped.cut:
                    problems.append(
                        f"{name}: {size_text(budget)} decompressed read, its budget; "
                        "the rest not read (--max-read to read more)"
                    )
            else:
                feed(name, fh)
            read += 1
        except (OSError, EOFError) as exc:
            problems.append(f"{name}: {_why(exc)}; read in part")
            read += 1
        finally:
            if path != "-":
                fh.close()
    return read, problems


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(
        exc
    ).__name__


def _is_dir(path: str) -> bool:
    """A directory given by name (a symlink to one is followed: the user named it)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


def _wanted(chunk: memoryview, ex: Explainer) -> bool:
    """Split into lines only a chunk with evidence, or error lines still wanted."""
    return may_have_evidence(chunk, or_errors=len(ex.errors) < 5)


def _open(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdin.buffer
    return open_regular(path)
