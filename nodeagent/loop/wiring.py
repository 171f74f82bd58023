"""The one composition root: everything the agent is made of, built from the config,
the guard list and one bundle of host ports.

The daemon (``nodeagent run``), the simulator and ``nodeagent check`` all
build here; each replaces what it must through ``HostPorts`` (how the node is
reached) and ``LoopHooks`` (how an embedder steps and watches the loop), never
one keyword per collaborator. Collaborators are tied one way: the pass
(``passes.py``) uses the records, the gates, the workers and the guards' host
sides; the run loop (``agent.py``) uses the pass. ``check`` loads only what it
uses: the acting half is imported inside ``build_agent``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from nodeagent.config import Config
from nodeagent.core.reconcile import AgentMemory, Reconciliation
from nodeagent.core.snapshot import NodeSnapshot
from nodeagent.guards.registry import GUARDS, GuardEntry, build_reconciler
from nodeagent.guards.side import GuardSide, SideContext
from nodeagent.host.fs import HostRoot
from nodeagent.host.observe import Observer, Readers
from nodeagent.host.ports import HostPorts
from nodeagent.host.state import StateStore

if TYPE_CHECKING:
    from nodeagent.loop.agent import Agent
    from nodeagent.loop.exporters import Exporters
    from nodeagent.loop.passes import PassResult


@dataclass(frozen=True)
class LoopHooks:
    """For embedding; the daemon uses none.

    ``clock`` replaces both the schedule and the wall clock (the simulator's
    virtual one); ``pass_context`` wraps every pass (the simulator holds its
    world lock in it); ``on_pass`` runs at the end of every pass, inside that
    context, with the result or the exception; ``on_record`` sees every
    timeline record; ``stepped_plans``: plans run right after the pass that
    submitted them, inside its ``pass_context``, instead of in worker threads
    (the simulator, whose virtual clock must order every step).
    """

    clock: Callable[[], float] | None = None
    pass_context: Callable[[], AbstractContextManager[object]] | None = None
    on_pass: Callable[[PassResult | None, Exception | None], None] | None = None
    on_record: Callable[[dict[str, Any]], None] | None = None
    stepped_plans: bool = False


NO_PORTS = HostPorts()  # the running node's own, every one
NO_HOOKS = LoopHooks()  # the daemon's: no embedder


class SteadyClock:
    """Wall time as it was at start, advanced by the monotonic clock: what the agent
    schedules by. A step of the wall clock (NTP, an operator) moves no deadline; what is
    persisted stays comparable with wall time across restarts (guards clamp a saved
    deadline further ahead than its own length)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._anchor = wall() - monotonic()

    def __call__(self) -> float:
        return self._anchor + self._monotonic()


def _ignore(*_args: Any) -> None:
    return None


def build_sides(
    cfg: Config,
    host: HostRoot,
    ports: HostPorts,
    guards: tuple[GuardEntry, ...],
    *,
    clock: Callable[[], float],
    record: Callable[[dict[str, Any]], None] = _ignore,
    wake: Callable[[str], None] = _ignore,
    failed: Callable[[str, Exception, bool], None] = _ignore,
    read_only: bool = False,
) -> dict[str, GuardSide]:
    """The host side of every guard whose entry names one, by guard name."""
    sides: dict[str, GuardSide] = {}
    for e in guards:
        if e.side is None:
            continue
        ctx = SideContext(
            name=e.name,
            policy=cfg.policies.get(e.name, e.default_policy),
            paths=cfg.paths,
            enforce=cfg.mode == "enforce",
            host=host,
            ports=ports,
            port=ports.guard_ports.get(e.name),
            clock=clock,
            record=record,
            wake=wake,
            failed=failed,
            read_only=read_only,
        )
        sides[e.name] = e.side(ctx)
    return sides


def observer_readers(readers: Readers | None, sides: Mapping[str, GuardSide]) -> Readers:
    """The embedder's readers; a side's reader where the embedder left the default."""
    readers = readers or Readers()
    default = Readers()
    for side in sides.values():
        for field, read in side.readers().items():
            if getattr(readers, field) is getattr(default, field):
                readers = replace(readers, **{field: read})
    return readers


def check_node(
    cfg: Config, ports: HostPorts = NO_PORTS, guards: tuple[GuardEntry, ...] = GUARDS
) -> tuple[NodeSnapshot, Reconciliation, list[str]]:
    """One read-only look, as the daemon would judge it (``nodeagent check``): the
    snapshot, the decision and the problems met reading the daemon's memory."""
    host = HostRoot(cfg.host_root)
    reconciler = build_reconciler(cfg.policies, cfg.paths, guards)
    sides = build_sides(cfg, host, ports, guards, clock=time.time, read_only=True)
    # Read-only use of the daemon's memory, so a stale flag is judged as the daemon would.
    memory, problems = StateStore(host, cfg.paths.state_dir).load_memory(reconciler, read_only=True)
    observer = Observer(host, cfg, reconciler.needs(), observer_readers(ports.readers, sides))
    try:
        snap = observer.observe(time.time())
    finally:
        observer.close()
        for side in sides.values():
            side.close()
    return snap, reconciler.decide(snap, memory), problems


