"""What crosses the process boundary so the gate judges the file being held (issue 65).

The driver container loads ``nvidia-peermem`` from its own root and mounts that
root where the agent reads it only after the load, so the file the agent could
judge by name is not the file ``modprobe`` inserts. The responder holds the
exact one: the open's descriptor is in the permission event, and the kernel
inserts the bytes read through it. So:

- **going up** (the report pipe, or a call for a thread): for each distinct
  file a loader's open of ``nvidia-peermem.ko`` is held on, its identity
  (``st_dev``, ``st_ino``, size, mtime: ``FileKey``) and what the gate judges
  — the ``.modinfo`` name, ``vermagic`` and ``depends``, the ``__versions`` CRCs
  it needs — read by the responder with bounded ``pread``s on the event's
  descriptor (``host/modfile.read_module_fd``: ``.ko``, ``.ko.xz``, ``.ko.zst``,
  ``.ko.gz``; never the opener's offset). A file it cannot read is named
  (``problem``), never trusted: its verdict is ``wait``;
- **coming down** (the lease: ``lease.py``): a verdict per file the agent
  judged, ``GO``, ``REBUILD`` (let go: the kernel refuses it however long it
  waits) or ``WAIT`` (held whatever the gate says), in the same memfd as the
  gate and under the same check word and expiry, so a torn or stale read is no
  verdict at all. A file the agent has not judged yet (its facts on their way)
  goes by the gate, as every held open did before.

The agent parses what comes up strictly (``held_modules``): a malformed entry is
one problem line, never a crash, and only ``HELD_FILES_MAX`` files are judged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from nodeagent.core.names import is_module_name
from nodeagent.core.snapshot import DiskModule, HeldFileKey, HeldModule
from nodeagent.host.fanotify import PermEvent
from nodeagent.host.modfile import ModuleFileError, read_module_fd

GO = 1  # the gate's conditions hold and the file agrees with the loaded stack
REBUILD = 2  # the stack is final and the kernel refuses this file whatever the wait
WAIT = 3  # anything else, an unreadable file too (never trusted): held, gate or not
VERDICT_CODES = {"go": GO, "rebuild": REBUILD, "wait": WAIT}
ENDED = {GO: "gate opened", REBUILD: "rebuild"}  # a held open's report, by its verdict

HELD_FILES_MAX = 16  # distinct files described at once (the rest: not judged)
FACTS_KEPT = 64  # files' facts kept while held (each read once per identity)
CRCS_MAX = 8192  # __versions entries of one file (nvidia.ko imports ~1000)
_TEXT_MAX = 4096
_U32 = 0xFFFFFFFF


def key_of(st: os.stat_result) -> HeldFileKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_held_fd(fd: int, path: str) -> dict[str, Any]:
    """What the gate needs of the module open at ``fd`` (the event's: not closed, its
    offset untouched), as JSON; ``problem`` where it cannot be read."""
    try:
        key: list[int] | None = list(key_of(os.fstat(fd)))
    except OSError as exc:
        return {"file": None, "path": path, "problem": f"cannot stat: {exc.strerror or exc}"}
    try:
        mod = read_module_fd(fd, path)
    except ModuleFileError as exc:
        return {"file": key, "path": path, "problem": str(exc)}
    return {
        "file": key,
        "path": path,
        "name": mod.name,
        "vermagic": mod.vermagic,
        "depends": list(mod.depends),
        "crcs": dict(mod.required_crcs),
    }


def read_held_path(path: str, shown: str) -> dict[str, Any]:
    """The same for a file by path (the simulator, whose events carry no descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        return {"file": None, "path": shown, "problem": f"cannot read: {exc.strerror or exc}"}
    try:
        return read_held_fd(fd, shown)
    finally:
        os.close(fd)


def file_key(value: Any) -> HeldFileKey | None:
    """A file's key as JSON gives it (``[st_dev, st_ino, size, mtime_ns]``), else None."""
    if isinstance(value, list) and len(value) == 4 and all(type(n) is int for n in value):
        return (value[0], value[1], value[2], value[3])
    return None


class HeldFacts:
    """The responder's side: each held nvidia-peermem file's facts, read once per
    identity (``facts_of``: from the event's descriptor by default), kept while held."""

    def __init__(self, facts_of: Callable[[PermEvent, str], dict[str, Any]] | None) -> None:
        self.facts_of = facts_of or (lambda event, path: read_held_fd(event.fd, path))
        self._facts: dict[HeldFileKey, dict[str, Any]] = {}

    def read(
        self, event: PermEvent, path: str, held: Collection[HeldFileKey | None]
    ) -> HeldFileKey | None:
        """The file's key, its facts read unless known (``held``: the keys held now, kept
        when the cache is full); None when it cannot be identified. Raises what reading
        raised (the responder notes it as a fault)."""
        facts = self.facts_of(event, path)
        key = file_key(facts.get("file"))
        if key is not None and key not in self._facts:
            if len(self._facts) >= FACTS_KEPT:
                self._facts = {k: v for k, v in self._facts.items() if k in held}
            self._facts[key] = facts
        return key

    def described(self, keys: Iterable[HeldFileKey | None]) -> list[dict[str, Any]]:
        """The facts of each distinct key, in order, at most ``HELD_FILES_MAX``."""
        distinct = [k for k in dict.fromkeys(keys) if k is not None and k in self._facts]
        return [self._facts[k] for k in distinct[:HELD_FILES_MAX]]


def _text(doc: Mapping[str, Any], key: str, *, optional: bool = False) -> str | None:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > _TEXT_MAX:
        raise ValueError(f"{key} is not a string of at most {_TEXT_MAX} characters")
    return value


def _key(value: Any) -> HeldFileKey:
    key = file_key(value)
    if key is None or min(key) < 0:
        raise ValueError("file is not [st_dev, st_ino, size, mtime_ns]")
    return key


def held_module(doc: Any) -> HeldModule | None:
    """One entry as the responder sent it; None for a file it could not identify (no
    key: nothing to give a verdict for). ValueError naming what is malformed."""
    if not isinstance(doc, dict):
        raise ValueError("an entry is not an object")
    path = _text(doc, "path") or "?"
    if doc.get("file") is None:
        return None
    key = _key(doc["file"])
    problem = _text(doc, "problem", optional=True)
    if problem is not None:
        return HeldModule(key, path, DiskModule(name="nvidia_peermem", path=path, problem=problem))
    name = _text(doc, "name") or ""
    depends = doc.get("depends")
    if not isinstance(depends, list) or not all(
        isinstance(d, str) and is_module_name(d) for d in depends
    ):
        raise ValueError("depends is not a list of module names")
    crcs = doc.get("crcs")
    if not isinstance(crcs, dict) or len(crcs) > CRCS_MAX:
        raise ValueError(f"crcs is not an object of at most {CRCS_MAX} symbols")
    for sym, crc in crcs.items():
        if len(sym) > _TEXT_MAX or not isinstance(crc, int) or not 0 <= crc <= _U32:
            raise ValueError(f"crcs[{sym[:64]!r}] is not a 32-bit CRC")
    module = DiskModule(
        name=name.replace("-", "_"),
        path=path,
        depends=tuple(d.replace("-", "_") for d in depends),
        required_crcs=MappingProxyType(dict(crcs)),
    )
    return HeldModule(key, path, module, _text(doc, "vermagic", optional=True))


def held_modules(docs: Iterable[Any]) -> tuple[tuple[HeldModule, ...], list[str]]:
    """What the responder said it holds, for the snapshot: (modules, problems)."""
    out: list[HeldModule] = []
    problems: list[str] = []
    for i, doc in enumerate(docs):
        if i >= HELD_FILES_MAX:
            problems.append(
                f"hold: more than {HELD_FILES_MAX} distinct files held; the rest are not "
                "judged (the gate alone decides for them)"
            )
            break
        try:
            held = held_module(doc)
        except ValueError as exc:
            problems.append(
                f"hold: a held file's description is malformed ({exc}); it is not judged "
                "(the gate alone decides for it)"
            )
            continue
        if held is not None:
            out.append(held)
    return tuple(out), problems
