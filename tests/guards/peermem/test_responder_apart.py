"""The hold's responder apart (issue 38): a stalled, stopped or killed agent stalls no open.

The responder answers in a process of its own (``guards/peermem/process.py``,
``guards/peermem/process_main.py``), the gate reaching it as a lease the loop renews.
On this machine's kernel, with a real fanotify group on a tmpfs:

- the agent's whole process stopped (``SIGSTOP``): opens of other files on the
  marked filesystem keep completing, a module loader's open of
  ``nvidia-peermem.ko`` waits (the gate is closed); the agent killed while
  stopped: the responder holds on (issue 52: the next agent adopts it), the load
  goes on only with the responder's death too (the pod's);
- the loop thread stalled 10 s (a seam: its ``pass_context`` blocks) with the
  gate open: the lease runs out as the gate file's does, a load waits while
  ``nodeagent wait`` would, other opens keep completing; the loop back, the
  load goes on;
- the responder killed: what it held goes on at once (the agent closes its
  copy of the group), the death is recorded, a new responder marks again and
  holds the next load; one that keeps dying is replaced five times in ten
  minutes, then the hold is off, said once, and the agent goes on;
- a new responder slow to answer (a seam: its process waits until the test lets
  it go): passes go on meanwhile (the gate opens and is withdrawn), and a pass
  adopts it once it answers; the agent stopped meanwhile leaves neither its
  process nor a descriptor; new ones that never answer count as restarts.

How long an open takes through the responder apart is ``bench/hold_latency.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.guards.peermem.lease import LEASE, HoldLease, _check, boottime, read_lease
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import LEASE_S, GateFiles
from nodeagent.loop.wiring import LoopHooks
from nodeagent.sim.node import READY
from tests.guards.peermem.apart_agent import build
from tests.guards.peermem.rig import (
    APART_AGENT,
    REPO,
    agent_here,
    alive,
    held_pids,
    hold_status,
    loaders,
    of_kind,
)
from tests.waiting import WAIT, until

# -- the lease, alone -----------------------------------------------------------------


def test_the_lease_reads_open_only_while_whole_current_and_not_too_long() -> None:
    lease = HoldLease()
    try:
        assert read_lease(lease.fd) is False  # closed until written
        lease.write(True)
        assert read_lease(lease.fd) is True
        now = boottime()
        assert read_lease(lease.fd, now=now + LEASE_S + 0.01) is False  # run out
        lease.write(True, lease_s=3600)  # longer than any lease the agent writes
        assert read_lease(lease.fd) is False
        lease.write(False)
        assert read_lease(lease.fd) is False
        until_ = boottime() + 1.0  # a torn write: its check word disagrees
        os.pwrite(lease.fd, LEASE.pack(1, until_, _check(1, until_) ^ 1), 0)
        assert read_lease(lease.fd) is False
        os.pwrite(lease.fd, LEASE.pack(1, until_, _check(1, until_)), 0)
        assert read_lease(lease.fd) is True
        os.ftruncate(lease.fd, 4)  # short
        assert read_lease(lease.fd) is False
    finally:
        lease.close()
    assert read_lease(lease.fd) is False  # a closed descriptor: closed


# -- the layout ------------------------------------------------------------------------


def _status(root: Path) -> dict[str, Any]:
    try:
        got = json.loads((root / "run/nodeagent/status.json").read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _opens_complete(path: Path, n: int) -> None:
    """``n`` opens of files the hold does not name, one after another, each answered by
    the responder: each a new file beside ``path`` (a file opened before is filtered in
    the kernel by its ignore mark, and never reaches the responder)."""
    for _ in range(n):
        fresh = path.with_name(f"{path.name}.{time.monotonic_ns()}")
        fresh.write_bytes(b"other\n")
        p = subprocess.run(["cat", str(fresh)], capture_output=True, timeout=WAIT)
        assert p.returncode == 0, p.stderr


# -- the agent stopped, then killed ----------------------------------------------------


def test_a_stopped_agent_stalls_no_open_and_a_killed_one_leaves_its_responder_holding(
    driver_tree: tuple[Path, Path],
    modprobe: str,
) -> None:
    root, driver = driver_tree
    agent = loader = None
    try:
        agent = subprocess.Popen(
            [sys.executable, "-m", APART_AGENT, str(root)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        status = until(
            lambda: (s := hold_status(root)).get("responder_pid") and s,
            "the agent's hold did not start",
        )
        assert status["marked"] == ["run/nvidia/driver"] and status["gate_open"] is False
        responder = int(status["responder_pid"])
        assert responder != agent.pid and alive(responder)
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        other = driver / "not-a-module"
        other.write_bytes(b"other\n")

        os.kill(agent.pid, signal.SIGSTOP)  # the whole agent: every thread of it
        until(
            lambda: Path(f"/proc/{agent.pid}/stat").read_text().split(") ")[1][0] == "T",
            "the agent did not stop",
        )
        _opens_complete(other, 20)  # answered by the responder apart
        loader = subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE)
        _opens_complete(other, 2)  # two rounds of the responder since the loader's open
        assert loader.poll() is None, "a load went on with the gate closed"
        _opens_complete(other, 5)  # still answering, the load still held
        assert loader.poll() is None

        # Killed while stopped, without a stop (issue 52): the responder holds on for
        # the next agent to adopt it (test_hold_adopt.py), gate closed, still answering;
        # only the pod's death (every process of it) lets the load go.
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(WAIT)
        _opens_complete(other, 5)
        assert loader.poll() is None and alive(responder)
        os.kill(responder, signal.SIGKILL)
        out, _ = loader.communicate(timeout=WAIT)
        assert loader.returncode == 0 and out == ko.read_bytes()
    finally:
        for p in (loader, agent):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(WAIT)


# -- the loop thread stalled, the responder killed: the agent in this process --------------


class _Stall:
    """The seam: while ``on`` is set, the loop blocks where it enters a pass or a beat
    (its ``pass_context``), for at most ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.on = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if self.on.is_set() and threading.current_thread().name == "nodeagent":
            self.entered.set()
            self.release.wait(self.seconds)
        yield


