"""The VF guard's host side: SR-IOV read over netlink, VFs restored, the snapshot kept.

The guard (``core/sriov.py``) decides from what this reads; its restores run
through this side's executor (``act.py``); after every pass the VF
snapshot file follows the guard's memory, so a restarted agent knows each VF's
configuration before MOFED's reload took it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nodeagent.core.reconcile import AgentMemory
from nodeagent.core.sriov import SriovMemory
from nodeagent.errors import NodeagentError
from nodeagent.guards.side import GuardSide, SideContext
from nodeagent.guards.sriov.act import SriovExecutor
from nodeagent.guards.sriov.netlink import PyrouteOps, SriovOps
from nodeagent.guards.sriov.observe import SriovObserver, SriovStore

if TYPE_CHECKING:
    from nodeagent.host.act import Executor, NodeHands

log = logging.getLogger("nodeagent")


class SriovSide(GuardSide):
    def __init__(self, ctx: SideContext) -> None:
        super().__init__(ctx)
        host, paths = ctx.host, ctx.paths
        # Read-only (``check``): a bad snapshot file is reported, moved aside only by the daemon.
        self.store = SriovStore(host, paths.sriov_snapshot, read_only=ctx.read_only)
        self.ops: SriovOps = ctx.port or PyrouteOps(host)
        self.observer = SriovObserver(host, self.ops, self.store, paths.sriov_cni_cache)

    def readers(self) -> Mapping[str, Callable[[], Any]]:
        return {"sriov": self.observer.read}

    def writes(self) -> Mapping[str, Collection[str] | None]:
        parent, _, name = self.ctx.paths.sriov_snapshot.rpartition("/")
        return {parent: (name,)}

    def executors(self) -> Sequence[Callable[[NodeHands], Executor]]:
        return (lambda hands: SriovExecutor(hands.host, self.ops),)

    def after_memory(self, memory: AgentMemory) -> None:
        """The VF snapshot file follows the guard's memory (a record: it holds no gate)."""
        for report in self.store.reports:
            log.warning(report)
            self.ctx.record({"kind": "state-problem", "problem": report})
        self.store.reports.clear()
        sriov = memory.get(self.ctx.name)
        if not isinstance(sriov, SriovMemory):
            return
        try:
            self.store.save({pci: m.saved for pci, m in sriov.pfs.items()})
        except (OSError, NodeagentError) as exc:
            self.ctx.failed("SR-IOV snapshot write failed", exc, True)

    def close(self) -> None:
        close_ops = getattr(self.ops, "close", None)
        if close_ops is not None:
            close_ops()  # netlink sockets; one still in a hung call closes when it returns
