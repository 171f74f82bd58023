"""Fakes of the hold's kernel side, shared by this folder's files: event sources the test
feeds, a clock it moves, a group whose queue overflows, and the agent built on one."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.guards.peermem.budget import Caps
from nodeagent.guards.peermem.openers import Openers
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.start import HoldHost
from nodeagent.host.fanotify import PermEvent


class FakeSource:
    """An EventSource fed by the test (the interface the simulator will use)."""

    def __init__(self, events: list[PermEvent]) -> None:
        self.r, self.w = os.pipe()
        self.events = events
        self.answers: list[tuple[PermEvent, bool]] = []
        os.write(self.w, b"x")

    def fileno(self) -> int:
        return self.r

    def read(self) -> list[PermEvent]:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 16)
        out, self.events = self.events, []
        return out

    def respond(self, event: PermEvent, allow: bool) -> None:
        self.answers.append((event, allow))

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Clock:
    """A clock the test moves (the responder's bursts end after a quiet spell)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FedSource(FakeSource):
    """A FakeSource the test feeds while the responder runs (its pipe never blocks a read)."""

    def __init__(self, events: list[PermEvent]) -> None:
        super().__init__(events)
        os.set_blocking(self.r, False)

    def feed(self, *events: PermEvent) -> None:
        self.events.extend(events)
        os.write(self.w, b"x")


class OverflowingGroup(FedSource):
    """A hold group (the agent's seam, ``HoldHost.group``) whose kernel refused the
    unlimited queue and whose queue overflows."""

    unlimited_queue = False
    queue_problem = "peermem.hold_loads: the kernel refused FAN_UNLIMITED_QUEUE (test)"

    def mark_filesystem(self, path: str) -> None:
        pass

    def open_root(self, path: str) -> None:
        return None

    def marked_devices(self) -> set[int]:
        return set()


class Opens(FedSource):
    """Held-class opens by loaders (the fds are made up: nothing is closed here)."""

    def __init__(self) -> None:
        super().__init__([])
        self.n = 10_000

    def opens(self, pid: int, k: int) -> list[PermEvent]:
        out = []
        for _ in range(k):
            self.n += 1
            out.append(PermEvent(self.n, pid, 0x10000))
        return out


def capped(
    source: FedSource, clock: Clock, gate: threading.Event, proc: Path, caps: Caps
) -> Responder:
    for pid in (100, 101, 300):  # every opener "exists": none is let go as gone
        (proc / str(pid)).mkdir(exist_ok=True)
    return Responder(
        source,
        gate_open=gate.is_set,
        budget_s=600,
        openers=Openers(
            proc=str(proc),
            path_of=lambda e: "/lib/modules/6.1.0/kernel/drivers/video/nvidia-peermem.ko",
            own_pid=1,
            loader_of=lambda pid: (True, "modprobe"),
            container_of=lambda pid: "mnt:[A]" if pid < 200 else "mnt:[B]",
        ),
        caps=caps,
        clock=clock,
    )


def hold_config(tmp_path: Path, roots: tuple[str, ...] = ("run/nvidia/driver",)) -> Config:
    """Enforce mode, the hold on over ``roots`` (made here), no container rule."""
    for d in roots:
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    pol = PeermemPolicy(hold_loads="fanotify", hold_roots=roots, hold_containers=())
    return Config(host_root=str(tmp_path), mode="enforce", uevents=False, policies={"peermem": pol})


def fake_hold_agent(
    cfg: Config,
    node: Any,
    group: OverflowingGroup | None = None,
    recorded: list[dict[str, Any]] | None = None,
) -> Any:
    """The agent with its hold on a fake group (a responder thread of its own)."""
    host = HoldHost(group=lambda: group or OverflowingGroup([]), host_pids=lambda: True)
    on_record = recorded.append if recorded is not None else None
    return Agent(
        cfg,
        module_ops=node.kernel,
        kernel_log=lambda m: [],
        guard_ports={"peermem": host},
        on_record=on_record,
    )
