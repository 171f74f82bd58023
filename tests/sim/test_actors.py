"""Actors on the virtual clock: Kubernetes back-off, MOFED's openibd restart, the storage check."""

from __future__ import annotations

from pathlib import Path

from nodeagent.sim.actors import (
    STORAGE_MESSAGE,
    Container,
    ContainerExit,
    MofedSpec,
    mofed_container,
)
from nodeagent.sim.modtree import GPU_MODULES, RDMA_MODULES, STORAGE_MODULES, Generation
from nodeagent.sim.node import BLACKLIST, READY, Node

KVER = "6.1.0-sim"
OLD = Generation("old", "MOFED old", "24.10", layout="extra")
NEW = Generation("new", "MOFED new", "25.07", layout="extra")
NV = Generation("nv", "NVIDIA", "580")
FAST = {"dtk_start_s": 1, "compile_start_s": 1, "compile_s": 5, "install_wait_s": 1}


def booted(tmp_path: Path) -> Node:
    """MOFED ``OLD`` installed and loaded, its ready flag set; clock at 0."""
    node = Node(tmp_path, KVER, seed=1)
    node.install(OLD, RDMA_MODULES, "mofed")

    def boot() -> None:
        for m in ("mlx5_ib", "ib_umad"):
            node.kernel.modprobe(m, node.mofed_moddir)
        node.write(READY)

    node.sched.spawn("boot", boot)
    node.sched.run(-1e-9)
    return node


def test_kubernetes_back_off(tmp_path: Path) -> None:
    node = Node(tmp_path, KVER, seed=1)
    node.sched.run(0.0)

    def crash(c: Container) -> None:
        raise ContainerExit(1)

    c = Container(node, "crasher", "MOFED", crash, startup_s=0.0).start()
    node.sched.run(1000.0)
    node.sched.close()
    gaps = [round(b[0] - a[0]) for a, b in zip(c.exits, c.exits[1:], strict=False)]
    assert gaps == [0, 10, 20, 40, 80, 160, 300, 300]  # at once, then doubling, capped
    assert c.restarts == len(c.exits) - 1 and c.state == "CrashLoopBackOff"


def test_openibd_restart_replaces_the_stack(tmp_path: Path) -> None:
    node = booted(tmp_path)
    mofed = mofed_container(node, MofedSpec(NEW, "25.07-test", **FAST)).start(-node.now())
    node.sched.run(300.0)
    node.sched.close()
    assert node.exists(READY) and not node.exists(BLACKLIST)
    for m in ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs"):
        assert node.generation(m) == "25.07", m
    said = [e.text for e in node.events]
    assert said[0] == "Unsetting driver ready state"
    blacklist_writes = [t for t, op, rel in node.file_log if rel == BLACKLIST]
    assert len(blacklist_writes) == 2  # written for the restart, removed after it
    assert mofed.restarts == 0


def test_openibd_restart_fails_while_peermem_holds_ib_core(tmp_path: Path) -> None:
    node = booted(tmp_path)
    node.write_headers(OLD, RDMA_MODULES)
    node.install(NV, GPU_MODULES, "gpu", against=node.headers())

    def gpu_job() -> None:
        node.kernel.modprobe("nvidia_peermem", node.gpu_moddir)
        node.kernel.get_module("nvidia_peermem")  # a running job uses it: pre-start cannot unload

    node.sched.spawn("gpu", gpu_job, delay=1.0 - node.now())
    mofed = mofed_container(node, MofedSpec(NEW, "25.07-test", **FAST)).start(2.0 - node.now())
    node.sched.run(30.0)
    node.sched.close()
    said = [e.text for e in node.events]
    assert any(t.startswith("pre-start: could not unload nvidia_peermem") for t in said)
    fail = next(t for t in said if "Unloading HCA driver: [FAILED]" in t)
    assert "ib_core" in fail and "nvidia_peermem" in fail
    assert mofed.exits and mofed.exits[0][1] == 1
    assert not node.exists(BLACKLIST)  # the EXIT trap removed it
    assert node.kernel.is_live("nvidia_peermem")


def test_mofed_refuses_over_storage_modules(tmp_path: Path) -> None:
    node = booted(tmp_path)
    node.install(OLD, STORAGE_MODULES, "mofed")

    def mount() -> None:
        node.kernel.modprobe("rpcrdma", node.mofed_moddir)

    node.sched.spawn("mount", mount, delay=-node.now())
    mofed = mofed_container(node, MofedSpec(NEW, "25.07-test", **FAST)).start(5.0 - node.now())
    node.sched.run(60.0)
    node.sched.close()
    said = [e.text for e in node.events]
    assert said.count(STORAGE_MESSAGE) == len(mofed.exits) >= 3
    assert node.generation("ib_core") == "24.10" and not node.exists(READY)
