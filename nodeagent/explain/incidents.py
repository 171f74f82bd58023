"""Each kind of incident: its title, the remedy in operator words, and which deployment
modes of deploy/README.md would have prevented it. Data only."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("operator-peermem", "operator-peermem-dm09", "host-mofed", "dma-buf")
HOLD_MODES = ("operator-peermem-hold", "operator-peermem-dm09-hold")


@dataclass(frozen=True)
class Incident:
    kind: str
    title: str
    remedy: str
    prevented_by: tuple[str, ...]  # deployment modes (deploy/README.md), with the agent
    not_prevented_by: tuple[str, ...]


INCIDENTS: tuple[Incident, ...] = (
    Incident(
        "peermem-load-race",
        "nvidia_peermem loaded while MOFED was restarting its RDMA stack (Invalid argument)",
        "wait for MOFED's ready flag (/run/mellanox/drivers/.driver-ready) before loading "
        "nvidia_peermem; restarting the driver pod after MOFED is ready clears it",
        HOLD_MODES,
        ("operator-peermem", "operator-peermem-dm09 (nothing shipped waits on the gate)"),
    ),
    Incident(
        "peermem-abi-mismatch",
        "the GPUDirect module was built against another MOFED (or GPU driver) than the one "
        "loaded: its symbol versions disagree",
        "recreate the GPU driver pod (cordon, drain, delete it) so nvidia-peermem is rebuilt "
        "against the MOFED now loaded (nv_peer_mem: rebuild its package against the installed "
        "MLNX_OFED); the agent's verdict for this is 'rebuild'",
        (),
        (*MODES[:3], "operator-peermem-hold (the load is let go and fails as before)"),
    ),
    Incident(
        "peermem-einval-unexplained",
        "the GPUDirect module failed to load with Invalid argument, and these logs do not say why",
        "three causes fit; the kernel's lines and MOFED's log at that minute tell them "
        "apart. (1) A load while MOFED restarted its RDMA stack (peermem-load-race): MOFED's "
        "container log shows 'Unsetting driver ready state' or an openibd restart at that "
        "minute, a later try works; remedy: load it after MOFED's ready flag "
        "(/run/mellanox/drivers/.driver-ready), restart the driver pod once MOFED is ready. "
        "(2) A module built against another MOFED (peermem-abi-mismatch): `dmesg | grep -i "
        "peermem` shows 'disagrees about version of symbol' on every try; remedy: recreate "
        "the GPU driver pod so it is rebuilt against the MOFED loaded. (3) A module built "
        "with no MOFED present (its init returns EINVAL and the kernel prints nothing): "
        "every try fails and dmesg is silent; remedy: rebuild it once MOFED is installed "
        "(GPU Operator: recreate the driver pod after MOFED's pod is ready)",
        (HOLD_MODES[0], f"{HOLD_MODES[1]} (the race only)"),
        ("operator-peermem", "operator-peermem-dm09 (either cause)"),
    ),
    Incident(
        "peermem-no-peer-api",
        "the GPUDirect module loaded against an ib_core without the peer-memory API (the "
        "kernel's inbox one), or with none loaded",
        "load MOFED's RDMA stack before nvidia-peermem (the inbox ib_core lacks "
        "ib_register_peer_memory_client), or use DMA-BUF where the GPU and kernel allow",
        ("operator-peermem-hold", "operator-peermem-dm09-hold (an inbox ib_core load is held)"),
        ("operator-peermem", "operator-peermem-dm09", "host-mofed"),
    ),
    Incident(
        "peermem-no-gpu-driver",
        "the GPUDirect module loaded without the NVIDIA driver's P2P API (nvidia_p2p_*): "
        "nvidia.ko not loaded first",
        "load the NVIDIA driver (nvidia.ko) before nv_peer_mem/nvidia-peermem; on the GPU "
        "Operator the driver container does this in order: look at why nvidia.ko failed",
        (),
        MODES,
    ),
    Incident(
        "peermem-load-failed",
        "the GPUDirect module failed to load, and these logs do not have the kernel's reason",
        "read the kernel's lines for that load: `dmesg | grep -iE 'peer_?mem'` on the node "
        "('disagrees about version of symbol': rebuild against the MOFED loaded; 'Unknown "
        "symbol ib_register_peer_memory_client': an inbox ib_core, load MOFED first; 'Unknown "
        "symbol nvidia_p2p_*': load the NVIDIA driver first), then run explain on them too",
        (),
        (),
    ),
    Incident(
        "peermem-not-built",
        "nvidia-peermem.ko is not there to load (the driver install left it out)",
        "reinstall the driver with peermem built (GPU Operator: recreate the driver pod; "
        "a userspace-only fast path skips it)",
        (),
        MODES,
    ),
    Incident(
        "storage-blocks-mofed",
        "storage modules (rpcrdma, nvme_rdma, ...) loaded, so MOFED refused to install",
        "unload the storage chain before MOFED installs (UNLOAD_STORAGE_MODULES=true if "
        "unloading them is acceptable), or run nodeagent's storage guard (policy hold)",
        MODES,
        (),
    ),
    Incident(
        "storage-module-other-stack",
        "a storage module built for one RDMA stack (inbox or MOFED) met the other's "
        "symbols: it cannot load (or MOFED's install meets it loaded)",
        "load the storage modules built for the stack that is loaded: once MOFED is up, "
        "MOFED's own builds (its nvme-rdma/rpcrdma packages, or the driver container's "
        "storage modules), not the kernel's inbox ones; nodeagent's storage guard loads "
        "the chain back with the node's modprobe, so it meets this too if the node's tree "
        "holds only the inbox builds",
        (),
        MODES,
    ),
    Incident(
        "rdma-module-other-stack",
        "a module built for one RDMA stack (inbox or MOFED) met the other's mlx5/RDMA "
        "symbols, so it could not load",
        "load it from the stack that is loaded: after MOFED's restart, MOFED's own build "
        "(inbox auxiliaries such as mlx5_vdpa are blacklisted during the restart and loaded "
        "after it); a module of your own built against the inbox ib_core (an SMB-Direct or "
        "DRBD transport) must be rebuilt against MOFED's (its ofa_kernel headers)",
        (),
        MODES,
    ),
    Incident(
        "openibd-module-in-use",
        "openibd restart failed: a module it must unload is in use",
        "find the holder (lsmod, the 'in use by' module): an idle nvidia_peermem is unloaded "
        "by nodeagent at the restart's start; a storage or user-held module needs its users "
        "stopped first",
        MODES[:3],
        (),
    ),
    Incident(
        "openibd-restart-failed",
        "MOFED's openibd restart failed (or its log ends mid-restart), so the RDMA stack "
        "was not loaded back",
        "read openibd's output in the MOFED container's log (it is printed after openibd "
        "ends, just before 'Command \"/etc/init.d/openibd restart\" failed'): a module "
        "named '[FAILED]' is in use (lsmod shows by what) or is not MOFED's build; fix "
        "that, then restart the MOFED pod",
        (),
        MODES[:3],
    ),
    Incident(
        "vf-restore-before-netdev",
        "a VF restore ran before the VF's netdev existed",
        "restore each VF when its netdev appears (nodeagent's VF guard does), then re-run the "
        "restore; pods on the VFs that lost their config need a restart",
        MODES,
        (),
    ),
)
KINDS = {i.kind: i for i in INCIDENTS}
