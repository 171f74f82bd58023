"""Resolve a module name to its file through ``modules.dep``, as modprobe does.

``<moddir>/modules.dep`` (written by ``depmod``) has one line per module::

    kernel/drivers/infiniband/core/ib_uverbs.ko.xz: kernel/drivers/infiniband/core/ib_core.ko.xz

Paths are relative to ``moddir``; absolute ones are accepted when they stay
inside ``moddir`` (also when written as the host sees them, e.g.
``/lib/modules/<kver>/...`` while ``moddir`` is ``/host/lib/modules/<kver>``).
A path that would leave ``moddir`` (``..``, or an absolute path elsewhere) is
never followed. Names match on the file's base name without ``.ko[.xz|.zst|.gz]``,
with '-' and '_' the same. Only the text ``modules.dep`` is read; a missing or
unreadable file means "not found" (no directory scan). Symlinks below
``moddir`` are not resolved here: the check is lexical.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodeagent.core.names import normalize_module_name
from nodeagent.host.fs import read_capped, reopen

__all__ = ["find_module", "module_dependencies"]

_MAX_MODULES_DEP = 64 << 20
_CACHE_SIZE = 8
_SUFFIXES = (".ko.xz", ".ko.zst", ".ko.gz", ".ko")


@dataclass(frozen=True)
class _Entry:
    relpath: str
    rest: str  # the line after ':', parsed into names only when asked (module_dependencies)


_CacheKey = tuple[str, int, int, int]  # path, inode, mtime, size: one identity of the file
_cache: OrderedDict[_CacheKey, dict[str, _Entry]] = OrderedDict()
_cache_lock = threading.Lock()


def _module_name(path: str) -> str | None:
    base = path.rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if base.endswith(suffix) and len(base) > len(suffix):
            return normalize_module_name(base[: -len(suffix)])
    return None


def _parse(text: str) -> dict[str, _Entry]:
    """Index by module name; dependencies stay text until a caller asks for them."""
    entries: dict[str, _Entry] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        relpath, sep, rest = line.partition(":")
        if not sep:
            continue
        relpath = relpath.strip()
        name = _module_name(relpath)
        if name is None or name in entries:
            continue  # first line wins, as in depmod's own output order
        entries[name] = _Entry(relpath, rest)
    return entries


Opener = Callable[[str], int]


def _open_plain(path: str) -> int:
    # Non-blocking: a FIFO planted at modules.dep must not hang the agent (refused below).
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


# What one reader (a pass's observation) already loaded, by moddir: it reads modules.dep
# once, not once per module it looks up (each an open, a stat and a cache lookup).
Memo = dict[str, "dict[str, _Entry] | None"]


def _load(
    moddir: str | os.PathLike[str], opener: Opener | None = None, memo: Memo | None = None
) -> dict[str, _Entry] | None:
    """The parsed ``modules.dep``; None when missing, unreadable, not a file or over the cap.

    ``opener`` opens the file (the agent's resolves it inside the host root).
    """
    if memo is not None:
        where = os.fspath(moddir)
        if where not in memo:
            memo[where] = _load(moddir, opener)
        return memo[where]
    depfile = os.path.join(os.fspath(moddir), "modules.dep")
    try:
        fd = (opener or _open_plain)(depfile)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MODULES_DEP:
            return None
        key = (os.path.abspath(depfile), st.st_ino, st.st_mtime_ns, st.st_size)
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
        readable = reopen(fd)  # an opener may give an O_PATH descriptor: read the same file
        try:
            raw = read_capped(readable, _MAX_MODULES_DEP)
        finally:
            os.close(readable)
    except OSError:
        return None
    finally:
        os.close(fd)
    parsed = _parse(raw.decode("utf-8", errors="surrogateescape"))
    with _cache_lock:
        _cache[key] = parsed
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return parsed


def _inside(moddir: str, relpath: str) -> Path | None:
    """``moddir/relpath`` if it stays inside moddir (lexically), else None. Pure for an
    absolute ``moddir`` (no working directory in it): remembered, as every pass asks
    again for the same modules."""
    if os.path.isabs(moddir):
        return _inside_absolute(moddir, relpath)
    return _inside_uncached(moddir, relpath)


@functools.lru_cache(maxsize=4096)
def _inside_absolute(moddir: str, relpath: str) -> Path | None:
    return _inside_uncached(moddir, relpath)


def _inside_uncached(moddir: str, relpath: str) -> Path | None:
    base = PurePosixPath(os.path.normpath(os.path.abspath(moddir)))
    rel = PurePosixPath(relpath)
    if ".." in rel.parts:
        return None
    if not rel.is_absolute():
        return Path(base / rel) if rel.parts else None
    parts = PurePosixPath(os.path.normpath(relpath)).parts[1:]
    if tuple(parts[: len(base.parts) - 1]) == base.parts[1:]:
        rest = parts[len(base.parts) - 1 :]
        return Path(base.joinpath(*rest)) if rest else None
    # An absolute path as the host sees it: its leading components equal a
    # trailing run of moddir's (e.g. /lib/modules/6.1/... under /host/lib/modules/6.1).
    # /usr/lib and /lib are the same directory on merged-/usr hosts.
    spellings = [parts, parts[1:]] if parts[:2] == ("usr", "lib") else [parts]
    for start in range(1, len(base.parts)):
        tail = base.parts[start:]
        for spelled in spellings:
            if tuple(spelled[: len(tail)]) == tail and len(spelled) > len(tail):
                return Path(base.joinpath(*spelled[len(tail) :]))
    return None


def find_module(
    moddir: str | os.PathLike[str],
    name: str,
    opener: Opener | None = None,
    memo: Memo | None = None,
) -> Path | None:
    """The file ``modules.dep`` names for ``name``, or None.

    None when ``modules.dep`` is missing or unreadable, the module is not
    listed, or its path escapes ``moddir``. The module file itself is not opened.
    """
    entries = _load(moddir, opener, memo)
    if entries is None:
        return None
    entry = entries.get(normalize_module_name(name))
    if entry is None:
        return None
    return _inside(os.fspath(moddir), entry.relpath)


def module_dependencies(
    moddir: str | os.PathLike[str],
    name: str,
    opener: Opener | None = None,
    memo: Memo | None = None,
) -> tuple[str, ...]:
    """Names of the modules ``name`` depends on, as listed in ``modules.dep``.

    In modules.dep order (modprobe loads them last to first). ``()`` when the
    module has none or is not listed (use ``find_module`` to tell these apart).
    """
    entries = _load(moddir, opener, memo)
    if entries is None:
        return ()
    entry = entries.get(normalize_module_name(name))
    if entry is None:
        return ()
    return tuple(d for d in (_module_name(p) for p in entry.rest.split()) if d is not None)
