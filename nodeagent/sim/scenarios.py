"""The seed incidents as scenarios, and one run of a scenario with or without the agent.

Each scenario builds a node as it was when the seed's incident began (the
"boot", before t=0, is not shown), casts the actors with the seed's timings
(seed-seconds), and says what a healthy node is. ``run_scenario`` replays it
on the virtual clock, with the real agent in a thread when asked, and returns
the timeline and a verdict.

- ``kernel-upgrade-race`` (seeds 000-002): the driver container loads
  nvidia_peermem mid-``openibd restart``: EINVAL, crash, restart;
- ``storage-module-race`` (004): an NFS-over-RDMA mount loads rpcrdma first;
  MOFED refuses to install, the GPU driver pod waits for it in its init container;
- ``vf-restore`` (003, phase 1): MOFED's VF restore meets a netdev being
  renamed and exits; the VFs' config is lost;
- ``mofed-upgrade`` (003, phase 2): the serial restore overtakes the VF probes
  at VF16 and exits.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nodeagent.core import applicability
from nodeagent.sim.actors import (
    Container,
    GpuSpec,
    MofedSpec,
    gpu_driver_container,
    host_modprobe,
    mofed_container,
    nfs_mount,
    peermem_sidecar,
)
from nodeagent.sim.clock import SimError
from nodeagent.sim.kernel import PF_FIELDS, VfConfig
from nodeagent.sim.modes import DEFAULT_MODE, MODES, DeploymentMode
from nodeagent.sim.modtree import (
    GPU_MODULES,
    PEER_MEMORY_API,
    RDMA_MODULES,
    STORAGE_MODULES,
    Generation,
    exports_of,
)
from nodeagent.sim.node import CTR_READY, READY, Node, SimEvent

__all__ = [
    "SCENARIOS",
    "RunResult",
    "Scenario",
    "Verdict",
    "run_scenario",
    "stack_node",
]

_PM2 = dict.fromkeys(PEER_MEMORY_API, "peer-memory-v2")
DKMS_2410 = Generation(
    "mofed-24.10-dkms",
    "MOFED 24.10 (host DKMS build)",
    "24.10",
    abi_overrides=dict.fromkeys(PEER_MEMORY_API, "peer-memory-v1"),
    layout="dkms",
)
MOFED_2501 = Generation("mofed-25.01", "MOFED 25.01-0.6.0.0", "25.01", _PM2, layout="extra")
MOFED_2507 = Generation("mofed-25.07", "MOFED 25.07-0.9.7.0", "25.07", _PM2, layout="extra")
MOFED_2510 = Generation("mofed-25.10", "MOFED 25.10-1.2.8.0", "25.10", _PM2, layout="extra")
INBOX = Generation(
    "inbox-5.15.0-170",
    "in-tree (Ubuntu 5.15.0-170)",
    "inbox",
    srcversion=False,  # Debian/Ubuntu set no srcversion on in-tree modules
    omit_exports=PEER_MEMORY_API,
    compress="zst",
)
NFS_BUNDLE = Generation(
    "nfs-bundle-dkms", "MOFED NFS bundle (DKMS, 4.0.35-vastdata)", "4.0.35", layout="dkms"
)
NVIDIA = Generation("nvidia-580", "NVIDIA 580.95.05", "580.95")
STACK = ("mlx5_core", "mlx5_ib", "ib_core", "ib_uverbs")
PF = "enp1s0f0"
PF_PCI = "0000:01:00.0"


@dataclass
class Cast:
    """Who acts in a run, and what the scenario calls healthy."""

    mofed: list[Container] = field(default_factory=list)
    gpu: Container | None = None
    sidecar: Container | None = None
    target: Generation | None = None  # the MOFED that should end up loaded
    rdma: bool = True  # GPUDirect RDMA: nvidia_peermem belongs on a healthy node
    nfs: bool = False  # a healthy node has its NFS-over-RDMA share mounted
    vfs: dict[str, list[VfConfig]] = field(default_factory=dict)  # the config to get back
    # VFs that were in a pod's netns or bound to vfio-pci: only their PF-side config
    # (set through the PF) is theirs to get back; their netdev belonged to the pod.
    pf_side_only: dict[str, set[int]] = field(default_factory=dict)

    def config_back(self, pf: str, index: int, have: VfConfig) -> list[str]:
        """The fields of this VF that are not back (empty: its config is back)."""
        diff = have.differences(self.vfs[pf][index])
        if index in self.pf_side_only.get(pf, set()):
            diff = [f for f in diff if f in PF_FIELDS]
        return diff


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    seeds: tuple[str, ...]
    clock: str  # the seed's wall-clock time at t=0
    kver: str
    duration: float  # seed-seconds
    needs: tuple[str, ...]  # guards the agent needs to fix it
    story: str
    build: Callable[[Node, bool], Cast]
    # The deployment mode the seed's node ran (modes.py); the operator containers follow it.
    mode: str = DEFAULT_MODE
    # What the node has on its PCI bus (node.HARDWARE): a GPU node with a ConnectX unless
    # the scenario is about a node of another kind (issue 54's mixed clusters).
    hardware: tuple[str, ...] = ("gpu", "rdma-nic")


# -- helpers for the scenes ---------------------------------------------------------


def _vf_config(i: int) -> VfConfig:
    return VfConfig(
        mac=f"02:00:00:00:{i // 256:02x}:{i % 256:02x}",
        vlan=100 + i,
        qos=i % 4,
        trust=True,
        spoofchk=False,
        link_state="enable",
        min_tx_rate=0,
        max_tx_rate=10000,
        mtu=9000,
        admin_up=True,
    )


def _configure_vfs(node: Node, n: int) -> list[VfConfig]:
    """Boot: an operator created ``n`` VFs and configured every field."""
    k = node.kernel
    pf = k.pfs[PF]
    normal, pf.vf_delay = pf.vf_delay, lambda _i: 0.05
    k.write_sriov_numvfs(PF, n)
    node.sched.sleep(0.05 * n + 5)
    pf.vf_delay = normal
    wanted = [_vf_config(i) for i in range(n)]
    for i, cfg in enumerate(wanted):
        k.set_vf(PF, i, **{f: getattr(cfg, f) for f in PF_FIELDS})
        netdev = k.vf_netdev(PF, i)
        assert netdev is not None
        k.set_link(netdev, mtu=cfg.mtu, admin_up=cfg.admin_up)
    return wanted


POD_VFS = (46, 47)  # attached to pods by sriov-cni
VFIO_VFS = (48, 49)  # bound to vfio-pci (a VM, DPDK)


def _attach_vfs(node: Node) -> set[int]:
    """Boot: two VFs go to pods (sriov-cni moves the netdev, caches its conf), two to vfio-pci."""
    k = node.kernel
    pf = k.pfs[PF]
    cache = node.root / "var/lib/cni/sriov"
    cache.mkdir(parents=True, exist_ok=True)
    for n, i in enumerate(POD_VFS):
        container = f"{0xC0FFEE00 + n:x}" * 8
        k.move_vf_to_netns(PF, i, f"cni-{container[:8]}", "net1")
        conf = {
            "type": "sriov",
            "name": "rdma-net",
            "deviceID": pf.vfs[i].pci,
            "ContIFNames": "net1",
        }
        (cache / f"{container}-net1").write_text(json.dumps(conf))
    for i in VFIO_VFS:
        k.bind_vf(PF, i, "vfio-pci")
    return {*POD_VFS, *VFIO_VFS}


def stack_node(root: Path, kver: str) -> Node:
    """A GPU node at rest, for tests and benchmarks: MOFED 25.07's RDMA stack and nvidia
    loaded (modules initialise at once), no ready flag. Close ``node.kernel.uevent_source``."""
    node = Node(root, kver, seed=0)
    node.kernel.init_delay = node.kernel.exit_delay = 0.0
    node.install(MOFED_2507, RDMA_MODULES, "mofed")
    node.write_headers(MOFED_2507, RDMA_MODULES)
    node.install(NVIDIA, GPU_MODULES, "gpu", against=node.headers())
    with node.sched.world:
        for m in ("mlx5_core", "mlx5_ib", "ib_uverbs"):  # ib_core comes with them
            node.kernel.modprobe(m, node.mofed_moddir)
        node.kernel.modprobe("nvidia", node.gpu_moddir)
    return node


def _start_at(node: Node, t: float, *containers: Container | None) -> None:
    def start() -> None:
        for c in containers:
            if c is not None:
                c.start()

    node.sched.call_at(t, start)


# -- the scenarios --------------------------------------------------------------------


def _kernel_upgrade_race(node: Node, agent: bool) -> Cast:
    """Seeds 000-002 (11:51:06, after a kernel upgrade): both operators start together."""
    node.install(DKMS_2410, RDMA_MODULES, "host")
    host_modprobe(node, ("mlx5_core", "mlx5_ib", "ib_umad", "ib_ipoib", "rdma_ucm"), "boot")
    mofed = mofed_container(
        node,
        MofedSpec(
            MOFED_2507,
            "25.07-0.9.7.0",
            dtk_start_s=7,  # 11:51:13
            compile_start_s=10,  # 11:51:23
            compile_s=140,  # 11:53:43
            install_wait_s=145,  # 11:56:08
            install_s=30,
            unload_gap_s=2.5,
            load_gap_s=9.7,  # HCA loaded ~11:57:55
            post_load_s=44,  # ready 11:58:39
        ),
    )
    gpu = gpu_driver_container(node, GpuSpec(NVIDIA, manager_s=35, build_s=140, install_s=45))
    sidecar = peermem_sidecar(node, gpu)
    _start_at(node, 0.0, mofed, gpu)
    return Cast(mofed=[mofed], gpu=gpu, sidecar=sidecar, target=MOFED_2507)


def _storage_module_race(node: Node, agent: bool) -> Cast:
    """Seed 004 (boot at 00:00:00): an NFS mount loads rpcrdma before MOFED's pod starts."""
    node.install(INBOX, RDMA_MODULES, "host")
    inbox = {s: c for spec in RDMA_MODULES for s, c in exports_of(spec, INBOX).items()}
    node.install(NFS_BUNDLE, STORAGE_MODULES, "host", against=inbox)
    node.kernel.init_messages["rpcrdma"] = "nfs-bundle: rpcrdma loading"
    sched = node.sched
    for t, mods, why in (
        (20.0, ("mlx5_core", "mlx5_ib"), "PCI enumeration (udev)"),
        (30.0, ("sunrpc",), "NFS client (nfs-bundle)"),
    ):
        sched.spawn(why, functools.partial(host_modprobe, node, mods, why), delay=t - sched.now())
    sched.spawn("nfs-mount", nfs_mount(node), delay=1107 - sched.now())
    # The Go entrypoint's log: ~1.7 s from clearing the ready flag to the storage check.
    mofed = mofed_container(
        node, MofedSpec(MOFED_2501, "25.01-0.6.0.0", nfsrdma=True, prestart_s=1.7)
    )
    gpu = gpu_driver_container(node, GpuSpec(NVIDIA, manager_s=15, build_s=120))
    sidecar = peermem_sidecar(node, gpu)
    _start_at(node, 1200.0, mofed)
    # The driver pod runs from boot; its k8s-driver-manager waits for MOFED's ready flag
    # (the GPU Operator does not schedule on the mofed.wait label: deploy/README.md).
    _start_at(node, 0.0, gpu)
    return Cast(mofed=[mofed], gpu=gpu, sidecar=sidecar, target=MOFED_2501, nfs=True)


