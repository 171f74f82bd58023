"""Which GPUDirect RDMA path this node can take: DMA-BUF, or only ``nvidia_peermem``.

NVIDIA recommends DMA-BUF for GPUDirect RDMA where it can work: the open
kernel modules (which only support Turing and newer GPUs) on a kernel >= 5.12.
``nvidia_peermem`` is still what the proprietary modules, older kernels and
stacks that register ``cudaMalloc`` memory with plain ``ibv_reg_mr`` use — and
applications on a DMA-BUF node may fall back to it, so this classification
only ever informs; it never makes the agent unload peermem.

What the node shows: the loaded driver's banner in ``/proc/driver/nvidia/version``
(``NVIDIA UNIX Open Kernel Module for <arch>`` vs ``NVIDIA UNIX <arch> Kernel
Module``), the kernel release, and the peer-memory clients registered with
MOFED's ``ib_core`` under ``/sys/kernel/mm/memory_peers/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nodeagent.core.snapshot import TextFact

__all__ = ["DMABUF_MIN_KERNEL", "GpuDirect", "classify", "kernel_release"]

DMABUF_MIN_KERNEL = (5, 12)
_BANNER = re.compile(
    r"^NVRM version: NVIDIA UNIX (Open )?.*?Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)(?:\s|$)"
)
_KERNEL = re.compile(r"^(\d+)\.(\d+)")


def kernel_release(kernel: str) -> tuple[int, int] | None:
    m = _KERNEL.match(kernel)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class GpuDirect:
    modules: str  # "open" | "proprietary" | "unknown"
    driver_version: str | None
    kernel: str
    kernel_dmabuf: bool | None  # kernel >= 5.12; None when the release is unparseable
    peer_memory_clients: tuple[str, ...]
    dmabuf_capable: bool | None  # None: cannot tell (no driver banner)
    why: str  # the evidence behind the summary, in operator words

    @property
    def peermem_required(self) -> str:
        return {True: "no", False: "yes", None: "unknown"}[self.dmabuf_capable]

    @property
    def summary(self) -> str:
        if self.dmabuf_capable:
            return "DMA-BUF capable; peermem not required"
        if self.dmabuf_capable is False:
            return "not DMA-BUF capable; peermem required for GPUDirect RDMA"
        return "DMA-BUF capability unknown; peermem may be required"

    def reason(self) -> str:
        """The line the peermem gate adds to its reasons."""
        return f"GPUDirect RDMA: {self.summary} ({self.why})"

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": self.modules,
            "driver_version": self.driver_version,
            "kernel": self.kernel,
            "kernel_dmabuf": self.kernel_dmabuf,
            "peer_memory_clients": list(self.peer_memory_clients),
            "dmabuf_capable": self.dmabuf_capable,
            "peermem_required": self.peermem_required,
            "summary": self.summary,
            "why": self.why,
        }


def classify(version: TextFact, kernel: str, peer_clients: tuple[str, ...]) -> GpuDirect:
    """From the driver banner, the kernel release and the registered peer-memory clients."""
    release = kernel_release(kernel)
    kernel_ok = None if release is None else release >= DMABUF_MIN_KERNEL
    first = (version.text or "").splitlines()[0] if version.text else ""
    m = _BANNER.match(first)
    if version.text is None or m is None:
        got = version.problem if version.text is None else f"unrecognised banner {first[:60]!r}"
        modules, driver, capable = "unknown", None, None
        why = f"{version.path}: {got}; the loaded nvidia module says which kind it is"
    else:
        modules = "open" if m.group(1) else "proprietary"
        driver = m.group(2)
        if modules == "proprietary":
            capable = False
            why = f"proprietary kernel modules {driver}"
        elif kernel_ok is False:
            capable = False
            why = f"open kernel modules {driver}, but kernel {kernel} is older than 5.12"
        elif kernel_ok is None:
            capable = None
            why = f"open kernel modules {driver}; kernel release {kernel!r} unparseable"
        else:
            capable = True
            why = (
                f"open kernel modules {driver}, kernel {kernel} >= 5.12; stacks that register "
                "cudaMalloc memory with plain ibv_reg_mr still use nvidia_peermem"
            )
    return GpuDirect(modules, driver, kernel, kernel_ok, peer_clients, capable, why)
