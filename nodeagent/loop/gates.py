"""The gates' files as the loop keeps them: published, renewed, withdrawn (loudly).

The file format and its lease are ``host/gatefile.py``. Here is what the loop
does with them: publish the open gates of a pass that vouches for them,
renew their leases between passes while that decision still stands, and
withdraw a gate's file the moment it may no longer read open. A file that
cannot be withdrawn is said loudly (stderr, the journal, a metric, /readyz)
and retried on every heartbeat; readers see it closed anyway when its lease
runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.host.events import Poke, WakeSource, pending
from nodeagent.host.gatefile import LEASE_S, GateFiles

log = logging.getLogger("nodeagent")


def any_pending(sources: Sequence[WakeSource], poke: Poke) -> bool:
    """Did anything that wakes the loop arrive since the last pass drained its sources?
    (Before ``run`` has its sources, only the poke can.)"""
    try:
        return pending(sources or [poke])
    except (OSError, ValueError):  # a source closed under us: assume the worst
        return True


class Freshness:
    """The freshness rule (``passes.py``, rule 5): a decision taken from a snapshot still
    stands while no event that wakes the loop is pending (its sources, or a poke) and the
    markers read as they were. The run loop puts its sources in ``watched`` when it
    starts; before that, only the poke and the markers count."""

    def __init__(self, poke: Poke, markers_unchanged: Callable[[NodeSnapshot], bool]) -> None:
        self.poke = poke
        self.markers_unchanged = markers_unchanged
        self.watched: list[WakeSource] = []

    def __call__(self, snap: NodeSnapshot) -> bool:
        return not any_pending(self.watched, self.poke) and self.markers_unchanged(snap)


class Gates:
    def __init__(
        self,
        files: GateFiles,
        gates: Sequence[str],
        *,
        clock: Callable[[], float],
        fresh: Callable[[NodeSnapshot], bool],
        record: Callable[[dict[str, Any]], None],
    ) -> None:
        """``gates``: the guards that publish one; ``fresh(snap)``: does a decision taken
        from ``snap`` still stand (no event since, markers as seen)."""
        self.files = files
        self.gates = list(gates)
        self.clock = clock
        self.fresh = fresh
        self.record = record
        # The gates the last pass published, renewed until a pass decides again.
        self.published: list[str] = []
        self.published_snap: NodeSnapshot | None = None
        self.stuck: dict[str, str] = {}  # gate -> why its file could not be withdrawn

    def still_fresh(self) -> bool:
        snap = self.published_snap
        return snap is not None and self.fresh(snap)

    def publish(
        self, gates: Sequence[str], still_fresh: Callable[[], bool] | None = None
    ) -> list[str]:
        """Write open gates' leases; the ones published. One not published (gone stale while
        written, or the write failed) was withdrawn by ``publish``; withdrawn once more here
        so a file that cannot go is tracked and said loudly."""
        fresh = still_fresh or self.still_fresh
        published, problems = self.files.publish(dict.fromkeys(gates, True), self.clock(), fresh)
        for p in problems:
            log.error(p)
        if len(published) < len(gates):
            self.withdraw([g for g in gates if g not in published])
        return published

    def settle(
        self,
        snap: NodeSnapshot,
        open_gates: Sequence[str],
        vouches: bool,
        fresh: Callable[[], bool],
    ) -> list[str]:
        """Publish ``open_gates`` if the pass vouches and is still fresh, else withdraw every
        gate. What was published is what the loop renews. Freshness is asked once per gate,
        between its file's fsync and its rename (a stale one is withdrawn there), not also
        before: each ask is a round of polls and stats on the way to a held load."""
        published: list[str] = []
        if not vouches or (not open_gates and not fresh()):
            self.withdraw(self.gates)
        elif open_gates:
            published = self.publish(open_gates, fresh)
        self.published, self.published_snap = published, snap
        return published

    def renew(self, vouches: bool) -> None:
        """The loop's heartbeat between passes: renew the open gates' leases while the last
        decision still stands (no event since its observation, markers unchanged), retry a
        withdrawal that failed. A loop that is stuck renews nothing: the leases run out."""
        if self.stuck:
            self.withdraw([g for g in self.stuck if g not in self.published])
        if not self.published:
            return
        if not vouches:
            self.withdraw(self.gates)
            self.published = []
            return
        # Freshness is asked once, right before each file's rename (``publish``): a stale
        # decision writes nothing and withdraws its gate there.
        self.published = self.publish(self.published)

    def needs_beat(self) -> bool:
        """Is there a lease to renew or a withdrawal to retry between passes?"""
        return bool(self.published or self.stuck)

    def withdraw(self, gates: Iterable[str]) -> list[str]:
        """Remove gates' files; the problems of those that could not go."""
        problems: list[str] = []
        for g in list(gates):
            (p,) = self.files.withdraw([g]) or (None,)
            if g in self.published and p is None:
                self.published = [x for x in self.published if x != g]
            was = self.stuck.get(g)
            if p is None:
                if was is not None:
                    del self.stuck[g]
                    log.warning("gate %s: its file is withdrawn now", g)
                    self.record({"kind": "gate-withdrawal", "gate": g, "ok": True})
                continue
            problems.append(p)
            if was != p:
                self.stuck[g] = p
                log.error("%s; readers see it closed when its lease ends", p)
                self.record(
                    {
                        "kind": "gate-withdrawal",
                        "gate": g,
                        "ok": False,
                        "problem": f"{p}; readers see it closed within {LEASE_S:g}s "
                        "(its lease), and the agent retries every second",
                    }
                )
        return problems
