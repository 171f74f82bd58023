"""The deployment modes a simulated run stands for (``deploy/README.md``).

A mode is the set of operator settings on the node: whether the GPU
Operator loads ``nvidia_peermem`` (``driver.rdma.enabled``), where MOFED comes
from (``driver.rdma.useHostMofed``), and what the driver pod's
``k8s-driver-manager`` init container waits for. The simulated containers read
these and nothing else: no simulated operator container knows nodeagent
exists, exactly as no shipped one does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["DEFAULT_MODE", "MODES", "DeploymentMode", "shipped_and_hold"]

MofedWait = Literal["ready-flag", "mlx5_core"]


@dataclass(frozen=True)
class DeploymentMode:
    name: str
    title: str
    settings: tuple[str, ...]  # what is set in ClusterPolicy / NicClusterPolicy
    rdma: bool  # driver.rdma.enabled: the driver container and the sidecar load peermem
    host_mofed: bool  # driver.rdma.useHostMofed: no MOFED container; MOFED is on the host
    # What k8s-driver-manager (the driver pod's init container) polls for before the
    # driver container starts: the ready flag, or any "mlx5_core" in /proc/modules.
    manager_waits_for: MofedWait
    loaders: tuple[str, ...]  # who loads nvidia_peermem in this mode
    not_prevented: str  # why nodeagent cannot stop the loaders' failures here
    # nodeagent deployed with deploy/components/peermem-hold ([peermem] hold_loads =
    # "fanotify"): the loaders' opens wait for the gate. The operator containers are the
    # same; only the agent's deployment differs.
    hold: bool = False

    @property
    def agent_mofed(self) -> Literal["container", "host"]:
        """nodeagent's ``[peermem] mofed`` setting for this mode."""
        return "host" if self.host_mofed else "container"


_WITH_MOFED_CONTAINER = (
    "ClusterPolicy driver.rdma.enabled=true",
    "ClusterPolicy driver.rdma.useHostMofed=false",
    "NicClusterPolicy ofedDriver deployed",
)
_LOADERS = ("nvidia-driver-ctr", "nvidia-peermem-ctr", "nodeagent (enforce)")
_OPERATOR_LOADS = (
    "the GPU Operator's nvidia-driver-ctr and nvidia-peermem-ctr load nvidia_peermem "
    "themselves and wait on nothing nodeagent publishes"
)

MODES: dict[str, DeploymentMode] = {
    m.name: m
    for m in (
        DeploymentMode(
            "operator-peermem",
            "GPU Operator loads nvidia_peermem; MOFED container (Network Operator)",
            (*_WITH_MOFED_CONTAINER, "k8s-driver-manager >= v0.10.0 (GPU Operator >= v26.3.0)"),
            rdma=True,
            host_mofed=False,
            manager_waits_for="ready-flag",
            loaders=_LOADERS,
            not_prevented=_OPERATOR_LOADS,
        ),
        DeploymentMode(
            "operator-peermem-dm09",
            "as operator-peermem, on GPU Operator v25.10.x (k8s-driver-manager v0.9.x)",
            (
                *_WITH_MOFED_CONTAINER,
                "k8s-driver-manager v0.9.0/v0.9.1: waits for any mlx5_core, not the ready flag",
            ),
            rdma=True,
            host_mofed=False,
            manager_waits_for="mlx5_core",
            loaders=_LOADERS,
            not_prevented=_OPERATOR_LOADS
            + "; the driver pod's init container stops waiting at the first mlx5_core",
        ),
        DeploymentMode(
            "host-mofed",
            "GPU Operator loads nvidia_peermem; MOFED installed on the host",
            (
                "ClusterPolicy driver.rdma.enabled=true",
                "ClusterPolicy driver.rdma.useHostMofed=true",
                "no NicClusterPolicy ofedDriver",
            ),
            rdma=True,
            host_mofed=True,
            manager_waits_for="mlx5_core",
            loaders=_LOADERS,
            not_prevented=_OPERATOR_LOADS,
        ),
        DeploymentMode(
            "dma-buf",
            "GPUDirect RDMA over DMA-BUF: nobody loads nvidia_peermem",
            (
                "ClusterPolicy driver.rdma.enabled=false (the default)",
                "open kernel modules, kernel >= 5.12",
            ),
            rdma=False,
            host_mofed=False,
            manager_waits_for="ready-flag",
            loaders=(),
            not_prevented="nobody loads nvidia_peermem in this mode",
        ),
    )
}

_HOLD_SETTING = (
    'nodeagent with deploy/components/peermem-hold: [peermem] hold_loads = "fanotify" '
    "(hostPID, CAP_SYS_ADMIN, CAP_SYS_PTRACE)"
)
_HOLD_LEFT = (
    "the hold makes the operator's loads wait for the gate, never fail: a load it lets "
    "through (the gate open, or its budget spent) can still be refused by the kernel"
)


def _with_hold(mode: DeploymentMode) -> DeploymentMode:
    return replace(
        mode,
        name=f"{mode.name}-hold",
        title=f"{mode.title}; nodeagent holds their loads (fanotify)",
        settings=(*mode.settings, _HOLD_SETTING),
        not_prevented=_HOLD_LEFT,
        hold=True,
    )


# The hold with the MOFED container (Network Operator), where the seeds happened. Not
# host-mofed: no scenario here has MOFED on the host, and there the gate compares the
# loaded stack with the host's tree, which these scenarios leave stale.
for _name in ("operator-peermem", "operator-peermem-dm09"):
    MODES[f"{_name}-hold"] = _with_hold(MODES[_name])

DEFAULT_MODE = "operator-peermem"


def shipped_and_hold(name: str) -> tuple[str, str | None]:
    """The mode ``name`` stands for as shipped (nodeagent from ``deploy/base``, no hold)
    and the same operator settings with the hold component (None: no hold mode)."""
    shipped = name.removesuffix("-hold") if MODES[name].hold else name
    hold = f"{shipped}-hold"
    return shipped, hold if hold in MODES else None
