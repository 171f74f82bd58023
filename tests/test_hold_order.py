"""Closing comes first: when the peermem gate closes, the hold's responder lease closes
before the gate file a reader asks is withdrawn (issue 51), in the protective step and in
a pass that takes its gates back."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.host.hold import HoldHost
from nodeagent.sim.node import GATE, READY

from .healthy import healthy_node
from .test_fanotify_hold import OverflowingGroup
from .waiting import WAIT, until


def test_the_responder_lease_closes_before_the_gate_file_goes(tmp_path: Path) -> None:
    (tmp_path / "run/nvidia/driver").mkdir(parents=True)
    node = healthy_node(tmp_path)  # MOFED ready: the gate opens, the lease with it
    pol = PeermemPolicy(
        hold_loads="fanotify", hold_roots=("run/nvidia/driver",), hold_containers=()
    )
    cfg = Config(host_root=str(tmp_path), mode="enforce", uevents=False, policies={"peermem": pol})
    host = HoldHost(group=lambda: OverflowingGroup([]), host_pids=lambda: True)
    agent = Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [], hold_host=host)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side: Any = agent.side("peermem")
        until(lambda: side.hold is not None and side.gate_open, "the hold never opened")
        assert (tmp_path / GATE).exists()
        told: list[tuple[bool, bool]] = []  # (what the responder was told, gate file there)
        follow = side.hold.follow

        def recording(is_open: bool) -> None:
            told.append((is_open, (tmp_path / GATE).exists()))
            follow(is_open)

        side.hold.follow = recording
        (tmp_path / READY).unlink()  # MOFED restarts: the pass closes the gate
        closing = until(lambda: [t for t in list(told) if not t[0]], "the lease never closed")
        assert closing[0] == (False, True), "the gate file went before the responder's lease"
        until(lambda: not (tmp_path / GATE).exists(), "the gate file stayed")
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()
