"""Module trees for the simulated kernel, built of real ``.ko`` files: two MOFED
generations whose peer-memory ABI differs, and the GPU driver's tree built against one
(``test_kernel.py``, ``test_hold.py``)."""

from __future__ import annotations

from pathlib import Path

from nodeagent.sim.kernel import SimKernel
from nodeagent.sim.modtree import (
    GPU_MODULES,
    PEER_MEMORY_API,
    Generation,
    crc_of,
    depmod,
    install_generation,
)

KVER = "6.1.0-sim"


OLD = Generation("old", "MOFED old", "24.10", abi_overrides=dict.fromkeys(PEER_MEMORY_API, "pm1"))


NEW = Generation(
    "new", "MOFED new", "25.07", abi_overrides=dict.fromkeys(PEER_MEMORY_API, "pm2"), layout="extra"
)


NV = Generation("nv", "NVIDIA", "580")


def moddir(root: Path, where: str = "") -> Path:
    return root / where / "lib/modules" / KVER


def gpu_tree(k: SimKernel, built_against: Generation) -> Path:
    """nvidia + nvidia_peermem built against ``built_against``'s ib_core headers."""
    headers = {s: crc_of(s, built_against.tag(s)) for s in PEER_MEMORY_API}
    d = moddir(k.root, "run/nvidia/driver")
    install_generation(d, KVER, NV, GPU_MODULES, against=headers)
    depmod(d)
    return d
