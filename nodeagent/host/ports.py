"""How the agent reaches the node: one bundle of host ports.

Each field left ``None`` is the running node's own, filled in by the one
composition root (``nodeagent/loop/wiring.py``). The simulator and the tests
replace this one object, not one keyword per collaborator. Only types are
imported here, so a tool that never acts (``nodeagent check``) loads none of
the libraries behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeagent.host.events import WakeSource
    from nodeagent.host.kmod import ModuleOps
    from nodeagent.host.observe import Readers

# Recent kernel log lines about a module (``host/act.py``, ``kmsg_reader``).
KernelLog = Callable[[str], list[str]]


@dataclass(frozen=True)
class HostPorts:
    module_ops: ModuleOps | None = None  # libkmod (else modprobe)
    kernel_log: KernelLog | None = None  # /dev/kmsg
    readers: Readers | None = None  # locks, mounts, NVMe; a guard's host side adds its own
    # A guard's own ports, by the guard's name, each typed by its wing (guards/<name>/):
    # "sriov" its SriovOps (netlink and sriov_numvfs), "peermem" the hold's HoldHost (the
    # kernel the fanotify hold marks and answers). The host layer names none of them.
    guard_ports: Mapping[str, Any] = field(default_factory=dict)
    wake_sources: Sequence[WakeSource] = ()  # besides inotify, uevents and the loop's pokes
