"""Property: over any sequence of node changes and faults, on the simulator,

- a gate file is never present unless the last completed pass decided open
  (a pass that raised leaves none), and
- a MOFED restart's unload of an idle ``nvidia_peermem`` is never skipped,
  whatever else failed in that pass (state unwritable, status unwritable,
  the action itself failing, the timeline unwritable).

The agent is the real one (enforce mode) over the simulated kernel; each
example builds a fresh node. Bounded to a few seconds.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Sequence
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.actions import UnloadModule
from nodeagent.core.mofed import restart_signals
from nodeagent.host.kmod import ModuleOpError
from nodeagent.sim.node import GATE, Node
from tests.healthy import healthy_node
from tests.loop.node_changes import NODE_CHANGES, change

FAULTS = ("none", "state-unwritable", "status-unwritable", "timeline-unwritable",
          "action-fails", "observer-raises")  # fmt: skip


class FlakyKernel:
    """The simulated kernel, refusing every module operation while ``failing``."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.failing = False
        self.attempted: list[str] = []

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        self.attempted.append(f"load {name}")
        if self.failing:
            raise ModuleOpError("load", name, errno.EIO, "injected")
        self.node.kernel.insert_fd(fd, name, params)

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise AssertionError("the agent loads by descriptor")

    def remove(self, name: str) -> None:
        self.attempted.append(f"unload {name}")
        if self.failing:
            raise ModuleOpError("unload", name, errno.EIO, "injected")
        self.node.kernel.remove(name)

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        raise AssertionError("not used")


def block(root: Path, rel: str) -> Path:
    """Make ``rel`` unwritable for the agent: a directory where its file goes."""
    p = root / rel
    if p.is_file():
        p.unlink()
    p.mkdir(parents=True, exist_ok=True)
    return p


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.tuples(st.sampled_from(NODE_CHANGES), st.sampled_from(FAULTS)), max_size=8))
def test_gate_never_lies_and_the_restart_unload_is_never_skipped(
    tmp_path_factory: object, steps: list[tuple[str, str]]
) -> None:
    root = Path(tmp_path_factory.mktemp("node"))  # type: ignore[attr-defined]
    node = healthy_node(root)
    kernel = FlakyKernel(node)
    cfg = Config(host_root=str(root), mode="enforce", uevents=False)
    agent = Agent(cfg, module_ops=kernel, kernel_log=node.kernel.kernel_messages)
    try:
        for what, fault in [("nothing", "none"), *steps]:
            change(node, what)
            blocked = {
                "state-unwritable": "run/nodeagent/state.json",
                "status-unwritable": "run/nodeagent/status.json",
                "timeline-unwritable": "var/lib/nodeagent/timeline.jsonl",
            }.get(fault)
            if blocked:
                block(root, blocked)
            kernel.failing = fault == "action-fails"
            kernel.attempted.clear()
            with node.sched.world:
                peermem = node.kernel.modules.get("nvidia_peermem")
                idle = peermem is not None and peermem.state == "live" and not peermem.holders
            if fault == "observer-raises":
                real = agent.observer.observe
                agent.observer.observe = _raise  # type: ignore[method-assign]
                try:
                    agent.run_pass(["property"])
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("the injected observer error did not surface")
                finally:
                    agent.observer.observe = real  # type: ignore[method-assign]
                assert not (root / GATE).exists(), "a failed pass left a gate file"
            else:  # the pass, its plans carried out and absorbed
                result = agent.run_once(["property"])
                decided_open = result.verdicts["peermem"].ok
                assert not ((root / GATE).exists() and not decided_open), (what, fault)
                if restart_signals(result.snapshot, cfg.paths.mofed, "container") and idle:
                    assert "unload nvidia_peermem" in kernel.attempted, (what, fault)
                    assert any(isinstance(o.action, UnloadModule) for o in result.outcomes)
                if fault in ("state-unwritable", "status-unwritable"):
                    assert not (root / GATE).exists(), "bookkeeping failed: no open gate"
            if blocked:
                shutil.rmtree(root / blocked)
    finally:
        agent.close()
        node.kernel.uevent_source.close()


def _raise(now: float) -> object:
    raise RuntimeError("injected observer failure")
