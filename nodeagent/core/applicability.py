"""Whether a guard applies to this node: every rule in one place.

A DaemonSet on mixed nodes (GPU+RDMA, NIC-only, GPU-only, no SR-IOV) meets
nodes where a guard has nothing to guard. Such a node is not a broken node:
the guard says ``not-applicable`` with its reason, ``ok`` (``check`` exits 0,
no alert can fire), and does nothing. Each guard's ``[<guard>] enabled``
setting chooses:

- ``"auto"`` (the default): the guard's ``not_applicable(snap, memory)`` says
  from what the node *has* (PCI devices, MOFED's files, SR-IOV PFs), never
  from what is loaded now: a GPU node whose driver container has not loaded
  ``nvidia`` yet is a GPU node whose gate is closed. What cannot be read
  counts as present (fail closed: the guard applies), and a guard with work
  owed (a hold file of its own, modules to load back, VFs to restore) applies
  until it is done.
- ``false``: ``disabled``, and none of its observation runs (its needs are
  dropped from the union).
- ``true``: always applies.

The reconciler applies this before a guard decides (``shelved``); the words
join every guard's ``verdict_words`` (``nodeagent_guard_state``) through
``core/telemetry.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from nodeagent.core.guard import GuardDecision, Verdict
from nodeagent.core.snapshot import NodeSnapshot, PciDevice
from nodeagent.errors import NodeagentError

NOT_APPLICABLE = "not-applicable"
DISABLED = "disabled"
WORDS: tuple[str, ...] = (NOT_APPLICABLE, DISABLED)

Enabled = Literal["auto"] | bool
ENABLED_CHOICES = ("auto", True, False)

# PCI IDs (include/linux/pci_ids.h): the vendor, and the class's top byte.
NVIDIA_VENDOR = 0x10DE
MELLANOX_VENDOR = 0x15B3
DISPLAY_CLASS = 0x03  # VGA 0x0300, 3D 0x0302: a GPU (NVIDIA's audio and USB functions are not)
NETWORK_CLASS = 0x02  # Ethernet 0x0200, InfiniBand 0x0207 (a BlueField's bridges are not)


def parse_enabled(where: str, value: Any) -> Enabled:
    """``"auto"``, ``true`` or ``false``; NodeagentError naming the key otherwise."""
    if value == "auto" or isinstance(value, bool):
        return value
    raise NodeagentError(f'config {where}: expected "auto", true or false, got {value!r}')


def devices(snap: NodeSnapshot, vendor: int, cls: int) -> list[str] | None:
    """The PCI addresses of ``vendor``'s devices of class ``cls`` (its top byte); None when
    the PCI bus could not be read, or listed no device at all (no real node shows that:
    a host bridge at least), then nobody can say the device is absent."""
    if not snap.pci:
        return None
    return sorted(a for a, d in snap.pci.items() if _is(d, vendor, cls))


def _is(d: PciDevice, vendor: int, cls: int) -> bool:
    # A device whose IDs could not be read may be this one: it counts (fail closed).
    vendor_ok = d.vendor is None or d.vendor == vendor
    class_ok = d.pci_class is None or d.pci_class >> 16 == cls
    return vendor_ok and class_ok


def decision(guard: Any, snap: NodeSnapshot, memory: Any) -> GuardDecision[Any] | None:
    """The decision of a guard that does not apply (disabled, or auto and nothing to guard);
    None when it applies and decides itself."""
    enabled = _enabled(guard)
    if enabled is False:
        return shelved(
            guard.name,
            DISABLED,
            f"turned off ([{guard.name}] enabled = false): nothing observed, nothing done",
            memory,
        )
    if enabled == "auto":
        why = guard.not_applicable(snap, memory)
        if why:
            return shelved(guard.name, NOT_APPLICABLE, why, memory)
    return None


def shelved(guard: str, word: str, why: str, memory: Any) -> GuardDecision[Any]:
    evidence: Mapping[str, Any] = {"applicable": False, "why": why}
    return GuardDecision(
        verdict=Verdict(guard, word, True, (why,), evidence), actions=(), memory=memory
    )


def observed(guard: Any) -> bool:
    """Whether a guard's needs are observed: not when it is turned off."""
    return _enabled(guard) is not False


def _enabled(guard: Any) -> Enabled:
    """Its policy's ``enabled``; a guard with no such setting always applies."""
    enabled: Enabled = getattr(getattr(guard, "policy", None), "enabled", True)
    return enabled
