"""When the loop wakes next, decided in one place (loop/passes.py, WakeSchedule)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import RENEW_S, GateFiles
from nodeagent.loop import passes as passes_module
from nodeagent.loop.passes import PASS_RETRY_S, WakeSchedule
from nodeagent.sim.node import GATE, Node
from tests.waiting import WAIT, until


def test_a_pass_is_due_at_the_resync_when_no_guard_asks_sooner() -> None:
    s = WakeSchedule(now=100.0, resync_s=30.0)
    s.passed(None)
    assert s.next_wake(100.0, beat=False) == (130.0, 30.0)


def test_a_guards_wake_at_comes_before_the_resync() -> None:
    s = WakeSchedule(now=100.0, resync_s=30.0)
    s.passed(104.5)  # e.g. a retry backoff
    assert s.next_wake(101.0, beat=False) == (104.5, 3.5)
    s.passed(500.0)  # later than the resync: the resync still comes first
    assert s.next_wake(101.0, beat=False) == (130.0, 29.0)


def test_a_beat_wakes_the_loop_every_renewal_without_moving_the_deadline() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    deadline, wait = s.next_wake(0.0, beat=True)
    assert deadline == 30.0 and wait == RENEW_S
    deadline, wait = s.next_wake(29.9, beat=True)
    assert deadline == 30.0 and 0 < wait < RENEW_S  # never past the deadline
    assert s.next_wake(31.0, beat=True)[1] == 0.0  # overdue: no wait at all


def test_a_failed_pass_is_tried_again_soon_and_never_after_the_resync() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    s.failed(10.0)
    assert s.next_wake(10.0, beat=False) == (10.0 + PASS_RETRY_S, PASS_RETRY_S)
    short = WakeSchedule(now=0.0, resync_s=2.0)
    short.failed(1.0)
    assert short.next_wake(1.0, beat=False)[0] == 2.0  # the resync is sooner than a retry


def test_the_resync_is_rescheduled_once_it_came_due() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    s.passed(None)
    s.after(29.0)
    assert s.next_wake(29.0, beat=False)[0] == 30.0  # not due yet: unchanged
    s.after(31.0)
    assert s.next_wake(31.0, beat=False)[0] == 61.0


# -- the loop: a beat is a beat, not a pass ---------------------------------------------


def test_an_idle_agent_with_a_gate_open_beats_and_makes_no_pass(
    tmp_path: Path, ready_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle with the peermem gate open: the loop renews the gate's lease every RENEW_S
    (here shortened) and makes no pass until an event or the resync (an hour): a waker's
    timeout is a timeout, not a reason for a pass (issue 50: every beat was a full pass)."""
    monkeypatch.setattr(passes_module, "RENEW_S", 0.02)
    cfg = Config(host_root=str(tmp_path), mode="observe", uevents=False, resync_seconds=3600)
    agent = Agent(cfg, module_ops=ready_node.kernel, pass_context=lambda: ready_node.sched.world)
    gates = GateFiles(HostRoot(tmp_path), cfg.paths.state_dir)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        until(lambda: agent.beats >= 3, "the loop never beat with the gate open")
        assert gates.read("peermem").is_open, "the healthy node's gate is open"
        passes, beats = agent.passes, agent.beats
        until(lambda: agent.beats >= beats + 40, "the loop stopped beating")
        assert agent.passes == passes, f"{agent.passes - passes} passes in 40 beats"
        lease_before = json.loads((tmp_path / GATE).read_text())["lease_until"]
        until(
            lambda: json.loads((tmp_path / GATE).read_text())["lease_until"] > lease_before,
            "a beat renews the lease",
        )
        # An event still makes a pass, at once.
        agent.poke.poke("test")
        until(lambda: agent.passes == passes + 1, "a poke makes a pass")
    finally:
        agent.stop()
        thread.join(WAIT)
    assert not thread.is_alive()


def test_a_pass_that_came_due_with_no_event_says_why() -> None:
    s = WakeSchedule(now=0.0, resync_s=30.0)
    s.passed(5.0)  # a guard's wake_at
    assert s.due(5.0) == "scheduled"
    assert s.due(30.0) == "resync"