def _nic_only_node(node: Node, agent: bool) -> Cast:
    """A storage or front-end node: a ConnectX, no GPU. MOFED's container replaces the
    inbox stack the node booted with (an openibd restart); no GPU Operator pod runs here."""
    node.install(INBOX, RDMA_MODULES, "host")
    sched = node.sched
    boot = ("mlx5_core", "mlx5_ib")
    why = "PCI enumeration (udev)"
    sched.spawn(why, functools.partial(host_modprobe, node, boot, why), delay=20.0 - sched.now())
    mofed = mofed_container(node, MofedSpec(MOFED_2507, "25.07-0.9.7.0"))
    _start_at(node, 60.0, mofed)
    return Cast(mofed=[mofed], target=MOFED_2507, rdma=False)


def _gpu_only_node(node: Node, agent: bool) -> Cast:
    """A GPU node with no RDMA NIC (GPUDirect RDMA off, or over DMA-BUF): the driver
    container builds and loads the GPU driver; no MOFED, nobody loads nvidia_peermem."""
    gpu = gpu_driver_container(node, GpuSpec(NVIDIA, manager_s=15, build_s=120))
    _start_at(node, 0.0, gpu)
    return Cast(gpu=gpu, rdma=False)


def _vf_node(
    node: Node,
    first_vf_s: float,
    per_vf_s: tuple[float, float],
    rename_s: float,
    slow_until: int | None = None,
) -> None:
    """The PF and its VF timing: the first VF's netdev ``first_vf_s`` after
    ``sriov_numvfs`` is written, each next one ``per_vf_s`` (seeded) later, probed
    one after another (after VF ``slow_until``, 50-100 ms apart); udev renames each
    ``rename_s`` after it appears."""
    rng = node.rng

    def vf_delay(i: int) -> float:
        if i == 0:
            return first_vf_s + rng.uniform(-0.15, 0.15)
        if slow_until is not None and i > slow_until:
            return rng.uniform(0.05, 0.1)
        return rng.uniform(*per_vf_s)

    node.kernel.add_pf(PF, PF_PCI, totalvfs=64, vf_delay=vf_delay, rename_delay=rename_s)


