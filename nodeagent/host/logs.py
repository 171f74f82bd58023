"""Log files read for ``nodeagent explain``: streamed in chunks, memory flat in their size.

A chunk with none of the evidence words (``may_have_evidence``) is counted, not
split into lines (while a few error lines are still wanted for "what it did
see", a chunk with "error" or "fail" in it is split anyway). A line longer than
``LINE_MAX`` is cut there; invalid UTF-8 is replaced; a directory, a FIFO or a
file that cannot be read is one line on stderr and the rest are read.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Iterator
from typing import BinaryIO

from nodeagent.core.explain import LINE_MAX, Explainer, may_have_evidence

CHUNK = 1 << 20


def lines_of(
    fh: BinaryIO, wanted: Callable[[bytes], bool], total: list[int] | None = None
) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines in chunks ``wanted`` says may matter; ``total``
    gets every line counted, skipped or not. A line is cut at LINE_MAX: what is held of
    an unfinished line never grows past that."""
    lineno = 0
    tail = b""
    while chunk := fh.read(CHUNK):
        data = tail + chunk
        end = data.rfind(b"\n")
        if end < 0:
            tail = data[:LINE_MAX]  # an overlong line: its start is all that is kept
            continue
        body, tail = data[: end + 1], data[end + 1 :][:LINE_MAX]
        if not wanted(body):
            lineno += body.count(b"\n")
            continue
        for raw in body.split(b"\n")[:-1]:
            lineno += 1
            yield lineno, raw[:LINE_MAX].decode("utf-8", errors="replace")
    if tail:
        lineno += 1
        yield lineno, tail.decode("utf-8", errors="replace")
    if total is not None:
        total[0] += lineno


def explain_inputs(paths: list[str], ex: Explainer) -> tuple[int, list[str]]:
    """Feed every input to ``ex``; (inputs read, one problem line per input not read)."""
    read, problems = 0, []
    for path in paths or ["-"]:
        name = "<stdin>" if path == "-" else path
        try:
            fh = _open(path)
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror or exc}; not read")
            continue
        try:
            for n, line in lines_of(fh, lambda c: _wanted(c, ex), ex.total):
                ex.feed(name, n, line)
            read += 1
        except OSError as exc:
            problems.append(f"{name}: {exc.strerror or exc}; read in part")
            read += 1
        finally:
            if path != "-":
                fh.close()
    return read, problems


def _wanted(chunk: bytes, ex: Explainer) -> bool:
    """Split into lines only a chunk with evidence, or error lines still wanted."""
    lower = chunk.lower()
    if may_have_evidence(lower):
        return True
    return len(ex.errors) < 5 and (b"error" in lower or b"fail" in lower)


def _open(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise OSError(0, f"is {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
