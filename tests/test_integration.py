"""The agent end to end on a temp-dir host root: real inotify, the simulated kernel behind it.

The agent runs its own loop in a thread on the wall clock, enforce mode; the
test plays MOFED by writing the marker files and (un)loading the RDMA stack
through the simulated kernel, which edits the temp sysfs as the kernel would.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.sim.modtree import GPU_MODULES
from nodeagent.sim.node import BLACKLIST, GATE, READY, Node
from nodeagent.sim.scenarios import NVIDIA
from tests.waiting import WAIT, until

KVER = "6.1.0-test"
STACK = ("mlx5_core", "mlx5_ib", "ib_uverbs")  # ib_core comes with them


class RunningAgent:
    def __init__(self, node: Node) -> None:
        cfg = Config(host_root=str(node.root), mode="enforce", uevents=False, resync_seconds=30)
        self.agent = Agent(
            cfg,
            module_ops=node.kernel,
            kernel_log=node.kernel.kernel_messages,
            wake_sources=[node.kernel.uevent_source],
            pass_context=lambda: node.sched.world,
        )
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()
        assert self.agent.wait_for_passes(1, WAIT), "first pass"

    def next_pass(self) -> None:
        n = self.agent.passes
        self.agent.poke.poke("test")
        assert self.agent.wait_for_passes(n + 1, WAIT), "the pass after a poke"

    def settle(self) -> None:
        """Wait for the pass after whatever has just happened, for what it started in the
        workers to end, and for the pass that records it: what did not happen by then
        would not happen without a change."""
        self.next_pass()
        until(lambda: not self.agent.workers.busy(), "the workers never went idle")
        self.next_pass()  # a pass that took the outcomes in flight ends, or a new one runs

    def stop(self) -> None:
        self.agent.stop()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


def action_records(node: Node) -> list[dict[str, Any]]:
    """The agent's action records, in order, from its timeline."""
    timeline = node.root / "var/lib/nodeagent/timeline.jsonl"
    records = [json.loads(line) for line in timeline.read_text().splitlines()]
    return [r for r in records if r["kind"] == "action"]


def peermem_live(node: Node) -> bool:
    with node.sched.world:
        return node.kernel.is_live("nvidia_peermem")


def openibd_restart(node: Node) -> None:
    """MOFED's openibd restart: the RDMA stack goes and comes back (same generation here)."""
    with node.sched.world:
        for m in ("mlx5_ib", "ib_uverbs", "mlx5_core", "ib_core"):
            node.kernel.remove(m)
        for m in STACK:
            node.kernel.modprobe(m, node.mofed_moddir)


def test_flag_loads_blacklist_unloads(booting_node: Node) -> None:
    agent = RunningAgent(booting_node)
    try:
        assert not peermem_live(booting_node)
        assert not (booting_node.root / GATE).exists()
        booting_node.write(READY)  # MOFED: "Setting driver ready state"
        until(lambda: peermem_live(booting_node), "nvidia_peermem loaded after the ready flag")
        until(lambda: (booting_node.root / GATE).exists(), "gate file published")
        booting_node.write_blacklist()  # MOFED: openibd restart begins
        until(lambda: not peermem_live(booting_node), "nvidia_peermem unloaded on the blacklist")
        until(lambda: not (booting_node.root / GATE).exists(), "gate file withdrawn")
        # A worker's outcome is recorded by the pass that absorbs it, just after.
        until(lambda: len(action_records(booting_node)) >= 2, "the unload recorded")
        actions = [(r["action"], r["ok"]) for r in action_records(booting_node)]
        assert actions[0][0].startswith("load nvidia_peermem from run/nvidia/driver/")
        assert actions == [(actions[0][0], True), ("unload nvidia_peermem", True)]
    finally:
        agent.stop()


def test_agent_restarted_mid_restart_converges(booting_node: Node) -> None:
    """Stopped while MOFED restarts; the stack reloads behind its back; the flag is stale."""
    agent = RunningAgent(booting_node)
    booting_node.write(READY)
    until(lambda: peermem_live(booting_node), "first load")
    booting_node.write_blacklist()
    until(lambda: not peermem_live(booting_node), "unload on restart")
    agent.stop()

    # While the agent is down, openibd restart finishes; MOFED removes the blacklist
    # but has not re-created the ready flag yet: the old flag is stale.
    openibd_restart(booting_node)
    booting_node.remove(BLACKLIST)

    agent = RunningAgent(booting_node)
    try:
        agent.settle()
        assert not peermem_live(booting_node), "a stale flag must not open the gate after a restart"
        status = json.loads((booting_node.root / "run/nodeagent/status.json").read_text())
        assert status["guards"]["peermem"]["verdict"] == "closed"
        assert any("stale" in r for r in status["guards"]["peermem"]["reasons"])
        booting_node.write(READY)  # MOFED re-creates the flag at the end
        until(lambda: peermem_live(booting_node), "load after the fresh flag")
        until(lambda: (booting_node.root / GATE).exists(), "gate published")
    finally:
        agent.stop()