def _vf_restore(node: Node, agent: bool) -> Cast:
    """Seed 003 phase 1 (09:17:20): MOFED 25.07 replaces a leftover 25.10; 50 VFs."""
    # udev is slow to rename in this burst: the seed's VF0 is still "eth0" at 09:24:41.
    _vf_node(node, first_vf_s=18.6, per_vf_s=(1.2, 1.5), rename_s=0.8)
    node.install(MOFED_2510, RDMA_MODULES, "mofed")  # the leftover
    for m in ("mlx5_core", "mlx5_ib", "ib_umad", "ib_ipoib", "rdma_ucm"):
        node.kernel.modprobe(m, node.mofed_moddir)
    node.sched.sleep(2)
    wanted = _configure_vfs(node, 50)
    node.write(READY)
    mofed = mofed_container(
        node,
        MofedSpec(
            MOFED_2507,
            "25.07-0.9.7.0",
            dtk_start_s=2,
            compile_start_s=3,
            compile_s=155,  # ~09:20
            install_wait_s=140,  # the flag is polled every 300 s: 09:22:20
            install_s=2,
            unload_gap_s=0.5,
            load_gap_s=22.0,  # "~2 minutes": loaded 09:24:22
            vf_restore_start_s=19,  # VF0 at 09:24:41
        ),
    )
    gpu = gpu_driver_container(node, GpuSpec(NVIDIA, manager_s=15, build_s=60, install_s=30))
    sidecar = peermem_sidecar(node, gpu)
    _start_at(node, 0.0, mofed)
    _start_at(node, 449.0, gpu)  # 09:24:49
    return Cast(mofed=[mofed], gpu=gpu, sidecar=sidecar, target=MOFED_2507, vfs={PF: wanted})


