"""What a guard needs observed; the observer reads the union of every guard's needs.

A guard's ``needs()`` returns one ``Needs``; ``Needs.union`` merges them. The
host layer (``host/observe.py``) reads exactly what the union names, and the
agent watches the directories ``watch_dirs`` derives from it, so a guard never
has to touch the observer or the agent loop to be observed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

HOST_TREE = ""  # the host's own /lib/modules (a driver root of "" means the host)


@dataclass(frozen=True)
class DiskNeed:
    """Find ``name``'s .ko through modules.dep under these driver roots, first hit wins.

    Each tree is a driver root relative to the host root (``run/mellanox/drivers``,
    or ``HOST_TREE``); the observer appends ``lib/modules/<kernel>``. With
    ``follow_depends`` the modules the .ko depends on are read too, each from the
    trees another need declares for it, else from these.
    """

    name: str
    trees: tuple[str, ...]
    follow_depends: bool = False


@dataclass(frozen=True)
class Needs:
    modules: frozenset[str] = frozenset()  # /sys/module/<name> entries to read
    # Chain roots: read them, every module holding them (transitively) and, from
    # modules.dep in ``chain_trees``, every module they depend on with its holders.
    chains: frozenset[str] = frozenset()
    chain_trees: tuple[str, ...] = ()
    disk: tuple[DiskNeed, ...] = ()
    files: frozenset[str] = frozenset()  # marker files (presence + identity), watched
    # Of those, files whose every opening wakes the loop (an inotify IN_OPEN watch on the
    # file itself) and is observed as ``FileFact.opened_at``: MOFED's lock, whose next
    # attempt opens it and then takes a flock, which no watch sees.
    opens: frozenset[str] = frozenset()
    # Of those, markers whose presence means "stop" (MOFED's blacklist file): a
    # symlink, directory or FIFO there counts as present; elsewhere as absent.
    present_if_odd: frozenset[str] = frozenset()
    listings: frozenset[str] = frozenset()  # directories whose entry names are read, watched
    # Small text files whose content is read each pass (procfs: not watched; they change
    # with a module load, which a uevent reports), e.g. proc/driver/nvidia/version.
    texts: frozenset[str] = frozenset()
    watch: frozenset[str] = frozenset()  # further directories to watch (e.g. for a hold file)
    locks: bool = False  # /proc/locks
    mounts: bool = False  # /proc/1/mountinfo
    nvme: bool = False  # NVMe controllers (/sys/class/nvme) and NVMe-oF target ports (configfs)
    sriov: bool = False  # SR-IOV PFs and their VFs, through netlink
    pci: bool = False  # every PCI function's vendor and class (what the node has)
    held: bool = False  # the module files a loader's open of is held now (the hold's)

    @staticmethod
    def union(all_needs: Iterable[Needs]) -> Needs:
        out = Needs()
        disk: dict[str, DiskNeed] = {}
        trees: list[str] = []
        for n in all_needs:
            for d in n.disk:
                disk.setdefault(d.name, d)  # the first guard's trees win for a shared name
            trees += [t for t in n.chain_trees if t not in trees]
            out = Needs(
                modules=out.modules | n.modules,
                chains=out.chains | n.chains,
                files=out.files | n.files,
                opens=out.opens | n.opens,
                present_if_odd=out.present_if_odd | n.present_if_odd,
                listings=out.listings | n.listings,
                texts=out.texts | n.texts,
                watch=out.watch | n.watch,
                locks=out.locks or n.locks,
                mounts=out.mounts or n.mounts,
                nvme=out.nvme or n.nvme,
                sriov=out.sriov or n.sriov,
                pci=out.pci or n.pci,
                held=out.held or n.held,
            )
        return Needs(
            modules=out.modules,
            chains=out.chains,
            chain_trees=tuple(trees),
            disk=tuple(disk.values()),
            files=out.files,
            opens=out.opens,
            present_if_odd=out.present_if_odd,
            listings=out.listings,
            texts=out.texts,
            watch=out.watch,
            locks=out.locks,
            mounts=out.mounts,
            nvme=out.nvme,
            sriov=out.sriov,
            pci=out.pci,
            held=out.held,
        )

    def watch_dirs(self) -> list[str]:
        """Directories to watch with inotify: the markers' parents, listed dirs, declared dirs.

        sysfs and procfs emit no inotify events; module state is re-read on uevents
        and on the periodic resync.
        """
        dirs = {f.rsplit("/", 1)[0] if "/" in f else "." for f in self.files}
        return sorted(dirs | self.listings | self.watch)