def test_agent_restarted_with_peermem_loaded_changes_nothing(booting_node: Node) -> None:
    agent = RunningAgent(booting_node)
    booting_node.write(READY)
    until(lambda: peermem_live(booting_node), "load")
    agent.stop()
    agent = RunningAgent(booting_node)
    try:
        agent.settle()
        assert peermem_live(booting_node)
        assert (booting_node.root / GATE).exists()
        assert len(action_records(booting_node)) == 1, (
            "the restarted agent must not load or unload again"
        )
    finally:
        agent.stop()


def test_abi_preflight_keeps_a_mismatched_peermem_out(booting_node: Node) -> None:
    """peermem built against other ib_core headers: the gate stays closed, nothing is tried.

    Without the preflight this is seed 001's EINVAL (the simulator's kernel refuses
    such a module with the real 'disagrees about version of symbol' lines).
    """
    booting_node.install(
        NVIDIA,
        GPU_MODULES,
        "gpu",
        against={s: c ^ 0xFFFF for s, c in (booting_node.headers() or {}).items()},
    )
    agent = RunningAgent(booting_node)
    try:
        booting_node.write(READY)
        until(
            lambda: (
                "MOFED ready flag run/mellanox/drivers/.driver-ready is absent"
                not in json.loads((booting_node.root / "run/nodeagent/status.json").read_text())[
                    "guards"
                ]["peermem"]["reasons"]
            ),
            "a pass after the flag",
        )
        agent.settle()
        status = json.loads((booting_node.root / "run/nodeagent/status.json").read_text())
        reasons = status["guards"]["peermem"]["reasons"]
        assert status["guards"]["peermem"]["verdict"] == "rebuild", reasons  # gpu-operator#2868
        assert "recreate the GPU driver pod" in reasons[0]
        assert any(
            r.startswith("nvidia_peermem needs ib_register_peer_memory_client CRC 0x")
            and "but the loaded ib_core exports 0x" in r
            for r in reasons
        ), reasons
        assert action_records(booting_node) == []
        assert not peermem_live(booting_node)
    finally:
        agent.stop()


class _CrashingKernel:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.hung = threading.Event()

    def insert_file(self, path: str, params: object) -> None:
        self.node.kernel.insert_file(path, params)  # type: ignore[arg-type]

    def insert_fd(self, fd: int, name: str, params: object) -> None:
        self.node.kernel.insert_fd(fd, name, params)  # type: ignore[arg-type]

    def remove(self, name: str) -> None:
        # The unload never returns: the agent dies here (nothing after it runs).
        self.hung.wait(WAIT)

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        raise AssertionError("not used")


def one_pass_agent(node: Node, ops: object, mode: str = "enforce") -> Agent:
    cfg = Config(host_root=str(node.root), mode=mode, uevents=False)
    return Agent(cfg, module_ops=ops, kernel_log=node.kernel.kernel_messages)  # type: ignore[arg-type]


def test_crash_mid_action_keeps_what_the_pass_learned(booting_node: Node) -> None:
    """The restart is persisted by the pass that starts the unload: an agent that dies in the
    unload cannot take the old flag for a fresh one."""
    booting_node.write(READY)
    one_pass_agent(booting_node, booting_node.kernel).run_once()
    assert peermem_live(booting_node)
    with booting_node.sched.world:  # openibd restart begins: mlx5_core leaves (flag still there)
        booting_node.kernel.remove("mlx5_ib")
        booting_node.kernel.remove("mlx5_core")
    dying = _CrashingKernel(booting_node)
    # The pass starts the unload (urgent: before its memory write) and the agent dies in it;
    # the pass itself does not wait on the unload, so what it learned is on disk.
    one_pass_agent(booting_node, dying).run_pass()
    dying.hung.set()
    with booting_node.sched.world:  # the stack comes back while the agent is down; same old flag
        for m in ("mlx5_core", "mlx5_ib"):
            booting_node.kernel.modprobe(m, booting_node.mofed_moddir)
    result = one_pass_agent(booting_node, booting_node.kernel).run_pass()
    verdict = result.verdicts["peermem"]
    assert verdict.verdict == "closed"
    assert any("stale" in r for r in verdict.reasons), verdict.reasons


def test_observe_mode_records_an_undone_action_once(booting_node: Node) -> None:
    booting_node.write(READY)
    agent = one_pass_agent(booting_node, booting_node.kernel, mode="observe")
    for _ in range(5):
        agent.run_pass()
    assert not peermem_live(booting_node), "observe mode must not load"
    assert [
        (a["action"].split(" from ")[0], a["performed"]) for a in action_records(booting_node)
    ] == [("load nvidia_peermem", False)]