def _mofed_upgrade(node: Node, agent: bool) -> Cast:
    """Seed 003 phase 2 (09:28:48): SIGTERM to MOFED 25.07, the 25.10 container replaces it."""
    # 25.10 probes VFs ~7 s apart (the seed: VF16 not there 2 min after numvfs); the
    # rest follow quickly ("VFs now initialized", all 50 ready at 09:39:04).
    _vf_node(node, first_vf_s=12.0, per_vf_s=(6.7, 7.4), rename_s=0.05, slow_until=16)
    node.install(MOFED_2507, RDMA_MODULES, "mofed")
    node.write_headers(MOFED_2507, RDMA_MODULES)
    for m in ("mlx5_core", "mlx5_ib", "ib_umad", "ib_ipoib", "rdma_ucm"):
        node.kernel.modprobe(m, node.mofed_moddir)
    node.sched.sleep(2)
    wanted = _configure_vfs(node, 50)
    attached = _attach_vfs(node)
    old = mofed_container(node, MofedSpec(MOFED_2507, "25.07-0.9.7.0"))
    old.pod["built"] = True  # its driver-toolkit build is done: it goes straight to "match"
    new = mofed_container(
        node,
        MofedSpec(
            MOFED_2510,
            "25.10-1.2.8.0",
            dtk_start_s=0,
            compile_start_s=2,
            compile_s=278,  # 09:34:02
            install_wait_s=21,  # 09:34:23
            install_s=0.5,
            unload_gap_s=0.5,
            load_gap_s=28.2,  # "~2.5 minutes": loaded 09:36:55
            vf_restore_start_s=21,  # sleep 4 (BIND_DELAY_SEC) and more: VF0 at 09:37:17
        ),
        name="mofed-container-25.10",
    )
    gpu = gpu_driver_container(node, GpuSpec(NVIDIA, manager_s=5, build_s=1, install_s=1))
    gpu.pod["built"] = True
    sidecar = peermem_sidecar(node, gpu)
    sched = node.sched
    for c in (old, gpu):
        c.start()
    sched.call_at(0.0, old.terminate)  # 09:28:48 SIGTERM
    _start_at(node, 34.0, new)  # 09:29:22 the new container
    return Cast(
        mofed=[old, new],
        gpu=gpu,
        sidecar=sidecar,
        target=MOFED_2510,
        vfs={PF: wanted},
        pf_side_only={PF: attached},
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "kernel-upgrade-race",
            "nvidia_peermem loaded mid-openibd restart after a kernel upgrade",
            ("000", "001", "002"),
            "11:51:06",
            "5.14.0-427.96.1.el9_4.aarch64+64k",
            900.0,
            (),
            "Both operators start at once after a kernel upgrade. The driver container "
            "builds nvidia-peermem against MOFED 25.07's headers and loads it while "
            "openibd is swapping the 24.10 stack for 25.07. The driver pod's "
            "k8s-driver-manager (v0.9.x, GPU Operator 25.10) stopped waiting at the "
            "first mlx5_core, the host's 24.10.",
            _kernel_upgrade_race,
            mode="operator-peermem-dm09",
        ),
        Scenario(
            "storage-module-race",
            "an NFS-over-RDMA mount loads rpcrdma before MOFED installs",
            ("004",),
            "00:00:00",
            "5.15.0-170-generic",
            2400.0,
            ("storage",),
            "A shared volume is mounted at boot; rpcrdma (a DKMS leftover) loads with "
            "its RDMA chain. The MOFED pod then refuses to install; the GPU driver pod "
            "waits for MOFED forever.",
            _storage_module_race,
        ),
        Scenario(
            "vf-restore",
            "MOFED's VF restore exits on a netdev that is not there yet (50 VFs)",
            ("003",),
            "09:17:20",
            "5.14.0-427.96.1.el9_4.aarch64+64k",
            600.0,
            ("sriov",),
            "MOFED 25.07 replaces a leftover 25.10: openibd restart destroys the 50 VFs; "
            "the restore tries VF0 while its netdev is being renamed, and exits.",
            _vf_restore,
        ),
        Scenario(
            "mofed-upgrade",
            "MOFED 25.07 -> 25.10: the serial VF restore overtakes the VF probes",
            ("003",),
            "09:28:48",
            "5.14.0-427.96.1.el9_4.aarch64+64k",
            720.0,
            ("sriov",),
            "The MOFED pod is replaced by 25.10. After openibd restart the VFs' netdevs "
            "appear one by one, ~7 s apart; the restore loop (~6.4 s a VF) catches up "
            "and exits on the first missing one. VFs 46-47 were in pods (sriov-cni) and "
            "48-49 bound to vfio-pci: MOFED does not even save those.",
            _mofed_upgrade,
        ),
        Scenario(
            "nic-only-node",
            "a node with a ConnectX and no GPU: MOFED installs, nothing is wrong",
            (),
            "00:00:00",
            "5.15.0-170-generic",
            600.0,
            (),
            "A storage node of the same cluster: the DaemonSet runs there too (NFD's 15b3 "
            "label). MOFED's container replaces the inbox stack. The agent must say the "
            "peermem gate and the VF guard do not apply here, raise nothing and do nothing.",
            _nic_only_node,
            hardware=("rdma-nic",),
        ),
        Scenario(
            "gpu-only-node",
            "a GPU node with no RDMA NIC: the driver loads, nothing is wrong",
            (),
            "00:00:00",
            "5.15.0-170-generic",
            600.0,
            (),
            "A GPU node without a ConnectX (no GPUDirect RDMA, or DMA-BUF): the driver "
            "container loads the GPU driver and nobody loads nvidia_peermem. The agent "
            "must say no guard applies here, raise nothing and do nothing.",
            _gpu_only_node,
            mode="dma-buf",
            hardware=("gpu",),
        ),
    )
}