def test_a_stalled_loop_lets_the_lease_run_out_loads_wait_other_opens_go(
    driver_tree: tuple[Path, Path], modprobe: str
) -> None:
    root, driver = driver_tree
    stall = _Stall(seconds=10.0)
    gates = GateFiles(HostRoot(str(root)), "run/nodeagent")
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    with (
        loaders() as procs,
        agent_here(root, LoopHooks(pass_context=stall.context)) as (agent, node),
    ):
        try:
            side = agent.side("peermem")
            (ko,) = driver.rglob("nvidia-peermem.ko*")
            other = driver / "not-a-module"
            other.write_bytes(b"other\n")
            node.write(READY)  # MOFED ready: the gate opens, the hold's lease with it
            until(lambda: gates.read("peermem").is_open, "the gate did not open")
            until(lambda: side.gate_open, "the hold's gate did not open")

            stall.on.set()  # the loop's next beat blocks for up to 10 s
            assert stall.entered.wait(WAIT), "the loop did not reach the seam"
            stalled_at = time.monotonic()
            # Not renewed: the gate file's lease and the responder's run out alike.
            until(lambda: not gates.read("peermem").is_open, "the gate file's lease ran on")
            until(lambda: not read_lease(side.hold._lease.fd), "the responder's lease ran on")
            _opens_complete(other, 20)
            procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
            loader = procs[0]
            until(lambda: loader.pid in held_pids(side), "a load went on, gate read closed")
            _opens_complete(other, 5)
            assert loader.poll() is None
            assert time.monotonic() - stalled_at < stall.seconds, "the stall ended too soon"
            assert not gates.read("peermem").is_open  # waits as `nodeagent wait` would

            stall.on.clear()
            stall.release.set()  # the loop is back: it renews, the gate reads open again
            out, _ = loader.communicate(timeout=WAIT)
            assert loader.returncode == 0 and out == ko.read_bytes()
            (rec,) = until(lambda: of_kind(timeline, "held-open"), "the held open not recorded")
            assert rec["ended"] == "gate opened" and rec["pid"] == loader.pid
        finally:
            stall.on.clear()
            stall.release.set()


