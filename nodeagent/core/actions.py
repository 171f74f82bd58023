"""What guards ask the host layer to do, and what came of it.

Actions are plain immutable values; ``nodeagent.host.act`` is the only code
that turns them into kernel or file operations, through one table keyed by
action type. Every action names the guard that asked for it and why, so the
timeline can show the evidence. A guard's actions of one pass form its
``Plan``: a strategy (``sequence`` stops at the first failure; ``parallel``
runs up to ``bound`` steps at once) over the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class LoadModuleFile:
    """Insert exactly this .ko (the one the guard verified), like insmod."""

    guard: str
    module: str
    path: str  # relative to the host root
    params: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        params = " ".join(self.params)
        return f"load {self.module} from {self.path}" + (f" ({params})" if params else "")


@dataclass(frozen=True)
class LoadModule:
    """Load a module by name with its dependencies, like modprobe -d, from the first
    driver tree that has it (``trees``: driver roots under the host root; "" is the host's)."""

    guard: str
    module: str
    trees: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        where = " or ".join(f"/{t}" if t else "the host" for t in self.trees)
        return f"load {self.module} from {where}"


@dataclass(frozen=True)
class UnloadModule:
    guard: str
    module: str
    reason: str

    def describe(self) -> str:
        return f"unload {self.module}"


@dataclass(frozen=True)
class WriteFile:
    """Write a file under the host root atomically (temp, fsync, rename; no symlink followed)."""

    guard: str
    path: str  # relative to the host root
    content: str
    reason: str

    def describe(self) -> str:
        return f"write {self.path}"


@dataclass(frozen=True)
class RemoveFile:
    guard: str
    path: str  # relative to the host root
    reason: str

    def describe(self) -> str:
        return f"remove {self.path}"


@dataclass(frozen=True)
class RestoreVf:
    """Bring one VF's saved config back: through its PF (netlink), then its own netdev.

    The host resolves the PF and the VF's netdev from their PCI addresses at
    the time it acts (names change: udev renames a new VF netdev), writes only
    the fields that differ, and reads every field back.
    """

    guard: str
    pf_pci: str
    index: int
    vf_pci: str
    pf_settings: tuple[tuple[str, Any], ...]  # (field, value), set with IFLA_VFINFO_LIST
    link_settings: tuple[tuple[str, Any], ...]  # (field, value), set on the VF's netdev
    reason: str

    def describe(self) -> str:
        return f"restore VF {self.index} ({self.vf_pci}) of {self.pf_pci}"


@dataclass(frozen=True)
class SetNumVfs:
    """Write ``sriov_numvfs`` (through 0 first when VFs exist: the kernel refuses n -> m)."""

    guard: str
    pf_pci: str
    numvfs: int
    through_zero: bool
    reason: str

    def describe(self) -> str:
        via = " (through 0)" if self.through_zero else ""
        return f"set sriov_numvfs of {self.pf_pci} to {self.numvfs}{via}"


Action = LoadModuleFile | LoadModule | UnloadModule | WriteFile | RemoveFile | RestoreVf | SetNumVfs

Strategy = Literal["sequence", "parallel"]


@dataclass(frozen=True)
class Plan:
    guard: str
    steps: tuple[Action, ...]
    strategy: Strategy = "sequence"
    bound: int = 1  # parallel: at most this many steps at once
    # Protective (e.g. unloading an idle peermem as a MOFED restart begins): started in the
    # pass that decided it, before any bookkeeping, never queued behind a step in flight.
    urgent: bool = False
    # With no steps: nothing new to start, and the plan running or queued still stands
    # (its premise holds: the storage guard's removal while it holds), so it is not
    # superseded. Without it, an empty decision stops a running plan at its next step.
    lets_finish: bool = False


@dataclass(frozen=True)
class ActionOutcome:
    action: Action
    ok: bool
    errno: int | None = None
    error: str | None = None  # one line, e.g. "Invalid argument (EINVAL)"
    kernel_messages: tuple[str, ...] = ()  # the kernel's own lines about the module
    performed: bool = True  # False in observe mode: decided and recorded, not done
    # Stamped by the host layer when performed (agent clock): when it ended, how long it took.
    finished_at: float | None = None
    seconds: float | None = None
    # When the pass that decided it began (agent clock): its outcome is absorbed a pass later.
    decided_at: float | None = None
    # Per-field results of a multi-field action: (field, "written" | "unsupported" | ...).
    detail: tuple[tuple[str, str], ...] = ()
