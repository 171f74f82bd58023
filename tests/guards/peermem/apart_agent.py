"""The agent with its hold on, as a process of its own, for tests that stop or kill it.

``python -m tests.guards.peermem.apart_agent ROOT`` builds the daemon's agent as ``nodeagent
run`` does (``loop.wiring.build_agent``, enforce mode, ``hold_loads =
"fanotify"``, ``hold_roots = ["run/nvidia/driver"]``) on a simulated healthy node
under ROOT, without MOFED's ready flag, so the gate stays closed. Its module
operations are the simulated kernel's, so nothing it decides reaches this
host's kernel. It runs until SIGTERM (draining first, as the daemon does, while a
load is held with the gate closed), and prints nothing: tests read its
``status.json`` as an admin would.

The caller mounts a tmpfs at ``ROOT/run/nvidia/driver`` first (the marked
filesystem: the driver tree lands on it).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.host.events import StopOnSignal
from nodeagent.host.ports import HostPorts
from nodeagent.loop.agent import Agent
from nodeagent.loop.wiring import LoopHooks, build_agent
from nodeagent.sim.node import Node
from tests.healthy import healthy_node


def hold_config(root: Path) -> Config:
    """Enforce mode, the hold on, its one root the driver's tmpfs; no journal, no uevents."""
    return Config(
        host_root=str(root),
        mode="enforce",
        uevents=False,
        journal=False,
        policies={
            "peermem": PeermemPolicy(
                hold_loads="fanotify", hold_roots=("run/nvidia/driver",), hold_containers=()
            )
        },
    )


def build(root: Path, hooks: LoopHooks | None = None) -> tuple[Agent, Node]:
    """The agent on a healthy node without MOFED's ready flag, the node's kernel its hands;
    close ``node.kernel.uevent_source`` when done."""
    node = healthy_node(root, ready=False)
    ports = HostPorts(module_ops=node.kernel, kernel_log=lambda m: [])  # type: ignore[arg-type]
    return build_agent(hold_config(root), ports, hooks or LoopHooks()), node


def main(argv: list[str]) -> int:
    """As ``nodeagent run`` stops: SIGTERM through ``StopOnSignal`` (a drain first while a
    load is held with the gate closed; a second signal stops at once)."""
    root = Path(argv[1])
    # Each agent process builds its simulated node anew (one the supervisor restarted
    # finds the last one's).
    shutil.rmtree(root / "sys", ignore_errors=True)
    agent, node = build(root)
    try:
        with StopOnSignal(agent.stop_on_signal) as signals:
            signals.stop_now = agent.stop
            agent.run()
    finally:
        node.kernel.uevent_source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