def test_a_dead_responder_lets_its_held_opens_go_and_a_new_one_holds_again(
    driver_tree: tuple[Path, Path],
    modprobe: str,
) -> None:
    root, driver = driver_tree
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    with loaders() as procs, agent_here(root) as (agent, node):
        side = agent.side("peermem")
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        first = side.hold
        procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
        until(lambda: procs[0].pid in held_pids(side), "the load was not held")

        os.kill(first.pid, signal.SIGKILL)
        out, _ = procs[0].communicate(timeout=WAIT)  # the kernel let it go at once
        assert procs[0].returncode == 0 and out == ko.read_bytes()
        (died,) = until(lambda: of_kind(timeline, "hold-responder-died"), "death not recorded")
        assert died["pid"] == first.pid and died["how"] == "killed by SIGKILL"
        status = until(  # (first "starting": the new one starts off the loop thread)
            lambda: (
                (s := hold_status(root)).get("responder_restarts") == 1
                and s.get("responder") == "answering"
                and s
            ),
            "no new responder",
        )
        assert status["responder_pid"] not in (None, first.pid)
        assert status["marked"] == ["run/nvidia/driver"] and status["responder"] == "answering"
        assert len(of_kind(timeline, "hold-started")) == 2

        procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
        until(
            lambda: side.hold is not first and procs[1].pid in held_pids(side),
            "the new responder did not hold the next load",
        )
        node.write(READY)
        out, _ = procs[1].communicate(timeout=WAIT)
        assert procs[1].returncode == 0 and out == ko.read_bytes()


def test_a_responder_that_keeps_dying_is_replaced_five_times_then_the_hold_is_off(
    driver_tree: tuple[Path, Path],
) -> None:
    from nodeagent.guards.peermem.side import RESTARTS_MAX

    root, _driver = driver_tree
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    with agent_here(root) as (agent, _node):
        side = agent.side("peermem")
        for n in range(RESTARTS_MAX + 1):
            hold = until(lambda: side.hold if side.hold and side.hold.alive() else None, "up")
            os.kill(hold.pid, signal.SIGKILL)
            until(
                lambda n=n: len(of_kind(timeline, "hold-responder-died")) == n + 1,
                "the death was not recorded",
            )
        (off,) = until(
            lambda: [
                r for r in of_kind(timeline, "state-problem") if "died" in str(r.get("problem"))
            ],
            "the hold did not give up",
        )
        assert f"died {RESTARTS_MAX + 1} times" in off["problem"]
        assert "not holding any load until the agent restarts" in off["problem"]
        until(lambda: side.hold is None, "a hold is still on")
        assert len(of_kind(timeline, "hold-started")) == RESTARTS_MAX + 1
        status = until(
            lambda: (
                _status(root)
                if hold_status(root).get("state", "").startswith("off after")
                else None
            ),
            "status never said the hold is off",
        )
        assert status["hold"]["state"].startswith(f"off after {RESTARTS_MAX} restarts: ")
        assert any(
            "configured and not holding any load: off after" in p for p in status["problems"]
        )


def test_a_stuck_responder_is_killed_its_held_opens_go_and_a_new_one_answers(
    driver_tree: tuple[Path, Path],
    modprobe: str,
) -> None:
    """A responder that stops answering stalls every open in marked filesystems: silent
    past its ``stuck_s`` (10 s; 2 s here) while the agent's reader kept listening, it is
    killed, what it held goes on, and a new one answers."""
    root, driver = driver_tree
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    with loaders() as procs, agent_here(root) as (agent, _node):
        side = agent.side("peermem")
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        other = driver / "not-a-module"
        other.write_bytes(b"other\n")
        first = side.hold
        first.stuck_s = 2.0
        procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
        until(lambda: procs[0].pid in held_pids(side), "the load was not held")
        os.kill(first.pid, signal.SIGSTOP)  # stuck: it answers nothing
        procs.append(subprocess.Popen(["cat", str(other)], stdout=subprocess.PIPE))
        out, _ = procs[1].communicate(timeout=WAIT)  # waits until the stuck one is killed
        assert procs[1].returncode == 0 and out == b"other\n"
        out, _ = procs[0].communicate(timeout=WAIT)
        assert procs[0].returncode == 0 and out == ko.read_bytes()
        (died,) = until(lambda: of_kind(timeline, "hold-responder-died"), "death not recorded")
        assert died["stuck"] is True and "silent for 2s" in died["how"]
        assert died["pid"] == first.pid
        until(lambda: (h := side.hold) not in (None, first) and h.alive(), "no new responder")
        _opens_complete(other, 3)


