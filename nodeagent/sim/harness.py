"""The real agent inside the simulator: its own ``run`` loop in a thread.

The agent is the real one, built by ``nodeagent.loop.wiring.build_agent`` and
unchanged in what it does: the same loop, the same observer reading the temp
host root, real inotify on it, enforce mode. What the simulator gives it, as
one ``HostPorts`` and one ``LoopHooks``:

- ``SimKernel`` as its module operations and kernel-log reader;
- the simulated kernel's uevent pipe and a *fence* pipe as extra wake sources;
- the virtual clock (seed-time) as its clock.

Determinism: virtual time only moves when the scheduler pops an event, and
after every step the scheduler calls ``settle``, which pokes the fence when the
step changed the node and waits until every poke and uevent has been drained
and the pass after the drain has finished, every plan it submitted has run
(``stepped_plans``: right after the pass, still holding the world lock) and a
later pass has absorbed the outcomes (or the agent is blocked inside a
simulated module operation that takes virtual time). In a mode with the hold,
the agent's shipped responder and container scanner run against the simulated
kernel's fanotify contract (``sim/fanotify.py``), stepped here rather than in
threads: the responder takes its events and wake-ups in every settle (and at
each held open's budget), the scanner scans one ``hold_scan_seconds`` after
each process starts (a scan between finds nothing new), and what either
reports is recorded by a pass the settle waits for. Each pass holds the
scheduler's ``world`` lock, so a pass started by a late inotify event never
sees half a step: it sees a state the deterministic pass saw, decides the same,
and adds nothing to the record. A guard's ``wake_at`` becomes a scheduler event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.guards.peermem.heldfiles import read_held_path
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.side import PeermemHold
from nodeagent.guards.peermem.start import HoldHost
from nodeagent.guards.registry import build_reconciler
from nodeagent.host.ports import HostPorts
from nodeagent.loop.passes import PassResult
from nodeagent.loop.wiring import LoopHooks, build_agent
from nodeagent.sim.clock import SimError
from nodeagent.sim.kernel import WakePipe
from nodeagent.sim.netlink import SimSriovOps
from nodeagent.sim.node import Node

__all__ = ["AgentHarness", "SimAgent", "agent_guards"]

SETTLE_TIMEOUT_S = 30.0


def agent_config(node: Node) -> Config:
    # uevents=False: the host's real netlink uevents say nothing about the temp root;
    # the simulated kernel's uevents come in as a wake source instead. [peermem] mofed
    # is what deploy/README.md tells the operator to set in the node's mode.
    return Config(
        host_root=str(node.root),
        mode="enforce",
        uevents=False,
        policies={
            "peermem": PeermemPolicy(
                mofed=node.mode.agent_mofed, hold_loads="fanotify" if node.mode.hold else "off"
            )
        },
    )


def agent_guards() -> tuple[str, ...]:
    """The guards the agent runs today (a scenario needing another one is labelled)."""
    return tuple(build_reconciler({}, Config().paths).guards)


class SimAgent:
    """The real ``Agent``, embedded: passes hold the world lock, timers become events.

    Uses only the agent's embedding hooks (``pass_context``, ``on_pass``,
    ``on_record``); the loop, observation, guards and actions are untouched.
    """

    def __init__(self, cfg: Config, node: Node, fence: WakePipe, on_pass: Any) -> None:
        self.sim_records: list[dict[str, Any]] = []
        self.sim_errors: list[str] = []  # passes that raised
        self._node = node
        self._fence = fence
        self._notify = on_pass
        self._timers: set[float] = set()
        self._pass_t = node.sched.now()
        k = node.kernel
        hold_host = HoldHost(
            group=k.fanotify_group,
            proc=str(k.proc_dir),
            host_pids=lambda: True,
            path_of=k.event_path,
            # Its events carry no descriptor: the held file is read by its path (the host's).
            facts_of=lambda event, path: read_held_path(str(k.root / path.lstrip("/")), path),
            dev_of=k.superblock_at,
            may_load=lambda pid: None,  # the seeds' driver containers are privileged
            opener_may_load=lambda pid: None,  # and so are their module loaders
            threaded=False,
            clock=node.sched.now,
        )
        # The node as the simulator's kernel gives it: one bundle of host ports.
        ports = HostPorts(
            module_ops=node.kernel,
            kernel_log=node.kernel.kernel_messages,
            guard_ports={"sriov": SimSriovOps(node.kernel), "peermem": hold_host},
            wake_sources=[node.kernel.uevent_source, fence],
        )
        hooks = LoopHooks(
            clock=node.sched.now,
            pass_context=self._world,
            on_pass=self._pass_done,
            on_record=self._record,
            stepped_plans=True,  # plans run in virtual time, right after their pass
        )
        self.agent = build_agent(cfg, ports, hooks)

    @contextmanager
    def _world(self) -> Iterator[None]:
        world = self._node.sched.world
        world.acquire()
        try:
            self._pass_t = self._node.sched.now()
            yield
        finally:
            world.release()
            self._notify()

    def _record(self, rec: dict[str, Any]) -> None:
        # A decision is about the snapshot its pass took; an action ends when it ends.
        t = self._pass_t if rec.get("kind") == "decision" else self._node.sched.now()
        self.sim_records.append({**rec, "ts": round(t, 3)})

    def _pass_done(self, result: PassResult | None, exc: Exception | None) -> None:
        if exc is not None:  # the loop survives it; the simulation must not hide it
            self.sim_errors.append(f"{type(exc).__name__}: {exc}")
            return
        assert result is not None
        if result.wake_at is not None and result.wake_at not in self._timers:
            self._timers.add(result.wake_at)
            self._node.sched.call_at(
                result.wake_at, lambda: self._fence.push("guard timer"), late=True
            )

    # The harness drives the agent through these.
    @property
    def peermem_hold(self) -> PeermemHold:
        """The peermem guard's host side: the fanotify hold (started or not)."""
        side = self.agent.side("peermem")
        assert isinstance(side, PeermemHold)
        return side

    @property
    def passes(self) -> int:
        return self.agent.passes

    def wait_for_passes(self, count: int, timeout: float) -> bool:
        return self.agent.wait_for_passes(count, timeout)

    def run(self) -> None:
        self.agent.run()

    def stop(self) -> None:
        self.agent.stop()