# -- a run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    peermem_loaded: bool  # at the end
    peermem_loads: int  # successful loads during the run
    peermem_failed_loads: int  # by anyone
    peermem_failed_by: dict[str, int]  # who -> failed loads (nvidia-driver-ctr, nodeagent, ...)
    peermem_first_loaded_at: float | None
    ready_flag_at: float | None  # the last time MOFED created its ready flag
    driver_restarts: int  # the GPU driver container (nvidia-driver-ctr)
    sidecar_restarts: int  # nvidia-peermem-ctr
    mofed_installed: bool  # the scenario's MOFED loaded and its ready flag present
    mofed_restarts: int
    vfs_total: int
    vfs_config_back: int  # every field as before
    vfs_partly_back: int  # some fields back
    healthy_at: float | None  # when the node became healthy (and stayed so), seed-seconds
    missing_guards: tuple[str, ...]  # guards the scenario needs that the agent lacks
    # With the agent: the failures it did not prevent, each saying why (the mode, a
    # missing guard). Empty without the agent.
    not_prevented: tuple[str, ...] = ()
    # With the hold (a "-hold" mode): each open it held, whose, how long, how it ended.
    # None in the other modes (and left out of their JSON: those outputs are unchanged).
    held_opens: tuple[str, ...] | None = None
    # With the agent: each guard's verdict at the end, "<word>" or "<word>: <reason>" for
    # one that does not apply (not-applicable, disabled) or is not ok (an alert's input).
    guards_at_end: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in self.__dict__.items()
            if not (k in ("held_opens", "guards_at_end") and v is None)
        }


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    agent: bool
    mode: DeploymentMode
    seed: int
    events: tuple[SimEvent, ...]
    kernel_log: tuple[tuple[float, str], ...]
    verdict: Verdict
    wall_seconds: float
    module_ops: tuple[tuple[float, str, str], ...] = ()  # (t, who, what), from t=0
    agent_records: tuple[dict[str, Any], ...] = ()  # the agent's timeline records, ts in seed-s


