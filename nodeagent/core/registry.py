"""The one list of guards. Adding a guard: its own module, and one entry in ``GUARDS``.

Each entry says how to parse the guard's ``[<name>]`` config table into its
policy and how to build the guard from that policy and the host paths. The
guard itself declares what it needs observed (``needs()``) and whether it
publishes a gate file (``gate``). See docs/design.md, "Adding a guard".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.core import peermem, sriov, storage
from nodeagent.core.guard import Guard
from nodeagent.core.paths import HostPaths
from nodeagent.core.reconcile import Reconciler


@dataclass(frozen=True)
class GuardEntry:
    name: str
    default_policy: Any
    # ([name] table, the policy so far) -> policy; NodeagentError naming a bad value
    parse_policy: Callable[[Mapping[str, Any], Any], Any]
    build: Callable[[Any, HostPaths], Guard[Any]]


GUARDS: tuple[GuardEntry, ...] = (
    GuardEntry("peermem", peermem.PeermemPolicy(), peermem.parse_policy, peermem.PeermemGate),
    GuardEntry("storage", storage.StoragePolicy(), storage.parse_policy, storage.StorageGuard),
    GuardEntry("sriov", sriov.SriovPolicy(), sriov.parse_policy, sriov.SriovGuard),
)


def entry(name: str) -> GuardEntry:
    for e in GUARDS:
        if e.name == name:
            return e
    raise KeyError(name)


def build_guards(policies: Mapping[str, Any], paths: HostPaths) -> list[Guard[Any]]:
    """Every guard, each with its configured policy (else its default)."""
    return [e.build(policies.get(e.name, e.default_policy), paths) for e in GUARDS]


def build_reconciler(policies: Mapping[str, Any], paths: HostPaths) -> Reconciler:
    return Reconciler(build_guards(policies, paths))
