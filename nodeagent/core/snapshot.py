"""One immutable observation of the node: what every guard decides over.

Built by ``nodeagent.host.observe`` from the union of what the guards declare
they need (``core/needs.py``); guards only read it. Anything the host layer
could not read cleanly is kept as a ``problem`` string on the fact it
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

    @property
    def outside_refs(self) -> int:
        """References that are not module holders: a mount, a device, a handle (0 if unknown)."""
        if self.refcnt is None:
            return 0
        return max(0, self.refcnt - len(self.holders))


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


# Which file a held open is of: (st_dev, st_ino, st_size, st_mtime_ns) of the opened file,
# as the hold's responder read them from the open's own descriptor.
HeldFileKey = tuple[int, int, int, int]


@dataclass(frozen=True)
class HeldModule:
    """A module file a loader's open of is held now (``guards/peermem/``): what the hold's
    responder read from the exact descriptor ``modprobe`` will insert from, so the gate
    judges those bytes and not a file by the same name elsewhere."""

    file: HeldFileKey
    path: str  # as the opener's mount namespace names it (the container's own root)
    # name, depends, the __versions CRCs it needs (path: ``path``); problem: unreadable
    module: DiskModule
    vermagic: str | None = None


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
    device: tuple[int, int] | None = None  # (major, minor) of its filesystem, to match proc/locks
    # When the agent last saw it opened (or created), on the snapshot's clock; only for a
    # file a guard asked to see opened (``Needs.opens``), None when not seen since start.
    opened_at: float | None = None


@dataclass(frozen=True)
class TextFact:
    """A small text file's content (None when absent or unreadable: see ``problem``)."""

    path: str  # relative to the host root
    text: str | None
    problem: str | None = None


@dataclass(frozen=True)
class FileLock:
    """One line of /proc/locks: who holds which lock on which file (device, inode)."""

    kind: str  # FLOCK, POSIX, OFDLCK, LEASE ...
    access: str  # READ or WRITE
    pid: int
    device: tuple[int, int]
    inode: int


@dataclass(frozen=True)
class Mount:
    """One mount of /proc/1/mountinfo (the host's mount namespace)."""

    mount_point: str
    source: str
    fstype: str
    options: tuple[str, ...]  # mount options then superblock options (e.g. proto=rdma)


@dataclass(frozen=True)
class NvmeController:
    """An NVMe controller under /sys/class/nvme (local PCIe or NVMe-oF)."""

    name: str  # nvme0
    transport: str  # pcie, rdma, tcp, fc, loop; "unknown" when absent or unreadable
    subsysnqn: str
    address: str = ""
    problem: str | None = None  # what of it could not be read


@dataclass(frozen=True)
class NvmetPort:
    """An NVMe-oF target port under /sys/kernel/config/nvmet/ports (the target side)."""

    name: str  # the port's configfs directory, e.g. "1"
    transport: str  # addr_trtype: rdma, tcp, loop, fc; "unknown" when unreadable
    address: str  # addr_traddr:addr_trsvcid
    subsystems: tuple[str, ...]  # NQNs linked to the port (enabled while non-empty)
    problem: str | None = None  # what of it could not be read


@dataclass(frozen=True)
class PciDevice:
    """One PCI function's IDs (``sys/bus/pci/devices/<address>``); None: unreadable."""

    vendor: int | None
    pci_class: int | None  # 24 bits: class, subclass, programming interface


@dataclass(frozen=True)
class NodeSnapshot:
    now: float  # seconds; wall clock of the observation (guards never read a clock)
    kernel: str
    modules: Mapping[str, LoadedModule]  # only the modules some guard declared (and chains)
    disk: Mapping[str, DiskModule]  # the .ko files guards compare against, by module name
    files: Mapping[str, FileFact] = field(default_factory=lambda: EMPTY)  # by path
    listings: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: EMPTY)  # dir -> names
    texts: Mapping[str, TextFact] = field(default_factory=lambda: EMPTY)  # by path
    locks: tuple[FileLock, ...] = ()
    mounts: tuple[Mount, ...] = ()
    nvme: tuple[NvmeController, ...] = ()
    nvmet_ports: tuple[NvmetPort, ...] = ()
    problems: tuple[str, ...] = ()  # node-wide read problems (e.g. /sys/module unreadable)
    # What the reader of a list of facts above (by field name: "locks", "mounts",
    # "nvme", "nvmet_ports") could not read: that list may be missing facts.
    # Also in ``problems``.
    read_problems: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: EMPTY)
    sriov: SriovObservation = EMPTY_SRIOV  # SR-IOV PFs and their VFs (guards/sriov/observe.py)
    # PCI functions by address, when a guard needs them (core/applicability.py); None: not
    # read, or the bus listing was unreadable (then no device is known absent).
    pci: Mapping[str, PciDevice] | None = None
    # The module files a loader's open of is held now, when the hold is on.
    held: tuple[HeldModule, ...] = ()

    def module(self, name: str) -> LoadedModule | None:
        return self.modules.get(name)

    def disk_module(self, name: str) -> DiskModule:
        return self.disk.get(name) or DiskModule(name=name, path=None, problem="not looked up")

    def file(self, path: str) -> FileFact:
        return self.files.get(path) or FileFact(path=path, present=False, problem="not observed")

    def listing(self, path: str) -> tuple[str, ...]:
        return self.listings.get(path, ())

    def text(self, path: str) -> TextFact:
        return self.texts.get(path) or TextFact(path=path, text=None, problem="not observed")