def _tmp_base() -> str | None:
    shm = "/dev/shm"  # tmpfs: the agent fsyncs its state every pass
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class _Watcher:
    """After every step: the kernel-state column, new kernel log lines, health."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.cast = Cast()
        self.last_key: Any = None
        self.kmsg_seen = 0
        self.healthy_since: float | None = None

    def summary(self) -> tuple[Any, str]:
        k = self.node.kernel
        parts = []
        mods = [k.module(m) for m in STACK]
        present = [m for m in mods if m is not None]
        # The key leaves out the counts while the stack is in motion: one line per phase.
        if not present:
            parts.append("RDMA stack unloaded")
            stack_key: Any = "none"
        else:
            gens = "/".join(sorted({self.node.generation(m.name) or "?" for m in present}))
            states = {m.state for m in present}
            if len(present) == len(STACK) and states == {"live"}:
                parts.append(f"RDMA {gens}")
                stack_key = ("live", gens)
            else:
                live = sum(m.state == "live" for m in present)
                parts.append(f"RDMA {gens} {live}/4 live")
                stack_key = ("partial", gens)
        if k.module("nvidia") is not None:
            parts.append("nvidia")
        pm = k.module("nvidia_peermem")
        if pm is not None:
            parts.append("peermem" + ("" if pm.state == "live" else f" {pm.state}"))
        rpc = k.module("rpcrdma")
        if rpc is not None:
            parts.append("rpcrdma" + (" in use" if rpc.users else ""))
        vf_key = []
        for pf in k.pfs.values():
            if pf.vfs or self.cast.vfs.get(pf.ifname):
                up = sum(1 for vf in pf.vfs if vf.netdev is not None)
                parts.append(f"VFs {up}/{len(pf.vfs)} netdevs" if pf.vfs else "no VFs")
                vf_key.append((len(pf.vfs), 0 if up == 0 else 2 if up == len(pf.vfs) else 1))
        key = (stack_key, tuple(p for p in parts[1:] if not p.startswith("VFs")), tuple(vf_key))
        return key, " · ".join(parts)

    def healthy(self) -> bool:
        node, k, cast = self.node, self.node.kernel, self.cast
        if cast.target is None and not cast.mofed:  # a node without MOFED (GPU only)
            return cast.gpu is not None and k.is_live("nvidia")
        if not node.exists(READY) or cast.target is None:
            return False
        for m in STACK:
            mod = k.module(m)
            if mod is None or mod.state != "live" or node.generation(m) != cast.target.version:
                return False
        if cast.rdma and not (k.is_live("nvidia_peermem") and node.exists(CTR_READY)):
            return False
        rpcrdma = k.module("rpcrdma")
        if cast.nfs and (rpcrdma is None or not rpcrdma.users):
            return False
        for pf, wanted in cast.vfs.items():
            have = k.pfs[pf].vfs
            if len(have) != len(wanted):
                return False
            if any(cast.config_back(pf, vf.index, vf.config) for vf in have):
                return False
        return True

    def __call__(self) -> None:
        node = self.node
        if node.now() < 0:
            return
        for line in node.kernel.kmsg[self.kmsg_seen :]:
            node.emit("kernel", f"kmsg: {line.text}")
        self.kmsg_seen = len(node.kernel.kmsg)
        key, text = self.summary()
        if key != self.last_key:
            self.last_key = key
            node.emit("kernel", text, kind="state")
        if self.healthy():
            if self.healthy_since is None:
                self.healthy_since = round(node.now(), 3)
        else:
            self.healthy_since = None


def _agent_events(node: Node, records: list[dict[str, Any]]) -> list[SimEvent]:
    """The agent column: gate flips, the guards' transition events, and actions."""
    out: list[SimEvent] = []
    last: dict[str, str] = {}
    before: dict[str, dict[str, Any]] = {}  # each guard's last decision during the boot
    mode = "enforce"

    def gate_line(t: float, rec: dict[str, Any]) -> SimEvent:
        reasons = rec.get("reasons") or []
        why = ""
        if reasons:
            more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
            why = f": {reasons[0]}{more}"
        name = f"{rec.get('guard')} gate" if rec.get("gate", True) else f"{rec.get('guard')}:"
        return SimEvent(t, "agent", f"{name} {rec.get('verdict')}{why}")

    started = False

    def start() -> None:
        out.append(SimEvent(0.0, "agent", f"nodeagent running since boot ({mode} mode)"))
        for guard, prev in before.items():
            last[guard] = str(prev.get("verdict"))
            if prev.get("gate", True) or not prev.get("ok", True):  # a quiet guard says nothing
                out.append(gate_line(0.0, prev))

    for rec in records:
        t = float(rec.get("ts", 0.0))
        kind = rec.get("kind")
        if kind == "start":
            mode = str(rec.get("mode"))
        if t < 0:
            if kind == "decision":
                before[str(rec.get("guard"))] = rec
            continue
        if not started:  # what the agent, running since boot, holds at t=0
            started = True
            start()
        if kind == "decision":
            guard = str(rec.get("guard"))
            verdict = str(rec.get("verdict"))
            for e in rec.get("events") or []:
                out.append(SimEvent(t, "agent", f"{guard}: {e}"))
            if last.get(guard) != verdict:
                last[guard] = verdict
                out.append(gate_line(t, rec))
        elif kind == "held-open":
            out.append(
                SimEvent(
                    t,
                    "agent",
                    f"let {_opener(node, rec.get('pid'))} open "
                    f"{str(rec.get('path')).rsplit('/', 1)[-1]} after {rec.get('seconds')} s "
                    f"held: {rec.get('ended')}",
                )
            )
        elif kind == "hold-root-marked":
            proc = node.kernel.proc_history.get(rec.get("pid"))  # type: ignore[arg-type]
            whose = proc.who if proc is not None else f"pid {rec.get('pid')}"
            out.append(SimEvent(t, "agent", f"marked {whose}'s root (its overlay for this start)"))
        elif kind == "action":
            if rec.get("ok"):
                out.append(SimEvent(t, "agent", f"{rec.get('action')}: ok"))
            else:
                msgs = rec.get("kernel_messages") or []
                kern = f" — kernel: {msgs[0]}" if msgs else ""
                out.append(SimEvent(t, "agent", f"{rec.get('action')}: {rec.get('error')}{kern}"))
    if not started:
        start()
    return out