# -- a new responder slow to answer: off the loop thread --------------------------------


class _SlowStart:
    """The seam: every responder process started from now on is a shell that waits until
    the test lets it go (``release``: a file appears), then becomes Python as before; its
    ``ResponderProcess`` waits up to ``ready_timeout_s`` for it to answer (far past any
    test's wait, but where its failure is the question: a loop thread waiting on it would
    hang the test)."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ready_timeout_s: float):
        from nodeagent.guards.peermem.process import ResponderProcess

        self.go = tmp_path / "responder-go"
        self.script = tmp_path / "slow-python"
        self.script.write_text(
            "#!/bin/sh\n"
            # (at most ~2 min: a failed test leaves no shell waiting for ever)
            f"n=0; while [ ! -e '{self.go}' ] && [ $n -lt 6000 ]; do sleep 0.02; n=$((n+1)); done\n"
            f"exec '{sys.executable}' \"$@\"\n"
        )
        self.script.chmod(0o755)
        defaults = ResponderProcess.__init__.__kwdefaults__
        monkeypatch.setitem(defaults, "python", str(self.script))
        monkeypatch.setitem(defaults, "ready_timeout_s", ready_timeout_s)

    def release(self) -> None:
        self.go.touch()


def _children() -> list[int]:
    """This process's child processes, zombies too."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(") ", 1)[1].split()[1]) == os.getpid():
                    out.append(int(entry))
    return out


def test_a_slow_new_responder_stalls_no_pass_and_is_adopted_once_it_answers(
    tmp_path: Path, driver_tree: tuple[Path, Path], modprobe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new responder after a death waits to answer (as a Python start may on a loaded
    node, up to 15 s): passes go on meanwhile, the gate (open when it died) is withdrawn,
    opened and withdrawn, the side holds nothing and says "starting"; once it answers, a
    pass adopts it, tells it the gate as it is now (closed, not as it was at the death) and
    it holds the next load."""
    root, driver = driver_tree
    gates = GateFiles(HostRoot(str(root)), "run/nodeagent")
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    with loaders() as procs, agent_here(root) as (agent, node):
        side = agent.side("peermem")
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        first = side.hold
        node.write(READY)  # open when the responder dies
        until(lambda: gates.read("peermem").is_open, "the gate did not open")
        until(lambda: side.gate_open, "the hold's gate did not open")
        slow = _SlowStart(tmp_path, monkeypatch, ready_timeout_s=10 * WAIT)  # the next ones
        try:
            os.kill(first.pid, signal.SIGKILL)
            status = until(
                lambda: (s := hold_status(root)).get("responder") == "starting" and s,
                "the hold did not say its new responder is starting",
            )
            assert status["responder_pid"] is None and status["responder_restarts"] == 1
            assert status["marked"] == [] and status["held"] == []
            starting = until(
                lambda: side.replacement is not None and side.replacement.pid,
                "the new responder's process was not spawned",
            )
            assert alive(starting) and side.hold is None

            # The loop runs passes while it waits (before, its loop thread waited here): the
            # gate withdrawn, opened, withdrawn again.
            passes = agent.passes
            (node.root / READY).unlink()
            until(lambda: not gates.read("peermem").is_open, "no pass withdrew the gate")
            until(lambda: not side.gate_open, "the hold's side did not follow the gate")
            node.write(READY)
            until(lambda: gates.read("peermem").is_open, "no pass opened the gate")
            until(lambda: side.gate_open, "the hold's side did not follow the gate")
            (node.root / READY).unlink()
            until(lambda: not gates.read("peermem").is_open, "no pass withdrew the gate")
            until(lambda: not side.gate_open, "the hold's side did not follow the gate")
            until(lambda: agent.passes >= passes + 3, "the passes did not end")
            assert side.hold is None and side.replacement is not None  # still starting
            assert not side.needs_beat()
            assert hold_status(root)["responder"] == "starting"

            slow.release()  # it answers: a pass adopts it
            status = until(
                lambda: (s := hold_status(root)).get("responder") == "answering" and s,
                "the new responder was not adopted",
            )
            assert status["responder_pid"] == starting and side.hold.pid == starting
            assert status["marked"] == ["run/nvidia/driver"] and status["gate_open"] is False
            assert status["responder_restarts"] == 1 and side.replacement is None
            assert len(of_kind(timeline, "hold-started")) == 2

            # Told the gate as it is now (closed): the next load is held, then goes with it.
            procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
            until(lambda: procs[0].pid in held_pids(side), "the new responder did not hold")
            assert procs[0].poll() is None
            node.write(READY)
            out, _ = procs[0].communicate(timeout=WAIT)
            assert procs[0].returncode == 0 and out == ko.read_bytes()
        finally:
            slow.release()


def _descriptors(tmp_path: Path) -> list[str]:
    """What this process's descriptors are, but files under ``tmp_path`` (the agent's
    observer keeps some of the node's files open across a stop: not the hold's)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith(str(tmp_path)):
                out.append(target)
    return sorted(out)


