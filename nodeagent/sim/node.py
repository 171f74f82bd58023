"""The simulated node: a temp host root, its kernel, its files and its timeline.

Every actor (MOFED container, GPU driver container, the host) reads and writes
the node through this object, so each change is visible to the agent exactly
as on a real node (files under the host root, sysfs, uevents) and every line
an actor prints lands in one timeline, in seed-time.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nodeagent.sim.clock import Scheduler
from nodeagent.sim.kernel import SimKernel
from nodeagent.sim.modes import DEFAULT_MODE, MODES, DeploymentMode
from nodeagent.sim.modtree import (
    Generation,
    ModSpec,
    build_id_of,
    depmod,
    install_generation,
    read_symvers,
    write_symvers,
)

__all__ = ["COLUMNS", "GPU_DRIVER_ROOT", "LOCK", "Node", "SimEvent"]

COLUMNS = ("MOFED", "GPU driver", "agent", "kernel")

READY = "run/mellanox/drivers/.driver-ready"
LOCK = "run/mellanox/drivers/.lock"
LOCKS = "proc/locks"
MOUNTINFO = "proc/1/mountinfo"
# A booted host always has a mount table (the storage guard refuses to act without one).
ROOT_MOUNT = "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro"
BLACKLIST = "etc/modprobe.d/blacklist-ofed-modules.conf"
GATE = "run/nodeagent/peermem.gate"  # what the agent publishes; no operator container reads it
CTR_READY = "run/nvidia/validations/.driver-ctr-ready"
# Where the GPU driver container bind-mounts its own root (nvidia-driver _mount_rootfs).
GPU_DRIVER_ROOT = "run/nvidia/driver"
BLACKLISTED = [
    "mlx5_core",
    "mlx5_ib",
    "ib_umad",
    "ib_uverbs",
    "ib_ipoib",
    "rdma_cm",
    "rdma_ucm",
    "ib_core",
    "ib_cm",
    "iw_cm",
]


@dataclass(frozen=True)
class SimEvent:
    t: float  # seed-seconds since the scenario's start
    column: str  # one of COLUMNS
    text: str
    kind: str = "line"  # "line": what a party printed or did; "state": the kernel's state now


# What a node can have on its PCI bus: (address, vendor, class).
HARDWARE: dict[str, tuple[str, str, str]] = {
    "gpu": ("0000:3b:00.0", "0x10de", "0x030200"),  # an NVIDIA 3D controller (H100)
    "rdma-nic": ("0000:5e:00.0", "0x15b3", "0x020700"),  # a ConnectX in InfiniBand mode
}


class Node:
    def __init__(
        self,
        root: Path,
        kver: str,
        *,
        seed: int,
        arch: str = "aarch64",
        mode: DeploymentMode | None = None,
        hardware: tuple[str, ...] = ("gpu", "rdma-nic"),
    ) -> None:
        """``hardware``: what the node has on its PCI bus (``HARDWARE``'s keys): a GPU
        node with a ConnectX NIC by default; a NIC-only or GPU-only node leaves one out."""
        self.root = Path(root)
        self.hardware = hardware
        self.kver = kver
        self.mode = mode or MODES[DEFAULT_MODE]  # what the operator containers are set to
        self.arch = arch
        self.sched = Scheduler(start=-600.0)  # boot: state before the scenario's t=0
        self.kernel = SimKernel(self.root, kver, self.sched)
        self.rng = random.Random(seed)
        self.events: list[SimEvent] = []
        self.file_log: list[tuple[float, str, str]] = []  # (t, "write"|"remove", rel)
        self.version = 0
        self.closed = False
        self.dtk_busy = False  # the shared driver toolkit is compiling MOFED
        self.generation_of: dict[str, str] = {}  # build-id hex -> generation label
        self.headers_version: str | None = None  # the MOFED whose headers are in place
        for d in (
            "run/mellanox/drivers",
            "run/nvidia/validations",
            "run/nodeagent",
            "etc",
            "proc/1",
        ):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if not (self.root / MOUNTINFO).exists():
            (self.root / MOUNTINFO).write_text(ROOT_MOUNT + "\n")
        # A host bridge on every node; then what it has.
        self.kernel.add_pci_device("0000:00:00.0", "0x8086", "0x060000")
        for what in hardware:
            self.kernel.add_pci_device(*HARDWARE[what])

    # -- where things are -------------------------------------------------------

    @property
    def host_moddir(self) -> Path:
        return self.root / "lib/modules" / self.kver

    @property
    def mofed_moddir(self) -> Path:
        return self.root / "run/mellanox/drivers/lib/modules" / self.kver

    @property
    def gpu_moddir(self) -> Path:
        return self.root / GPU_DRIVER_ROOT / "lib/modules" / self.kver

    @property
    def mofed_symvers(self) -> Path:
        return (
            self.root / "run/mellanox/drivers/usr/src/ofa_kernel" / self.arch / self.kver
        ) / "Module.symvers"

    def moddir(self, where: str) -> Path:
        """``host``, ``mofed``, ``gpu`` (the GPU driver root as the host sees it, at
        ``run/nvidia/driver``), or a container's own root (host-relative, e.g. the runtime's
        overlay of the GPU driver container): that tree's ``lib/modules/<kver>``."""
        named = {"host": self.host_moddir, "mofed": self.mofed_moddir, "gpu": self.gpu_moddir}
        return named.get(where) or self.root / where.strip("/") / "lib/modules" / self.kver

    # -- time and timeline ------------------------------------------------------

    def now(self) -> float:
        return self.sched.now()

    def sleep(self, seconds: float) -> None:
        self.sched.sleep(seconds)

    def emit(self, column: str, text: str, kind: str = "line") -> None:
        """A timeline line; lines before t=0 (the boot that sets the scene) are not kept."""
        if self.closed or self.now() < 0:
            return
        self.events.append(SimEvent(round(self.now(), 3), column, text, kind))

    # -- files --------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file()

    def write(self, rel: str, text: str = "") -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.new")
        tmp.write_text(text)
        os.replace(tmp, path)
        self.version += 1
        self.file_log.append((self.now(), "write", rel))

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / rel)
            self.version += 1
            self.file_log.append((self.now(), "remove", rel))

    def world_version(self) -> int:
        return self.version + self.kernel.version

    def flock(self, rel: str, pid: int, held: bool) -> None:
        """A FLOCK on ``rel`` by ``pid`` enters (or leaves) proc/locks, as the kernel shows it."""
        path = self.root / rel
        if held and not path.exists():
            self.write(rel)
        st = os.stat(path)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        line = f"FLOCK  ADVISORY  WRITE {pid} {where} 0 EOF"
        locks = self.root / LOCKS
        current = [
            entry.split(": ", 1)[1]
            for entry in (locks.read_text().splitlines() if locks.exists() else [])
            if ": " in entry
        ]
        current = [c for c in current if c != line] + ([line] if held else [])
        locks.write_text("".join(f"{i}: {c}\n" for i, c in enumerate(current, 1)))
        self.version += 1

    def mount(self, line: str) -> None:
        """Add a line to the host's mountinfo (proc/1/mountinfo)."""
        mi = self.root / MOUNTINFO
        mi.parent.mkdir(parents=True, exist_ok=True)
        with open(mi, "a") as fh:
            fh.write(line + "\n")
        self.version += 1

    def write_blacklist(self) -> None:
        self.write(BLACKLIST, "".join(f"blacklist {m}\n" for m in BLACKLISTED))

    # -- builds ---------------------------------------------------------------------

    def install(
        self,
        gen: Generation,
        specs: Iterable[ModSpec],
        where: str,
        *,
        against: dict[str, int] | None = None,
    ) -> None:
        """Put ``gen``'s build of ``specs`` in a module tree and re-run depmod there."""
        specs = list(specs)
        moddir = self.moddir(where)
        install_generation(moddir, self.kver, gen, specs, against=against)
        depmod(moddir)
        for spec in specs:
            self.generation_of[build_id_of(spec.name, gen, self.kver).hex()] = gen.version
        self.version += 1

    def write_headers(self, gen: Generation, specs: Iterable[ModSpec]) -> None:
        write_symvers(self.mofed_symvers, gen, list(specs))
        self.headers_version = gen.version
        self.version += 1

    def headers(self) -> dict[str, int] | None:
        return read_symvers(self.mofed_symvers)

    def generation(self, module: str) -> str | None:
        m = self.kernel.module(module)
        if m is None or m.info.build_id is None:
            return None
        return self.generation_of.get(m.info.build_id, "?")