def run_scenario(
    scenario: Scenario,
    *,
    agent: bool,
    seed: int = 1,
    speed: float | None = None,
    mode: str | None = None,
) -> RunResult:
    """Replay ``scenario`` once. ``speed``: seed-seconds per wall second (None: unpaced);
    ``mode``: another deployment mode than the scenario's own (``MODES``)."""
    wall0 = time.monotonic()
    deployment = MODES[mode or scenario.mode]
    with tempfile.TemporaryDirectory(
        prefix=f"nodeagent-sim-{scenario.name}-", dir=_tmp_base()
    ) as tmp:
        node = Node(
            Path(tmp), scenario.kver, seed=seed, mode=deployment, hardware=scenario.hardware
        )
        sched = node.sched
        box: dict[str, Cast] = {}
        watcher = _Watcher(node)
        harness = None
        missing: tuple[str, ...] = ()
        try:
            if agent:  # the agent's DaemonSet pod runs from boot on
                from nodeagent.sim.harness import AgentHarness, agent_guards

                missing = tuple(g for g in scenario.needs if g not in agent_guards())
                harness = AgentHarness(node)
                harness.start()
                settle = harness.settle

                def after_step() -> None:
                    settle()
                    watcher()

                sched.settle = after_step
            else:
                sched.settle = watcher
            sched.spawn("scene", lambda: box.setdefault("cast", scenario.build(node, agent)))
            sched.run(-1e-9)  # the boot sets the scene; t=0 is the seed's first line
            watcher.cast = box["cast"]
            # peermem belongs on a healthy node of the mode, where there is a GPU
            watcher.cast.rdma = deployment.rdma and "gpu" in scenario.hardware
            watcher()
            if speed:
                start = time.monotonic()
                sched.pace = lambda t: _pace(start, t, speed)
            sched.run(scenario.duration)
            # The end: read everything now, before the actors unwind.
            node.closed = True
            events = list(node.events)
            records = list(harness.agent.sim_records) if harness is not None else []
            if harness is not None:
                events += _agent_events(node, records)
            events.sort(key=lambda e: e.t)  # stable: same-time lines keep their order
            verdict = _verdict(node, watcher.cast, watcher, missing)
            if harness is not None and deployment.hold:
                hold = harness.agent.peermem_hold.hold
                still = hold.held() if hold is not None else []
                verdict = replace(verdict, held_opens=_held_opens(node, records, still))
            if agent:
                verdict = replace(verdict, guards_at_end=_guards_at_end(records))
                sidecar = watcher.cast.sidecar
                probe_kills = sum(code == 137 for _t, code in sidecar.exits) if sidecar else 0
                verdict = replace(
                    verdict, not_prevented=_not_prevented(verdict, deployment, probe_kills)
                )
            kmsg = tuple((round(line.t, 3), line.text) for line in node.kernel.kmsg if line.t >= 0)
            ops = tuple((round(t, 3), who, what) for t, who, what in node.kernel.op_log if t >= 0)
        finally:
            node.closed = True
            if harness is not None:
                harness.stop()
            sched.close()
            if harness is not None:
                harness.join()
                if harness.thread.is_alive():
                    raise SimError("the agent thread did not stop")
            node.kernel.uevent_source.close()
    wall = time.monotonic() - wall0
    return RunResult(
        scenario, agent, deployment, seed, tuple(events), kmsg, verdict, wall, ops, tuple(records)
    )


def _guards_at_end(records: list[dict[str, Any]]) -> dict[str, str]:
    last: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "decision" and isinstance(r.get("guard"), str):
            last[r["guard"]] = r
    out = {}
    for guard, r in sorted(last.items()):
        word, reasons = str(r.get("verdict")), r.get("reasons") or []
        shelved = word in applicability.WORDS or not r.get("ok")
        out[guard] = f"{word}: {reasons[0]}" if shelved and reasons else word
    return out


