"""One immutable observation of the node: what every guard decides over.

Built by ``nodeagent.host.observe``; guards only read it. Anything the host
layer could not read cleanly is kept as a ``problem`` string on the fact it
concerns, so a guard can close with a reason instead of the agent crashing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nodeagent.core.sriov_model import EMPTY_SRIOV, SriovObservation

EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class LoadedModule:
    """A module present under /sys/module/<name> with an initstate (i.e. loadable, not builtin)."""

    name: str
    initstate: str | None  # "live" | "coming" | "going"; None when unreadable
    refcnt: int | None
    srcversion: str | None
    build_id: str | None  # lowercase hex of /sys/module/<m>/notes/.note.gnu.build-id
    holders: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # e.g. "refcnt is 'x1' (not a number)"

    @property
    def live(self) -> bool:
        return self.initstate == "live"


@dataclass(frozen=True)
class DiskModule:
    """The .ko file modprobe would pick for a module name, as read from disk."""

    name: str
    path: str | None  # relative to the host root; None when not found
    srcversion: str | None = None
    build_id: str | None = None
    depends: tuple[str, ...] = ()
    required_crcs: Mapping[str, int] = field(default_factory=lambda: EMPTY)
    exported_crcs: Mapping[str, int] = field(default_factory=lambda: EMPTY)
    problem: str | None = None  # why it could not be found or read


@dataclass(frozen=True)
class FileId:
    """Identity of one incarnation of a file: a recreated or touched file differs."""

    inode: int
    mtime_ns: int
    ctime_ns: int


@dataclass(frozen=True)
class FileFact:
    """A marker file. ``present`` is False for a symlink or non-regular file (see ``problem``)."""

    path: str  # relative to the host root
    present: bool
    ident: FileId | None = None
    problem: str | None = None


@dataclass(frozen=True)
class NodeSnapshot:
    now: float  # seconds; wall clock of the observation (guards never read a clock)
    kernel: str
    modules: Mapping[str, LoadedModule]
    mofed_ready: FileFact
    mofed_blacklist: FileFact
    mofed_lock: FileFact
    validations: tuple[str, ...]  # names of files under run/nvidia/validations
    # The .ko files the guards compare against: the RDMA stack (from the MOFED
    # driver root, then lib/modules), nvidia_peermem (from the GPU driver root)
    # and the modules nvidia_peermem depends on.
    disk: Mapping[str, DiskModule]
    problems: tuple[str, ...] = ()  # node-wide read problems (e.g. /sys/module unreadable)
    sriov: SriovObservation = EMPTY_SRIOV  # SR-IOV PFs and their VFs (nodeagent.host.sriov)

    def module(self, name: str) -> LoadedModule | None:
        return self.modules.get(name)

    def disk_module(self, name: str) -> DiskModule:
        return self.disk.get(name) or DiskModule(name=name, path=None, problem="not looked up")