class AgentHarness:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.fence = WakePipe()
        self._cv = threading.Condition()
        self._target = 0
        self.agent = SimAgent(agent_config(node), node, self.fence, self._notify)
        for src in (self.fence, node.kernel.uevent_source):
            src.on_drain = self._drained
        self._seen = node.world_version()
        self.thread = threading.Thread(target=self.agent.run, name="nodeagent", daemon=True)
        self._budget_due: set[float] = set()
        node.kernel.proc_hooks.append(self._process_started)

    def _drained(self, n: int) -> None:
        if n == 0:  # an empty drain (the loop's lease heartbeat) is followed by no pass
            return
        with self._cv:
            self._target = self.agent.passes + 1  # the pass that follows this drain
            self._cv.notify_all()

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def start(self) -> None:
        self.thread.start()
        if not self.agent.wait_for_passes(1, SETTLE_TIMEOUT_S):
            raise SimError("the agent did not finish its first pass")
        self._wire()
        self._seen = self.node.world_version()

    def _wire(self) -> None:
        """What the stepped responder and scanner report wakes the agent through the fence.
        The side built them to call its ``ctx.wake``: the agent's own poke, outside what
        ``settle`` counts (the pass it makes may come before or after the next step), and
        poked from this thread while the agent's may be draining it. Through the fence the
        pass it makes is waited for; the reasons the agent records are the side's."""
        side = self.agent.peermem_hold
        hold, scanner = side.hold, side.containers
        if isinstance(hold, Responder):
            hold.on_report = lambda: self.fence.push("held open ended")
        if scanner is not None:
            scanner.on_report = lambda: self.fence.push("container root")

    def _process_started(self, _proc: object) -> None:
        scanner = self.agent.peermem_hold.containers
        if scanner is not None:  # the next poll after the start is the one that sees it
            self.node.sched.call_later(scanner.interval_s, self._scan)

    def _scan(self) -> None:
        scanner = self.agent.peermem_hold.containers
        if scanner is None:
            return
        self._wire()
        scanner.scan()  # what it reports pushes the fence (_wire)

    def _step_hold(self) -> bool:
        """The responder's round: events read and answered, held opens let go; whether it
        did anything."""
        hold = self.agent.peermem_hold.hold
        if hold is None:
            return False
        assert isinstance(hold, Responder)  # stepped in this process, never apart
        self._wire()
        before, unread = hold.reported, self._hold_unread()
        hold.step()  # what it reports (ended opens, a new held file) pushes the fence (_wire)
        now = self.node.sched.now()
        for _pid, _opener, _path, held_s in hold.held():
            due = round(now - held_s + hold.budget_s, 6)
            if due not in self._budget_due:  # wake the responder when that budget ends
                self._budget_due.add(due)
                self.node.sched.call_at(due, lambda: None)
        return bool(unread) or hold.reported != before

    def _hold_unread(self) -> int:
        return sum(g.unread for g in self.node.kernel.fanotify_groups)

    def _quiet(self) -> bool:
        if self.agent.sim_errors:
            raise SimError(f"an agent pass failed: {self.agent.sim_errors[0]}")
        if self.node.sched.foreign_blocked:
            return True  # mid-pass, inside a module operation that takes virtual time
        return (
            self.fence.pending == 0
            and self.node.kernel.uevent_source.pending == 0
            and self.agent.passes >= self._target
            # every plan run and its outcome absorbed by a later pass
            and not self.agent.agent.workers.busy()
        )

    def settle(self) -> None:
        if self.node.world_version() != self._seen:
            self.fence.push("simulation step")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        with self._cv:
            while True:
                if self._quiet():
                    # The responder answers between whole passes only (never while the agent
                    # is inside a module operation), so when it answers is deterministic.
                    if self.node.sched.foreign_blocked or not self._step_hold():
                        break
                    continue
                if time.monotonic() > deadline or not self.thread.is_alive():
                    raise SimError(
                        "the agent did not settle (thread dead or stuck): "
                        f"fence {self.fence.pending} uevents "
                        f"{self.node.kernel.uevent_source.pending} passes "
                        f"{self.agent.passes}/{self._target} busy "
                        f"{self.agent.agent.workers.busy()}"
                    )
                self._cv.wait(0.002)
        self._seen = self.node.world_version()

    def stop(self) -> None:
        self.agent.stop()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the agent's loop to end, then close the pipes it woke on."""
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.fence.close()
