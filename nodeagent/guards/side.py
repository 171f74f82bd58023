"""A guard's host side: what the loop runs for a guard besides its pure decision.

A guard decides in ``core/<name>.py`` and never touches the node. Most need
nothing more: the observer reads what they declare (``needs()``), the shared
executors carry out module and file actions, and the loop publishes their
gate. A guard that needs more from the node brings it here, through one
``GuardSide`` named in its registry entry (``guards/registry.py``):

- ``readers()``: facts the observer cannot read by itself (SR-IOV over
  netlink), by ``Readers`` field; ``writes()``: where it writes files;
- ``executors()``: actions of its own kinds (a VF restore);
- ``start()`` before the first pass, ``stop()`` before the stop actions,
  ``close()`` last;
- ``protect(verdict)``: the protective step of every pass, right before the
  closed gates' files are withdrawn (``loop/passes.py``, rule 3);
- ``gate_closing()``: right before its gate's file is withdrawn, on any path
  (a stale or failed publish, a beat that no longer vouches, rule 3);
- ``after_memory(memory)``: bookkeeping that follows the saved memory (a
  snapshot file), before the status is written (rule 7);
- ``after_publish(verdict, published, vouches)``: what follows the gate, right
  after the gates are published and before the other plans start (rule 5);
- ``beat(published, vouches)``: the loop's heartbeat between passes (every
  ``RENEW_S`` while a gate's lease or a side ``needs_beat()``), right after the
  gates' leases are renewed: a side that keeps a lease of its own in step with
  its gate (the hold's responder apart) renews it here, and a stuck loop renews
  nothing;
- ``drain_seconds()``, ``draining()``: at SIGTERM, how long the agent keeps
  running so that what the side holds is not let go with its gate closed,
  and whether it still does (the agent stops as soon as no side does);
- ``status()``: its part of ``status.json`` under ``status_key``;
- ``problems()``: what is wrong with it now, said in every pass's status (e.g. a
  hold configured and not holding); never held against a gate;
- ``telemetry``: its record-fed metric families (a class attribute: the
  exporter registers them at start, whether the side starts anything or not).

The loop calls every hook of every side the same way and names no guard.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodeagent.core.guard import Verdict
from nodeagent.core.paths import HostPaths
from nodeagent.core.reconcile import AgentMemory
from nodeagent.core.telemetry import RecordTelemetry
from nodeagent.host.fs import HostRoot
from nodeagent.host.ports import HostPorts

if TYPE_CHECKING:
    from nodeagent.host.act import Executor, NodeHands


@dataclass(frozen=True)
class SideContext:
    """What the loop lends a guard's host side."""

    name: str  # the guard's
    policy: Any  # its configured policy
    paths: HostPaths
    enforce: bool  # the agent acts (else it only observes)
    host: HostRoot
    ports: HostPorts
    port: Any  # its own port from the ports' guard_ports (its wing types it), else None
    clock: Callable[[], float]  # the loop's schedule clock
    record: Callable[[dict[str, Any]], None]  # a timeline record
    wake: Callable[[str], None]  # wake the loop (a pipe write: safe from any thread)
    # A bookkeeping failure of this pass: (what, the exception, may the pass still vouch).
    failed: Callable[[str, Exception, bool], None]
    read_only: bool = False  # ``nodeagent check``: read, never write or move a file


class GuardSide:
    """The defaults do nothing: a side overrides only what its guard needs."""

    status_key: str | None = None  # its part of status.json, if any
    telemetry: tuple[RecordTelemetry, ...] = ()  # record-fed metric families (metrics.py)

    def __init__(self, ctx: SideContext) -> None:
        self.ctx = ctx

    def readers(self) -> Mapping[str, Callable[[], Any]]:
        return {}

    def writes(self) -> Mapping[str, Collection[str] | None]:
        """Where it writes files atomically: directory -> its own file names there (None:
        every file there is its own). What a killed write left (``write_atomic``'s temp
        files) is removed at start, with the agent's own."""
        return {}

    def executors(self) -> Sequence[Callable[[NodeHands], Executor]]:
        return ()

    def start(self) -> None:
        """Before the first pass of ``run``."""

    def protect(self, verdict: Verdict) -> None:
        """The protective step: right before closed gates' files are withdrawn (rule 3)."""

    def after_memory(self, memory: AgentMemory) -> None:
        """After the pass's memory is saved, before its status."""

    def after_publish(self, verdict: Verdict, published: bool, vouches: Callable[[], bool]) -> None:
        """Last in the pass: ``published``, this guard's gate file was written open now;
        ``vouches()``, the pass's bookkeeping held and nothing changed since it observed."""

    def needs_beat(self) -> bool:
        """Does it keep a lease the loop must renew between passes?"""
        return False

    def beat(self, published: bool, vouches: Callable[[], bool]) -> None:
        """Between passes, after the gates' leases: ``published``, this guard's gate file
        is still open; ``vouches()``, the last pass's decision still stands."""

    def drain_seconds(self) -> float:
        """Asked at SIGTERM: how long the agent should keep running before it stops, so
        that what this side holds is not let go with its gate closed (0: stop now)."""
        return 0.0

    def draining(self) -> bool:
        """While the agent drains: does this side still hold something it must not let go?"""
        return False

    def gate_closing(self) -> None:
        """Its guard's gate file is about to be withdrawn (whatever the reason): close what
        follows the gate now, before the file goes."""

    def problems(self) -> Sequence[str]:
        return ()

    def status(self) -> Any:
        return None

    def stop(self) -> None:
        """At stop, before the guards' stop actions run."""

    def close(self) -> None:
        """Last at stop: release what the side holds (sockets)."""


# How an entry makes its side (the class); None in the entry: the guard needs no host side.
SideFactory = type[GuardSide]
