"""The loaded-module graph from /sys/module/*/holders: who holds whom, what goes first.

A module can only be removed once nothing holds it, so a chain comes out
holders-first ("top-down"). ``modprobe -r`` leaves shared lower layers behind
(seen on a real 6.1 kernel: ib_cm, iw_cm, ib_core), so the agent computes the
whole order itself from the holders graph and removes each module by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nodeagent.core.snapshot import LoadedModule


class RemovalBlocked(ValueError):
    """A module to remove is held by one that is not being removed."""


def holders_closure(modules: Mapping[str, LoadedModule], roots: Iterable[str]) -> set[str]:
    """``roots`` (those loaded) and every loaded module that holds any of them, transitively."""
    out: set[str] = set()
    stack = [r for r in roots if r in modules]
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.add(name)
        stack.extend(h for h in modules[name].holders if h in modules and h not in out)
    return out


def removal_order(modules: Mapping[str, LoadedModule], targets: Iterable[str]) -> list[str]:
    """Order to remove ``targets`` so each goes only after all its holders.

    Raises RemovalBlocked, naming the module and its outside holder, when a
    target is held by a module that is not itself a target. A module with more
    references (refcnt) than module holders goes as late as its holders allow.
    Ties are broken by name so the order is deterministic.
    """
    todo = {t for t in targets if t in modules}
    for name in sorted(todo):
        outside = sorted(h for h in modules[name].holders if h not in todo)
        if outside:
            raise RemovalBlocked(f"{name} is held by {', '.join(outside)} (not being removed)")
    order: list[str] = []
    remaining = set(todo)
    while remaining:
        free = sorted(n for n in remaining if not any(h in remaining for h in modules[n].holders))
        if not free:  # a holders cycle cannot happen in a real kernel; refuse rather than guess
            raise RemovalBlocked(f"holders cycle among {', '.join(sorted(remaining))}")
        # More references than module holders: also used from elsewhere, e.g. a crypto
        # driver a library in the chain took a handle on (seen on 6.1: crc64_rocksoft_generic,
        # refcnt 1, no holders, let go only when crc64_rocksoft goes). Take those last.
        plain = [n for n in free if not _extra_refs(modules[n])]
        batch = plain or free
        order.extend(batch)
        remaining.difference_update(batch)
    return order


def _extra_refs(mod: LoadedModule) -> bool:
    return mod.refcnt is not None and mod.refcnt > len(mod.holders)


def pulled_in(
    before: Iterable[str], after: Mapping[str, LoadedModule], roots: Iterable[str]
) -> set[str]:
    """What loading ``roots`` brought in: modules loaded now that were not loaded before."""
    return set(after) - set(before) | {r for r in roots if r in after}
