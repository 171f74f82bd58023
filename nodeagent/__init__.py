"""nodeagent: makes kernel-module ordering on GPU/RDMA nodes safe.

Layout: ``nodeagent.core`` is the pure decision code (no I/O, no clock);
``nodeagent.host`` is the one boundary to the node (files under the host root,
module operations, netlink, events); ``nodeagent.guards`` is where a guard
plugs in (the one list, each guard's host side); ``nodeagent.loop`` runs them:
the level-triggered reconcile loop, built in ``loop/wiring.py``.
"""

__version__ = "0.1.0"
