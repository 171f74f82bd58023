"""A healthy simulated node on a temp host root: the RDMA stack and nvidia live, MOFED ready.

The peermem gate is open on it; tests break one thing at a time.
"""

from __future__ import annotations

from pathlib import Path

from nodeagent.sim.modtree import GPU_MODULES, RDMA_MODULES
from nodeagent.sim.node import READY, Node
from nodeagent.sim.scenarios import MOFED_2507, NVIDIA

KVER = "6.1.0-test"
STACK = ("mlx5_core", "mlx5_ib", "ib_uverbs")  # ib_core comes with them


def healthy_node(root: Path, *, ready: bool = True) -> Node:
    """The node; close ``node.kernel.uevent_source`` when done with it."""
    node = Node(root, KVER, seed=0)
    node.kernel.init_delay = node.kernel.exit_delay = 0.0
    node.install(MOFED_2507, RDMA_MODULES, "mofed")
    node.write_headers(MOFED_2507, RDMA_MODULES)
    node.install(NVIDIA, GPU_MODULES, "gpu", against=node.headers())
    with node.sched.world:
        for m in STACK:
            node.kernel.modprobe(m, node.mofed_moddir)
        node.kernel.modprobe("nvidia", node.gpu_moddir)
    if ready:
        node.write(READY)
    return node