def build_agent(
    cfg: Config,
    ports: HostPorts = NO_PORTS,
    hooks: LoopHooks = NO_HOOKS,
    guards: tuple[GuardEntry, ...] = GUARDS,
    exporters: Exporters | None = None,
) -> Agent:
    """``exporters``: the daemon's (``loop/exporters.py``, all it configures); by default
    those an embedded agent keeps (NFD labels, NPD's files), never a socket or a port."""
    # The acting half, imported here: ``check`` never loads libkmod, tenacity or the loop.
    from nodeagent.host.act import EXECUTORS, Actuator, kmsg_reader
    from nodeagent.host.events import Poke
    from nodeagent.host.gatefile import GateFiles
    from nodeagent.host.kmod import default_module_ops
    from nodeagent.loop.agent import Agent
    from nodeagent.loop.exporters import build_exporters
    from nodeagent.loop.gates import Freshness, Gates
    from nodeagent.loop.passes import Passes
    from nodeagent.loop.records import Bookkeeping
    from nodeagent.loop.workers import PlanWorkers
    from nodeagent.timeline import Timeline

    host = HostRoot(cfg.host_root)
    # Schedules (deadlines, backoffs, the resync) run on a clock a wall-clock step cannot
    # move: wall time at start, advanced by the monotonic clock. Records carry wall time.
    # An embedder's clock (the simulator's virtual one) serves as both.
    clock: Callable[[], float] = hooks.clock or SteadyClock()
    wall: Callable[[], float] = hooks.clock or time.time
    reconciler = build_reconciler(cfg.policies, cfg.paths, guards)
    poke, plans_ended = Poke(), Poke()
    if exporters is None:
        exporters = build_exporters(cfg, daemon=False, guards=guards, wall=wall)
    books = Bookkeeping(
        timeline=Timeline(host, cfg.paths.timeline_dir, cfg.timeline_max_bytes, cfg.timeline_keep),
        state=StateStore(host, cfg.paths.state_dir, wall),
        reconciler=reconciler,
        wall=wall,
        on_record=hooks.on_record,
        record_hooks=[exporters.on_record],
    )
    sides = build_sides(
        cfg,
        host,
        ports,
        guards,
        clock=clock,
        record=books.record,
        wake=plans_ended.poke,
        failed=lambda what, exc, vouch: books.failed(what, exc, vouch=vouch),
    )
    observer = Observer(host, cfg, reconciler.needs(), observer_readers(ports.readers, sides))
    actuator = Actuator(
        host,
        ports.module_ops or default_module_ops(),
        ports.kernel_log or kmsg_reader(cfg.kmsg),
        executors=(*EXECUTORS, *(x for s in sides.values() for x in s.executors())),
        verified_fd=observer.verified_fd,  # load the very file the gate checked
        clock=clock,
        # A load by name is checked first (CRCs) on an observer of its own: the workers'
        # threads never share the loop's caches.
        chain_facts=Observer(host, cfg).chain_facts,
    )
    workers = PlanWorkers(
        reconciler.guards,
        actuator.perform,
        step_timeout_s=lambda _a: cfg.step_timeout_seconds,
        on_done=lambda g: plans_ended.poke(f"plan of {g} ended"),
        threaded=not hooks.stepped_plans,
    )

    def sides_close(guard: str) -> None:
        """Protective first: a gate's side (the hold) closes before its file goes."""
        side = sides.get(guard)
        if side is not None:
            side.gate_closing()

    fresh = Freshness(poke, observer.markers_unchanged)  # the run loop fills its watched
    gates = Gates(
        GateFiles(host, cfg.paths.state_dir, before_withdraw=sides_close),
        reconciler.gates,
        clock=clock,
        fresh=fresh,
        record=books.record,
    )
    memory: AgentMemory = books.load_memory()
    pass_context = hooks.pass_context or nullcontext
    passes = Passes(
        enforce=cfg.mode == "enforce",
        mode=cfg.mode,
        resync_seconds=cfg.resync_seconds,
        clock=clock,
        wall=wall,
        reconciler=reconciler,
        observer=observer,
        workers=workers,
        books=books,
        gates=gates,
        sides=sides,
        exporters=exporters,
        memory=memory,
        pass_context=pass_context,
        on_pass=hooks.on_pass,
    )
    return Agent(
        cfg,
        passes,
        host=host,
        poke=poke,
        plans_ended=plans_ended,
        wake_sources=ports.wake_sources,
        watched=fresh.watched,
    )
