"""Actors on the virtual clock: Kubernetes back-off, MOFED's openibd restart, the storage check,
the GPU driver container's root (mounted at run/nvidia/driver only after its loads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeagent.sim.actors import (
    STORAGE_MESSAGE,
    Container,
    ContainerExit,
    GpuSpec,
    MofedSpec,
    container_root,
    gpu_driver_container,
    mofed_container,
    peermem_sidecar,
)
from nodeagent.sim.kernel import HOST_SB
from nodeagent.sim.modtree import GPU_MODULES, RDMA_MODULES, STORAGE_MODULES, Generation
from nodeagent.sim.node import BLACKLIST, CTR_READY, GPU_DRIVER_ROOT, READY, Node

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


# -- the GPU driver container's root, in nvidia-driver init's order (issue 65) ------------
#
# The real script (../shared/operators/gpu-driver-container/rhel9/nvidia-driver 881-896,
# ubuntu22.04/nvidia-driver 790-847) loads nvidia-peermem from its own root and bind-mounts
# that root at /run/nvidia/driver only after (_load_driver, then _mount_rootfs); _shutdown
# unmounts it, and the next start's _unmount_rootfs takes a bind that outlived its container.

FAST_GPU = GpuSpec(NV, manager_s=1, build_s=5, install_s=5, modprobe_gap_s=1)


def ready_node(tmp_path: Path) -> Node:
    """``booted``, with MOFED ``OLD``'s headers in place (peermem is built against them)."""
    node = booted(tmp_path)
    node.write_headers(OLD, RDMA_MODULES)
    return node


def host_tree(node: Node) -> list[str]:
    """The module files the host sees under run/nvidia/driver."""
    d = node.root / GPU_DRIVER_ROOT
    return sorted(p.name for p in d.rglob("*.ko*")) if d.is_dir() else []


def test_peermem_is_loaded_from_the_containers_own_root_before_it_is_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = ready_node(tmp_path)
    k = node.kernel
    seen: dict[str, Any] = {}
    real_modprobe = k.modprobe

    def modprobe(name: str, moddir: Any, *args: Any, **kw: Any) -> list[str]:
        if name == "nvidia_peermem":  # the driver container's _load_driver, at this moment
            seen["from"] = k.node_path(moddir)
            seen["host_tree"] = host_tree(node)
            seen["mounted"] = k.is_mounted(GPU_DRIVER_ROOT)
        return real_modprobe(name, moddir, *args, **kw)

    monkeypatch.setattr(k, "modprobe", modprobe)
    gpu = gpu_driver_container(node, FAST_GPU).start()
    node.sched.run(120.0)
    own = container_root("nvidia-driver-ctr")
    # After _load_driver, _mount_rootfs: the same tree, on the container's superblock.
    assert "nvidia-peermem.ko" in host_tree(node)
    assert k.superblock_of(GPU_DRIVER_ROOT) == k.superblock_of(own) != HOST_SB
    assert node.exists(CTR_READY) and gpu.restarts == 0
    node.sched.close()
    assert seen["from"] == f"/{own}/lib/modules/{KVER}"
    assert seen["host_tree"] == [] and seen["mounted"] is False
    assert k.is_live("nvidia_peermem")
    said = [e.text for e in node.events if e.column == "GPU driver"]
    load = said.index("Loading NVIDIA Peer Memory kernel module: modprobe -a nvidia-peermem")
    assert said.index("Mounting NVIDIA driver rootfs at /run/nvidia/driver") > load


def test_sigterm_runs_shutdown_which_unloads_and_unmounts(tmp_path: Path) -> None:
    node = ready_node(tmp_path)
    k = node.kernel
    gpu = gpu_driver_container(node, FAST_GPU).start()
    node.sched.run(120.0)
    assert "nvidia-peermem.ko" in host_tree(node)
    gpu.terminate()
    node.sched.run(130.0)
    node.sched.close()
    assert gpu.state == "terminated"
    for m in ("nvidia_peermem", "nvidia_modeset", "nvidia_uvm", "nvidia"):
        assert k.module(m) is None, m
    assert host_tree(node) == [] and (node.root / GPU_DRIVER_ROOT).is_dir()
    assert not k.is_mounted(GPU_DRIVER_ROOT) and k.superblock_of(GPU_DRIVER_ROOT) == HOST_SB
    assert not node.exists(CTR_READY)


def test_a_bind_that_outlives_its_container_keeps_its_filesystem_until_the_next_start(
    tmp_path: Path,
) -> None:
    """SIGKILL runs no trap: the old root stays bound (and marked) at run/nvidia/driver
    until the next start's _unmount_rootfs; that start's own load is on a new overlay."""
    node = ready_node(tmp_path)
    k = node.kernel
    gpu = gpu_driver_container(node, FAST_GPU).start()
    node.sched.run(120.0)
    old = k.superblock_of(GPU_DRIVER_ROOT)
    group = k.fanotify_group()
    group.mark_filesystem(str(node.root / GPU_DRIVER_ROOT))
    assert group.marked_devices() == {old}
    gpu._kill("Liveness probe failed: test")
    node.sched.run(121.0)  # killed; kubelet's restart is 3 s away
    assert gpu.exits and gpu.exits[-1][1] == 137
    assert "nvidia-peermem.ko" in host_tree(node) and group.marked_devices() == {old}
    assert k.superblock_of(GPU_DRIVER_ROOT) == old  # the runtime's overlay went; the bind not
    node.sched.run(240.0)
    node.sched.close()
    said = [e.text for e in node.events if e.column == "GPU driver"]
    restart = said.index("nvidia-driver-ctr restart #1")
    assert said.index("Unmounting NVIDIA driver rootfs (/run/nvidia/driver)") > restart
    assert old not in group.marked_devices()  # gone with the old superblock
    new = k.superblock_of(GPU_DRIVER_ROOT)
    assert new not in (old, HOST_SB) and k.is_live("nvidia_peermem")
    group.close()


def test_the_sidecar_loads_through_run_nvidia_driver_so_only_once_it_is_mounted(
    tmp_path: Path,
) -> None:
    """nvidia-peermem-ctr's ``chroot /run/nvidia/driver modprobe nvidia-peermem``: with the
    flags set but nothing mounted there it fails; once a root is bound there it loads."""
    node = ready_node(tmp_path)
    k = node.kernel
    own = container_root("nvidia-driver-ctr")
    node.install(NV, GPU_MODULES, own, against=node.headers())
    k.modprobe("nvidia", node.moddir(own))
    node.write(CTR_READY)
    driver = Container(node, "nvidia-driver-ctr", "GPU driver", lambda c: None)
    sidecar = peermem_sidecar(node, driver)
    assert sidecar is not None
    sidecar.start()
    node.sched.run(5.0)
    assert sidecar.exits and sidecar.exits[0][1] == 1 and k.module("nvidia_peermem") is None
    k.mount_overlay(own)
    k.bind_mount(own, GPU_DRIVER_ROOT)  # the driver container's _mount_rootfs
    node.sched.run(60.0)
    node.sched.close()
    assert k.is_live("nvidia_peermem")
    assert k.module("nvidia_peermem").path.startswith(f"/{GPU_DRIVER_ROOT}/")  # type: ignore[union-attr]
    said = [e.text for e in node.events if e.column == "GPU driver"]
    assert "nvidia-peermem-ctr: successfully loaded nvidia-peermem module" in said