def _pace(start: float, t: float, speed: float) -> None:
    if t <= 0:
        return
    delay = start + t / speed - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _verdict(node: Node, cast: Cast, watcher: _Watcher, missing: tuple[str, ...]) -> Verdict:
    k = node.kernel
    loads = [
        (t, who, what)
        for t, who, what in k.op_log
        if t >= 0 and what.startswith("load nvidia_peermem")
    ]
    ok = [t for t, _who, what in loads if what == "load nvidia_peermem"]
    failed_by: dict[str, int] = {}
    for _t, who, what in loads:
        if what != "load nvidia_peermem":
            failed_by[who] = failed_by.get(who, 0) + 1
    ready_writes = [t for t, op, rel in node.file_log if t >= 0 and op == "write" and rel == READY]
    target = cast.target
    installed = (
        target is not None
        and node.exists(READY)
        and all(k.is_live(m) and node.generation(m) == target.version for m in STACK)
    )
    total = back = partly = 0
    for pf_name, wanted in cast.vfs.items():
        have = [vf.config for vf in k.pfs[pf_name].vfs]
        for i in range(len(wanted)):
            total += 1
            got = have[i] if i < len(have) else VfConfig()
            diff = cast.config_back(pf_name, i, got)
            if not diff:
                back += 1
            elif len(diff) < len(cast.config_back(pf_name, i, VfConfig())):
                partly += 1
    return Verdict(
        peermem_loaded=k.is_live("nvidia_peermem"),
        peermem_loads=len(ok),
        peermem_failed_loads=len(loads) - len(ok),
        peermem_failed_by=dict(sorted(failed_by.items())),
        peermem_first_loaded_at=round(ok[0], 3) if ok else None,
        ready_flag_at=round(ready_writes[-1], 3) if ready_writes else None,
        driver_restarts=cast.gpu.restarts if cast.gpu else 0,
        sidecar_restarts=cast.sidecar.restarts if cast.sidecar else 0,
        mofed_installed=installed,
        mofed_restarts=sum(c.restarts for c in cast.mofed),
        vfs_total=total,
        vfs_config_back=back,
        vfs_partly_back=partly,
        healthy_at=watcher.healthy_since,
        missing_guards=missing,
    )


def _opener(node: Node, pid: object) -> str:
    proc = node.kernel.proc_history.get(pid) if isinstance(pid, int) else None
    return f"{proc.who}'s {proc.comm}" if proc is not None else f"pid {pid}"


def _held_opens(
    node: Node, records: list[dict[str, Any]], still: list[tuple[int, str, str, float]]
) -> tuple[str, ...]:
    """The hold's ``held-open`` records, in words (whose open, of what, how long, why it
    ended), then the opens still held when the run ends."""
    ended = [
        f"{_opener(node, r.get('pid'))} held {r.get('seconds')} s opening "
        f"{r.get('path')}: {r.get('ended')}"
        for r in records
        if r.get("kind") == "held-open"
    ]
    held = [
        f"{_opener(node, pid)} still held at the end, {seconds:.1f} s, opening {path}"
        for pid, _opener_name, path, seconds in still
    ]
    return (*ended, *held)


def _not_prevented(v: Verdict, mode: DeploymentMode, probe_kills: int = 0) -> tuple[str, ...]:
    """The failures of a run with the agent, each labelled with why the agent let it be."""
    out = []
    for who, n in v.peermem_failed_by.items():
        why = (
            "nodeagent's own load failed"
            if who == "nodeagent"
            else f"not prevented in mode {mode.name}: {mode.not_prevented}"
        )
        out.append(f"{n} failed nvidia_peermem load(s) by {who}: {why}")
    if mode.hold and v.sidecar_restarts and probe_kills == v.sidecar_restarts:
        out.append(
            f"nvidia-peermem-ctr restarts ({v.sidecar_restarts}): each by its own probe, "
            "which fails whenever mlx5_core is loaded and nvidia_peermem is not ("
            + (
                "here while the held load waits for MOFED's ready flag"
                if v.held_opens
                else "no load was held: nvidia_peermem was out for MOFED's restart"
            )
            + f"); no load failed: not prevented in mode {mode.name}"
        )
    if v.driver_restarts or (
        v.sidecar_restarts and not (mode.hold and probe_kills == v.sidecar_restarts)
    ):
        out.append(
            f"GPU driver pod restarts (nvidia-driver-ctr {v.driver_restarts}, "
            f"nvidia-peermem-ctr {v.sidecar_restarts}): not prevented in mode {mode.name}"
        )
    if v.missing_guards:
        names = ", ".join(f"{g} guard" for g in v.missing_guards)
        out.append(f"needs the {names}: guard not built yet (the failure is real)")
    elif v.healthy_at is None:
        out.append(f"node not healthy at the end: not prevented in mode {mode.name}")
    return tuple(out)
