"""Property: the decision -> publish path never lets ``wait`` read open on a closed node.

Whatever the interleaving of node changes (between passes, or landing right
after a pass's observation, as an inotify event would), slow steps held in the
guards' workers and their release, after every pass the gate file read the
way ``nodeagent wait`` reads it is open only if a fresh observation of the
node decides open — also when MOFED's marker files changed after the
observation and their inotify event has not reached the loop yet. And a
MOFED restart's unload of an idle ``nvidia_peermem`` is started by the pass
that sees it, even while a load is stuck in a worker.

The agent is the real one (enforce mode, real worker threads) over the
simulated kernel; passes are driven one at a time, the loop's drain of its
wake-ups done by hand before each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.mofed import restart_signals
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import GateFiles
from nodeagent.sim.node import Node
from tests.healthy import healthy_node
from tests.loop.node_changes import NODE_CHANGES, change
from tests.waiting import WAIT, until

PEERMEM = "nvidia_peermem"


class SlowKernel:
    """The simulated kernel; while ``slow``, a load waits until ``release``."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.slow = False
        self.gate = threading.Event()
        self.removed: list[str] = []

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        if self.slow:
            assert self.gate.wait(WAIT), "a held load was never released"
        with self.node.sched.world:
            self.node.kernel.insert_fd(fd, name, params)

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise AssertionError("the agent loads by descriptor")

    def remove(self, name: str) -> None:
        with self.node.sched.world:
            self.removed.append(name)
            self.node.kernel.remove(name)

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        raise AssertionError("not used")

    def release(self) -> None:
        self.gate.set()
        self.gate = threading.Event()


STEP = st.one_of(
    st.tuples(st.just("change"), st.sampled_from(NODE_CHANGES)),
    st.tuples(st.just("change-mid-pass"), st.sampled_from(NODE_CHANGES)),
    # MOFED's markers change after the observation, their inotify event not yet delivered.
    st.tuples(st.just("marker-mid-pass"), st.sampled_from(("restart-begins", "restart-ends"))),
    st.tuples(st.just("slow"), st.booleans()),
    st.tuples(st.just("release"), st.just("")),
)


def idle_peermem(node: Node) -> bool:
    with node.sched.world:
        m = node.kernel.modules.get(PEERMEM)
        return m is not None and m.state == "live" and not m.holders


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(STEP, max_size=12))
def test_the_published_gate_never_reads_open_while_the_node_decides_closed(
    tmp_path_factory: object, steps: list[tuple[str, Any]]
) -> None:
    root = Path(tmp_path_factory.mktemp("node"))  # type: ignore[attr-defined]
    node = healthy_node(root)
    kernel = SlowKernel(node)
    cfg = Config(host_root=str(root), mode="enforce", uevents=False)
    agent = Agent(cfg, module_ops=kernel, kernel_log=node.kernel.kernel_messages)
    gates = GateFiles(HostRoot(root), cfg.paths.state_dir)
    real_observe = agent.observer.observe
    mid_pass: list[tuple[str, bool]] = []  # (change, its event already delivered)

    def observe_then_change(now: float) -> Any:
        snap = real_observe(now)
        for what, delivered in mid_pass:  # the node changes just after the pass looked at it
            change(node, what)
            if delivered:
                agent.poke.poke(f"inotify {what}")
        mid_pass.clear()
        return snap

    agent.observer.observe = observe_then_change  # type: ignore[method-assign]
    try:
        for kind, arg in [("change", "nothing"), *steps, ("release", "")]:
            if kind == "change":
                change(node, arg)
            elif kind in ("change-mid-pass", "marker-mid-pass"):
                mid_pass.append((arg, kind == "change-mid-pass"))
            elif kind == "slow":
                kernel.slow = arg
                continue
            else:
                kernel.release()
            unload_due = idle_peermem(node)
            agent.poke.drain()  # what the loop's Waker does before a pass
            result = agent.run_pass(["property"])
            # What `wait` reads, against a fresh look at the node with the agent's memory.
            reading = gates.read("peermem")
            fresh = agent.reconciler.decide(real_observe(time.time()), agent.memory)
            assert not (reading.is_open and not fresh.verdicts["peermem"].ok), (kind, arg)
            # Protective first: the restart's unload starts in this pass, whatever is stuck.
            if unload_due and restart_signals(result.snapshot, cfg.paths.mofed, "container"):
                until(lambda: PEERMEM in kernel.removed, "the restart unload was not started")
                kernel.removed.clear()
    finally:
        kernel.slow = False
        kernel.release()
        agent.workers.close(WAIT)
        agent.close()
        node.kernel.uevent_source.close()


def test_a_decision_gone_stale_while_its_gate_file_is_written_is_not_renamed_in(
    tmp_path: Path,
) -> None:
    gates = GateFiles(HostRoot(tmp_path), "run/nodeagent")
    assert gates.publish({"peermem": True}, time.time()) == (["peermem"], [])
    assert gates.read("peermem").is_open
    asked: list[bool] = []

    def went_stale() -> bool:  # asked after the fsync, right before the rename
        asked.append(True)
        return False

    assert gates.publish({"peermem": True}, time.time(), went_stale) == ([], [])
    assert asked == [True]
    assert not gates.read("peermem").is_open  # the earlier open file went too
    assert not [p for p in (tmp_path / "run/nodeagent").iterdir() if ".tmp." in p.name]
