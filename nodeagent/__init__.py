"""nodeagent: makes kernel-module ordering on GPU/RDMA nodes safe.

Layout: ``nodeagent.core`` is the pure decision code (no I/O, no clock);
``nodeagent.host`` is the one boundary to the node (files under the host root,
module operations, netlink, events); ``nodeagent.agent`` wires them into the
level-triggered reconcile loop.
"""

__version__ = "0.1.0"
