"""Build NodeSnapshots for pure guard tests: a healthy node, then change one thing."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

from nodeagent.core.snapshot import DiskModule, FileFact, FileId, LoadedModule, NodeSnapshot

KVER = "5.14.0-427.96.1.el9_4.aarch64+64k"
MOFED_MODULES = "run/mellanox/drivers/lib/modules"
MOFED_DIR = f"{MOFED_MODULES}/{KVER}/updates"
GEN_A = {  # MOFED 25.07 srcversions (seed 003's transitions)
    "mlx5_core": "1852822C2F9ABA6A93704E4",
    "mlx5_ib": "0A1B2C3D4E5F60718293A4B",
    "ib_core": "77E1A5D2C0B9F8E7D6C5B4A",
    "ib_uverbs": "3C2B1A09F8E7D6C5B4A3928",
}
GEN_B = {  # MOFED 25.10
    "mlx5_core": "AE6029416A873D39E95B044",
    "mlx5_ib": "B1C2D3E4F5061728394A5B6",
    "ib_core": "C0FFEE1234567890ABCDEF1",
    "ib_uverbs": "DEADBEEF0123456789ABCDE",
}
READY = "run/mellanox/drivers/.driver-ready"
LOCK = "run/mellanox/drivers/.lock"
BLACKLIST = "etc/modprobe.d/blacklist-ofed-modules.conf"
VALIDATIONS = "run/nvidia/validations"
CRC_OK = 0x368A11CB
CRC_OTHER = 0x8D5FEB7B
PEER_SYMS = ("ib_register_peer_memory_client", "ib_unregister_peer_memory_client")


def loaded(name: str, srcversion: str | None = None, **kw: Any) -> LoadedModule:
    base = {"initstate": "live", "refcnt": 0, "srcversion": srcversion, "build_id": None}
    base.update(kw)
    return LoadedModule(name=name, **base)


def disk(name: str, srcversion: str | None, path: str | None = None, **kw: Any) -> DiskModule:
    return DiskModule(
        name=name,
        path=path if path is not None else f"{MOFED_DIR}/{name}.ko",
        srcversion=srcversion,
        **kw,
    )


def flag(present: bool = True, inode: int = 100, mtime: int = 1) -> FileFact:
    return FileFact(
        path=READY,
        present=present,
        ident=FileId(inode, mtime, mtime) if present else None,
    )


def healthy(gen: dict[str, str] = GEN_B, now: float = 1000.0) -> NodeSnapshot:
    """A node where MOFED finished, the RDMA stack is final, nvidia is up, peermem not loaded."""
    modules = {name: loaded(name, sv) for name, sv in gen.items()}
    modules["nvidia"] = loaded("nvidia", "N1D1A000000000000000000", refcnt=2)
    disks = {name: disk(name, sv) for name, sv in gen.items()}
    disks["ib_core"] = replace(
        disks["ib_core"], exported_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, CRC_OK))
    )
    disks["nvidia_peermem"] = DiskModule(
        name="nvidia_peermem",
        path=f"run/nvidia/driver/lib/modules/{KVER}/kernel/drivers/video/nvidia-peermem.ko",
        srcversion="PEERMEM0000000000000000",
        depends=("ib_core", "nvidia"),
        required_crcs=MappingProxyType(dict.fromkeys(PEER_SYMS, CRC_OK)),
    )
    return NodeSnapshot(
        now=now,
        kernel=KVER,
        modules=MappingProxyType(modules),
        disk=MappingProxyType(disks),
        files=MappingProxyType(
            {
                f.path: f
                for f in (
                    flag(True),
                    FileFact(path=BLACKLIST, present=False),
                    FileFact(path=LOCK, present=False),
                )
            }
        ),
        # MOFED's tree on the host, for this kernel (core/peermem.py: its note otherwise)
        listings=MappingProxyType({VALIDATIONS: (), MOFED_MODULES: (KVER,)}),
    )


def with_files(snap: NodeSnapshot, *facts: FileFact) -> NodeSnapshot:
    files = dict(snap.files)
    files.update((f.path, f) for f in facts)
    return replace(snap, files=MappingProxyType(files))


def blacklist_file(present: bool = True) -> FileFact:
    return FileFact(path=BLACKLIST, present=present, ident=FileId(7, 1, 1) if present else None)


def with_validations(snap: NodeSnapshot, *names: str) -> NodeSnapshot:
    return replace(snap, listings=MappingProxyType({**snap.listings, VALIDATIONS: names}))


def with_modules(snap: NodeSnapshot, **mods: LoadedModule | None) -> NodeSnapshot:
    m = dict(snap.modules)
    for name, mod in mods.items():
        if mod is None:
            m.pop(name, None)
        else:
            m[name] = mod
    return replace(snap, modules=MappingProxyType(m))


def with_disk(snap: NodeSnapshot, **disks: DiskModule) -> NodeSnapshot:
    d = dict(snap.disk)
    d.update(disks)
    return replace(snap, disk=MappingProxyType(d))
