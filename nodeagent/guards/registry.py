"""The one list of guards: where a guard plugs in.

A guard is its decision, one file under ``core/`` (pure: ``needs()``,
``decide``, ``absorb``, its policy and memory), and one entry here. The entry
says how to parse the guard's ``[<name>]`` config table into its policy, how
to build the guard from that policy and the host paths, and, only if the
guard needs more from the node than the observer and the shared executors
give, its host side (``guards/side.py``). Nothing else changes: the loop
(``nodeagent/loop/``) runs every entry the same way and names no guard. See
docs/design.md, "Adding a guard".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.core import peermem, sriov, storage
from nodeagent.core.guard import Guard
from nodeagent.core.paths import HostPaths
from nodeagent.core.reconcile import Reconciler
from nodeagent.guards.peermem.side import PeermemHold
from nodeagent.guards.side import SideFactory
from nodeagent.guards.sriov.side import SriovSide


@dataclass(frozen=True)
class GuardEntry:
    name: str
    default_policy: Any
    # ([name] table, the policy so far) -> policy; NodeagentError naming a bad value
    parse_policy: Callable[[Mapping[str, Any], Any], Any]
    build: Callable[[Any, HostPaths], Guard[Any]]
    side: SideFactory | None = None  # its host side, if it needs one


GUARDS: tuple[GuardEntry, ...] = (
    GuardEntry(
        "peermem", peermem.PeermemPolicy(), peermem.parse_policy, peermem.PeermemGate, PeermemHold
    ),
    GuardEntry("storage", storage.StoragePolicy(), storage.parse_policy, storage.StorageGuard),
    GuardEntry("sriov", sriov.SriovPolicy(), sriov.parse_policy, sriov.SriovGuard, SriovSide),
)


def entry(name: str, guards: tuple[GuardEntry, ...] = GUARDS) -> GuardEntry:
    for e in guards:
        if e.name == name:
            return e
    raise KeyError(name)


def build_guards(
    policies: Mapping[str, Any], paths: HostPaths, guards: tuple[GuardEntry, ...] = GUARDS
) -> list[Guard[Any]]:
    """Every guard, each with its configured policy (else its default)."""
    return [e.build(policies.get(e.name, e.default_policy), paths) for e in guards]


def build_reconciler(
    policies: Mapping[str, Any], paths: HostPaths, guards: tuple[GuardEntry, ...] = GUARDS
) -> Reconciler:
    return Reconciler(build_guards(policies, paths, guards))