def test_an_agent_stopped_while_a_new_responder_starts_leaves_no_process_or_descriptor(
    tmp_path: Path, driver_tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _driver = driver_tree
    before = _descriptors(tmp_path)
    with agent_here(root) as (agent, _node):
        side = agent.side("peermem")
        _SlowStart(tmp_path, monkeypatch, ready_timeout_s=10 * WAIT)  # never let go
        os.kill(side.hold.pid, signal.SIGKILL)
        replacement = until(lambda: side.replacement, "no new responder started")
        starting = until(lambda: replacement.pid, "the new responder was not spawned")
        assert alive(starting)
    # The block's end stopped the agent while the new one waited: it was killed, its
    # starter ended, and every descriptor it and the hold opened is closed.
    assert replacement.thread is not None and not replacement.thread.is_alive()
    assert side.replacement is None and side.hold is None
    assert not alive(starting) and _children() == []
    # None left (pipes, eventfd, lease, group). Only new ones count: an earlier test's
    # objects, collected meanwhile, may have closed some of ``before``.
    left = Counter(_descriptors(tmp_path)) - Counter(before)
    assert not left, left


def test_a_first_start_that_hangs_delays_no_pass(
    tmp_path: Path, driver_tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first responder starts off the loop thread too (issue 51: a first start that
    hung delayed the first pass, and its protective steps, by 15 s): passes go on while
    it waits, status says ``starting`` and names the problem; once it answers, a pass
    adopts it."""
    root, _driver = driver_tree
    slow = _SlowStart(tmp_path, monkeypatch, ready_timeout_s=10 * WAIT)
    agent, node = build(root)
    thread = threading.Thread(target=agent.run, name="nodeagent", daemon=True)
    thread.start()
    try:
        side = agent.side("peermem")
        assert side is not None
        until(lambda: agent.passes >= 1, "no first pass while the responder starts")
        status = until(
            lambda: _status(root) if hold_status(root).get("state") == "starting" else None,
            "status does not say the hold is starting",
        )
        assert side.hold is None and side.replacement is not None
        assert any(
            p == "peermem.hold_loads is configured and not holding any load: starting"
            for p in status["problems"]
        ), status["problems"]
        slow.release()
        until(lambda: side.hold is not None and side.hold.alive(), "it was never adopted")
        until(lambda: hold_status(root).get("state") == "running", "status never 'running'")
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()
    assert not thread.is_alive()


def test_new_responders_that_do_not_answer_are_tried_again_and_said_until_one_does(
    tmp_path: Path, driver_tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each new responder that does not answer in its time is a failed start (a
    state-problem each), tried again after a backoff that doubles, never given up: status
    says ``retrying: <why>`` and every pass names the problem meanwhile. Once one answers,
    the hold runs again. The loop's passes go on throughout (issue 51: the hold never goes
    quiet; it gave up after five)."""
    from nodeagent.guards.peermem import side_start as peermem_hold

    monkeypatch.setattr(peermem_hold, "START_RETRY_S", 0.05)  # 0.05, 0.1, 0.2 ... s
    root, _driver = driver_tree
    gates = GateFiles(HostRoot(str(root)), "run/nodeagent")
    timeline = root / "var/lib/nodeagent/timeline.jsonl"

    def problems(text: str) -> list[dict[str, Any]]:
        return [r for r in of_kind(timeline, "state-problem") if text in str(r.get("problem"))]

    with agent_here(root) as (agent, node):
        side = agent.side("peermem")
        slow = _SlowStart(tmp_path, monkeypatch, ready_timeout_s=0.5)  # none answers yet
        os.kill(side.hold.pid, signal.SIGKILL)
        node.write(READY)  # a pass while the new ones fail to start
        until(lambda: gates.read("peermem").is_open, "no pass opened the gate")
        until(lambda: len(problems("did not answer in 0.5s")) >= 2, "no second failed start")
        status = until(
            lambda: _status(root) if "retrying" in hold_status(root).get("state", "") else None,
            "status does not say the hold is retrying",
        )
        assert status["hold"]["state"] == (
            "retrying: the responder process did not answer in 0.5s"
        ), status["hold"]
        assert any(
            p.startswith("peermem.hold_loads is configured and not holding any load: retrying")
            for p in status["problems"]
        ), status["problems"]
        assert len(side.restarts) == 1  # the death; failed starts are not restarts
        slow.release()
        until(lambda: side.hold is not None and side.hold.alive(), "no new responder answered")
        status = until(
            lambda: _status(root) if hold_status(root).get("state") == "running" else None,
            "status does not say the hold runs",
        )
        assert not any("not holding" in p for p in status["problems"]), status["problems"]
        assert side.start_failures == 0 and len(of_kind(timeline, "hold-started")) == 2
        assert gates.read("peermem").is_open  # the gate is the agent's: it stayed


# -- it opens no file once it answers -----------------------------------------------------


def _notification_group(paths: list[str]) -> int | None:
    """A fanotify *notification* group (it blocks nothing) told of every open on the
    filesystems of ``paths``; None where the kernel refuses."""
    from nodeagent.host.fanotify import _libc

    libc = _libc()  # the hold's own ctypes prototypes
    fd = libc.fanotify_init(0x2 | 0x1, os.O_RDONLY | os.O_CLOEXEC)  # NONBLOCK|CLOEXEC, NOTIF
    if fd < 0:
        return None
    for path in paths:  # FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN
        if libc.fanotify_mark(fd, 0x1 | 0x100, 0x20, -100, os.fsencode(path)) < 0:
            os.close(fd)
            return None
    return fd


def _openers(fd: int) -> set[int]:
    """Pids of the opens told so far (each event's descriptor closed)."""
    import struct

    meta = struct.Struct("=IBBHQii")
    pids: set[int] = set()
    while True:
        try:
            buf = os.read(fd, 4096 * meta.size)
        except BlockingIOError:
            return pids
        off = 0
        while off + meta.size <= len(buf):
            event_len, _v, _r, _m, _mask, efd, pid = meta.unpack_from(buf, off)
            if efd >= 0:
                os.close(efd)
            pids.add(pid)
            off += max(event_len, meta.size)


def test_once_ready_the_responder_opens_no_file_where_its_code_lives(
    driver_tree: tuple[Path, Path], modprobe: str
) -> None:
    """What it must never do: open a file on a filesystem that may be marked, and wait on
    itself. A notification group watches the filesystems of its Python and of this
    package while it answers held, released and other opens: none of them is its."""
    import nodeagent

    root, driver = driver_tree
    watched = sorted({os.path.dirname(os.__file__), os.path.dirname(nodeagent.__file__), "/"})
    with loaders() as procs, agent_here(root) as (agent, node):
        side = agent.side("peermem")
        fd = _notification_group(watched)
        if fd is None:
            pytest.skip("this kernel refuses a fanotify notification group here")
        try:
            (ko,) = driver.rglob("nvidia-peermem.ko*")
            other = driver / "not-a-module"
            other.write_bytes(b"other\n")
            _openers(fd)  # what came before (its start) is not the question
            procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
            until(lambda: procs[0].pid in held_pids(side), "the load was not held")
            _opens_complete(other, 5)
            node.write(READY)
            out, _ = procs[0].communicate(timeout=WAIT)
            assert procs[0].returncode == 0 and out == ko.read_bytes()
            (node.root / READY).unlink()
            until(lambda: not side.gate_open, "the gate did not close")
            pid = side.hold.pid
            seen = _openers(fd)
            assert procs[0].pid in seen or os.getpid() in seen, "the watch saw nothing"
            assert pid not in seen, f"the responder (pid {pid}) opened a file on {watched}"
        finally:
            os.close(fd)


def test_a_responder_that_cannot_start_is_one_line_and_leaves_no_descriptor(
    tmp_path: Path,
) -> None:
    from nodeagent.guards.peermem.budget import descriptor_budget
    from nodeagent.guards.peermem.process import ResponderProcess
    from nodeagent.guards.peermem.start import start_hold
    from nodeagent.host.fanotify import FanotifyGroup

    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"fanotify permission group refused here: {exc}")
    budget, _ = descriptor_budget()
    before = len(os.listdir("/proc/self/fd"))

    def apart(descriptors: Any) -> ResponderProcess:
        p = ResponderProcess(group, budget_s=60.0, descriptors=descriptors, python="/nonexistent")
        p.start()
        return p

    responder, marked, problems = start_hold(
        group,
        group.mark_filesystem,
        [("here", str(tmp_path))],
        gate_open=lambda: False,
        budget_s=60.0,
        host_pids=True,
        budget=budget,
        apart=apart,
    )
    assert responder is None and marked == []
    (line,) = [p for p in problems if "not holding any load" in p]
    assert line.startswith("peermem.hold_loads: ") and "/nonexistent" in line
    assert group.fd == -1  # the group closed: nothing marked, nothing held
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the group's, and nothing else


def test_a_pass_opens_no_file_on_the_marked_filesystem(driver_tree: tuple[Path, Path]) -> None:
    """The agent reads the GPU driver's tree at every pass (nvidia-peermem.ko, its
    dependency, modules.dep), and that tree is on the filesystem the hold marks. A pass
    identifies them without opening them (O_PATH), so it costs the responder nothing:
    before, each pass's open of the target was a round trip through it (never ignored,
    being a target), on the way from MOFED's flag to the held load (issue 39)."""
    root, driver = driver_tree
    with agent_here(root) as (agent, _node):
        side = agent.side("peermem")
        (ko,) = driver.rglob("nvidia-peermem.ko*")

        def answered() -> int:
            return sum(side.hold.counts.values()) if side.hold is not None else -1

        def control() -> int:
            """An open that goes through the responder, and its count once it is in (the
            responder reports in order: what came before is counted by then)."""
            was = answered()
            with open(ko, "rb") as f:
                f.read(1)
            return until(lambda: (n := answered()) > was and n, "a control open unanswered")

        until(lambda: agent.passes >= 1, "no first pass")
        before = control()  # the first pass's reads (each file read once) are in
        count = agent.passes
        for i in range(5):
            agent.poke.poke(f"test {i}")
            assert agent.wait_for_passes(count + i + 1, WAIT), "a pass did not run"
        assert control() == before + 1, side.hold.counts  # the passes' reads: none
