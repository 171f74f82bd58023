"""Module trees on the simulated disk: which modules exist, in which generation.

A *generation* is one build of a set of modules (the kernel's own in-tree
RDMA stack, a host DKMS build of MOFED 24.10, the MOFED 25.07 container's
build ...). Every module of a generation gets its own srcversion and GNU
build-id, and every exported symbol a CRC derived from the symbol's ABI tag in
that generation: two generations that share a tag for a symbol agree on its
CRC, as two builds whose headers declare it the same way do.

Files are real ELF ``.ko`` files (``nodeagent.sim.kofile``), so the agent's
own reader parses them; ``depmod`` here writes ``modules.dep`` from the
symbols the files need and export, as the real one does.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from nodeagent.host.modfile import ModuleFile, ModuleFileError, read_module_file
from nodeagent.sim.kofile import write_module_file

__all__ = [
    "GPU_MODULES",
    "PEER_MEMORY_API",
    "RDMA_MODULES",
    "STORAGE_MODULES",
    "Generation",
    "ModSpec",
    "build_id_of",
    "crc_of",
    "depmod",
    "install_generation",
    "read_symvers",
    "srcversion_of",
    "write_symvers",
]

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class ModSpec:
    name: str
    subdir: str  # where the file sits in an in-tree layout (kernel/<subdir>/<name>.ko)
    uses: tuple[str, ...] = ()  # modules whose symbols it needs
    exports: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # the symbols it needs (from the modules in ``uses``)


PEER_MEMORY_API = ("ib_register_peer_memory_client", "ib_unregister_peer_memory_client")

RDMA_MODULES: tuple[ModSpec, ...] = (
    ModSpec(
        "ib_core",
        "drivers/infiniband/core",
        exports=("ib_register_client", "ib_register_device", "ib_query_port", *PEER_MEMORY_API),
    ),
    ModSpec(
        "ib_uverbs",
        "drivers/infiniband/core",
        ("ib_core",),
        ("ib_uverbs_get_ucontext_file",),
        ("ib_register_client",),
    ),
    ModSpec("ib_umad", "drivers/infiniband/core", ("ib_core",), (), ("ib_register_client",)),
    ModSpec(
        "ib_cm",
        "drivers/infiniband/core",
        ("ib_core",),
        ("ib_create_cm_id",),
        ("ib_register_client",),
    ),
    ModSpec(
        "iw_cm",
        "drivers/infiniband/core",
        ("ib_core",),
        ("iw_create_cm_id",),
        ("ib_query_port",),
    ),
    ModSpec(
        "rdma_cm",
        "drivers/infiniband/core",
        ("ib_core", "ib_cm", "iw_cm"),
        ("rdma_create_id", "rdma_connect"),
        ("ib_register_client", "ib_create_cm_id", "iw_create_cm_id"),
    ),
    ModSpec(
        "rdma_ucm",
        "drivers/infiniband/core",
        ("rdma_cm", "ib_uverbs", "ib_core"),
        (),
        ("rdma_create_id", "ib_uverbs_get_ucontext_file", "ib_register_client"),
    ),
    ModSpec(
        "ib_ipoib",
        "drivers/infiniband/ulp/ipoib",
        ("ib_core", "ib_cm"),
        (),
        ("ib_register_client", "ib_create_cm_id"),
    ),
    ModSpec(
        "mlx5_core",
        "drivers/net/ethernet/mellanox/mlx5/core",
        exports=("mlx5_cmd_exec", "mlx5_core_create_mkey"),
    ),
    ModSpec(
        "mlx5_ib",
        "drivers/infiniband/hw/mlx5",
        ("mlx5_core", "ib_core", "ib_uverbs"),
        (),
        ("mlx5_cmd_exec", "ib_register_device", "ib_uverbs_get_ucontext_file"),
    ),
)

STORAGE_MODULES: tuple[ModSpec, ...] = (
    ModSpec("sunrpc", "net/sunrpc", exports=("rpc_create", "xprt_register_transport")),
    ModSpec(
        "rpcrdma",
        "net/sunrpc/xprtrdma",
        ("sunrpc", "rdma_cm", "ib_core"),
        (),
        ("xprt_register_transport", "rdma_create_id", "ib_register_client"),
    ),
)

GPU_MODULES: tuple[ModSpec, ...] = (
    ModSpec("nvidia", "drivers/video", exports=("nvidia_p2p_get_pages", "nvidia_p2p_put_pages")),
    ModSpec("nvidia_uvm", "drivers/video", ("nvidia",), (), ("nvidia_p2p_get_pages",)),
    ModSpec("nvidia_modeset", "drivers/video", ("nvidia",), (), ("nvidia_p2p_put_pages",)),
    ModSpec(
        "nvidia_peermem",
        "drivers/video",
        ("nvidia", "ib_core"),
        (),
        ("nvidia_p2p_get_pages", "nvidia_p2p_put_pages", *PEER_MEMORY_API),
    ),
)


@dataclass(frozen=True)
class Generation:
    """One build of a module set."""

    key: str  # unique, e.g. "mofed-25.07"
    label: str  # for people, e.g. "MOFED 25.07-0.9.7.0"
    version: str  # short version ("25.07"); also the default ABI tag of every exported symbol
    abi_overrides: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    srcversion: bool = True  # Debian-style in-tree modules carry none
    omit_exports: tuple[str, ...] = ()  # e.g. the in-tree ib_core has no peer-memory API
    layout: str = "kernel"  # "kernel" (kernel/<subdir>/), "dkms" (updates/dkms/), "extra"
    compress: str | None = None  # "xz" for distro in-tree modules

    def tag(self, symbol: str) -> str:
        return self.abi_overrides.get(symbol, self.version)

    def relpath(self, spec: ModSpec) -> str:
        base = f"{spec.name.replace('_', '-') if spec.name.startswith('nvidia') else spec.name}.ko"
        if self.layout == "dkms":
            rel = f"updates/dkms/{base}"
        elif self.layout == "extra":
            rel = f"extra/mlnx-ofa_kernel/{spec.subdir}/{base}"
        else:
            rel = f"kernel/{spec.subdir}/{base}"
        return rel + (f".{self.compress}" if self.compress else "")


def crc_of(symbol: str, tag: str) -> int:
    return zlib.crc32(f"{symbol}/{tag}".encode()) & 0xFFFFFFFF


def srcversion_of(name: str, gen: Generation) -> str:
    return hashlib.sha1(f"src:{name}:{gen.key}".encode()).hexdigest()[:23].upper()


def build_id_of(name: str, gen: Generation, kver: str) -> bytes:
    return hashlib.sha1(f"bid:{name}:{gen.key}:{kver}".encode()).digest()


def vermagic_of(kver: str) -> str:
    return f"{kver} SMP preempt mod_unload modversions aarch64"


def exports_of(spec: ModSpec, gen: Generation) -> dict[str, int]:
    return {s: crc_of(s, gen.tag(s)) for s in spec.exports if s not in gen.omit_exports}


def install_generation(
    moddir: Path,
    kver: str,
    gen: Generation,
    specs: Iterable[ModSpec],
    *,
    against: Mapping[str, int] | None = None,
) -> list[Path]:
    """Write ``gen``'s build of ``specs`` under ``moddir`` (``<root>/lib/modules/<kver>``).

    ``against``: the CRCs of the headers the modules were compiled against
    (``Module.symvers``); symbols found there get that CRC in ``__versions``,
    the others the CRC of this generation. Files are written atomically (a new
    inode), as a package manager replaces them.
    """
    written = []
    for spec in specs:
        required = {
            sym: against[sym] if against and sym in against else crc_of(sym, gen.tag(sym))
            for sym in spec.needs
        }
        target = moddir / gen.relpath(spec)
        target.parent.mkdir(parents=True, exist_ok=True)
        out = write_module_file(
            target.parent / f".new-{spec.name}.ko",
            compress=gen.compress,  # type: ignore[arg-type]
            name=spec.name,
            srcversion=srcversion_of(spec.name, gen) if gen.srcversion else None,
            vermagic=vermagic_of(kver),
            depends=spec.uses,
            build_id=build_id_of(spec.name, gen, kver),
            required_crcs=required,
            exported_crcs=exports_of(spec, gen),
        )
        os.replace(out, target)
        written.append(target)
    return written


_ORDER = {"updates": 0, "extra": 1, "kernel": 2}


def _priority(rel: str) -> int:
    return _ORDER.get(rel.split("/", 1)[0], 3)


def depmod(moddir: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Write ``moddir/modules.dep`` from the .ko files under ``moddir``.

    Dependencies come from symbols, as in depmod: a module depends on the
    module of this tree that exports a symbol it needs. When a name exists
    twice, ``updates/`` wins over ``extra/`` over ``kernel/``. Each line lists
    the dependencies so that loading them last-to-first works (modprobe's
    order). Returns name -> (relpath, deps).
    """
    files: dict[str, tuple[str, ModuleFile]] = {}
    for dirpath, _dirs, names in os.walk(moddir):
        for fname in sorted(names):
            if ".ko" not in fname or fname.startswith("."):
                continue
            path = Path(dirpath) / fname
            rel = path.relative_to(moddir).as_posix()
            try:
                info = read_module_file(path)
            except ModuleFileError:
                continue
            have = files.get(info.name)
            if have is None or (_priority(rel), rel) < (_priority(have[0]), have[0]):
                files[info.name] = (rel, info)
    exporter: dict[str, str] = {}
    for name in sorted(files):
        for sym in files[name][1].exported_crcs:
            exporter.setdefault(sym, name)
    direct = {
        name: sorted({exporter[s] for s in info.required_crcs if s in exporter} - {name})
        for name, (_rel, info) in files.items()
    }

    def closure(name: str) -> list[str]:
        order: list[str] = []  # post-order: a module after everything it needs

        def visit(m: str, seen: set[str]) -> None:
            for d in direct.get(m, ()):
                if d not in seen:
                    seen.add(d)
                    visit(d, seen)
                    order.append(d)

        visit(name, {name})
        return order[::-1]  # modules.dep: dependents first, load from the end

    table = {name: (rel, tuple(closure(name))) for name, (rel, _info) in sorted(files.items())}
    lines = [
        f"{rel}: {' '.join(table[d][0] for d in deps)}".rstrip() + "\n"
        for _name, (rel, deps) in sorted(table.items(), key=lambda kv: kv[1][0])
    ]
    moddir.mkdir(parents=True, exist_ok=True)
    tmp = moddir / ".modules.dep.new"
    tmp.write_text("".join(lines))
    os.replace(tmp, moddir / "modules.dep")
    return table


def write_symvers(path: Path, gen: Generation, specs: Sequence[ModSpec]) -> None:
    """A ``Module.symvers`` (the headers' record of exported CRCs) for ``gen``."""
    lines = []
    for spec in specs:
        for sym, crc in exports_of(spec, gen).items():
            lines.append(f"0x{crc:08x}\t{sym}\t{spec.subdir}/{spec.name}\tEXPORT_SYMBOL\t\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(sorted(lines)))


def read_symvers(path: Path) -> dict[str, int] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            try:
                out[parts[1]] = int(parts[0], 16)
            except ValueError:
                continue
    return out
