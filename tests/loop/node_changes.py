"""What can happen to a node between or during passes, for the loop's property tests
(``test_gate_property.py``, ``test_publish_property.py``): MOFED's restart begins or ends,
the RDMA stack leaves or comes back."""

from __future__ import annotations

from nodeagent.sim.node import BLACKLIST, READY, Node
from tests.healthy import STACK

NODE_CHANGES = ("restart-begins", "restart-ends", "stack-leaves", "stack-returns", "nothing")


def change(node: Node, what: str) -> None:
    with node.sched.world:
        if what == "restart-begins":
            node.write_blacklist()
            if node.exists(READY):
                node.remove(READY)
        elif what == "restart-ends":
            if node.exists(BLACKLIST):
                node.remove(BLACKLIST)
            node.write(READY)
        elif what == "stack-leaves":
            for m in ("mlx5_ib", "mlx5_core"):
                if node.kernel.is_live(m) and not node.kernel.modules[m].holders:
                    node.kernel.remove(m)
        elif what == "stack-returns":
            for m in STACK:
                node.kernel.modprobe(m, node.mofed_moddir)
