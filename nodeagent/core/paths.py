"""Where things are on the node, relative to the host root (``/`` on a node, ``/host`` in the pod).

Plain data, so guards can be built from it; ``[paths]`` in the config file
overrides any of them (validated in nodeagent.config).
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeagent.core.mofed import MofedMarkers


@dataclass(frozen=True)
class HostPaths:
    osrelease: str = "proc/sys/kernel/osrelease"
    sys_module: str = "sys/module"
    mofed_ready: str = "run/mellanox/drivers/.driver-ready"
    mofed_lock: str = "run/mellanox/drivers/.lock"
    mofed_blacklist: str = "etc/modprobe.d/blacklist-ofed-modules.conf"
    validations: str = "run/nvidia/validations"
    mofed_driver_root: str = "run/mellanox/drivers"
    gpu_driver_root: str = "run/nvidia/driver"
    state_dir: str = "run/nodeagent"
    timeline_dir: str = "var/lib/nodeagent"
    locks: str = "proc/locks"
    mountinfo: str = "proc/1/mountinfo"
    nvme_class: str = "sys/class/nvme"
    nvmet_ports: str = "sys/kernel/config/nvmet/ports"
    nvidia_version: str = "proc/driver/nvidia/version"  # the loaded driver's banner
    memory_peers: str = "sys/kernel/mm/memory_peers"  # peer-memory clients (MOFED's ib_core)
    journal_socket: str = "run/systemd/journal/socket"
    sriov_snapshot: str = "var/lib/nodeagent/sriov.json"  # the VF guard's saved VF configs
    sriov_cni_cache: str = "var/lib/cni/sriov"  # sriov-cni's per-attachment cache

    @property
    def mofed(self) -> MofedMarkers:
        return MofedMarkers(
            ready=self.mofed_ready,
            lock=self.mofed_lock,
            blacklist=self.mofed_blacklist,
            driver_root=self.mofed_driver_root,
        )
