"""A healthy simulated node on a temp host root: the RDMA stack and nvidia live, MOFED ready.

The peermem gate is open on it; tests break one thing at a time.
"""

from __future__ import annotations

from pathlib import Path

from nodeagent.sim.node import READY, Node
from nodeagent.sim.scenarios import stack_node

KVER = "6.1.0-test"
STACK = ("mlx5_core", "mlx5_ib", "ib_uverbs")  # ib_core comes with them


def healthy_node(root: Path, *, ready: bool = True) -> Node:
    """The node; close ``node.kernel.uevent_source`` when done with it."""
    node = stack_node(root, KVER)
    if ready:
        node.write(READY)
    return node
