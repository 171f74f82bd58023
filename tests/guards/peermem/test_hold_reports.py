"""Held opens' reports pushed out unread are counted and said, not lost without a trace
(issue 51: with the agent stopped 15 s, 1,018 of 1,473 held-open reports vanished)."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

from nodeagent.guards.peermem.budget import Caps
from nodeagent.guards.peermem.reports import HoldReport
from tests.guards.peermem.fakes import Clock, Opens, capped, fake_hold_agent, hold_config
from tests.waiting import until


def test_reports_the_loop_did_not_read_in_time_are_counted(tmp_path: Path) -> None:
    clock, source, gate = Clock(), Opens(), threading.Event()
    responder = capped(source, clock, gate, tmp_path, Caps())
    responder.reports = collections.deque(maxlen=2)  # (1024 as shipped)
    responder.start()
    try:
        source.feed(*source.opens(100, 5))
        until(lambda: len(responder.held()) == 5, "the five opens were not held")
        gate.set()
        responder.wake()
        until(lambda: responder.reported == 5, "the five did not end")
    finally:
        responder.stop()
    assert responder.reports_lost == 3
    assert [type(r) for r in responder.reports] == [HoldReport, HoldReport]


def test_the_side_records_lost_reports_once_with_their_count(tmp_path: Path) -> None:
    from tests.healthy import healthy_node
    from tests.waiting import WAIT

    cfg = hold_config(tmp_path)
    node = healthy_node(tmp_path, ready=False)
    recorded: list[dict[str, Any]] = []
    agent = fake_hold_agent(cfg, node, recorded=recorded)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side = agent.side("peermem")
        assert side is not None
        until(lambda: side.hold is not None, "the hold did not start")
        side.hold.reports_lost += 3
        agent.poke.poke("test")
        lost = until(
            lambda: [r for r in list(recorded) if r.get("kind") == "hold-reports-lost"],
            "the lost reports were not recorded",
        )
        agent.poke.poke("test")  # another pass: said once
        passes = agent.passes
        until(lambda: agent.passes > passes, "no further pass")
        lost = [r for r in list(recorded) if r.get("kind") == "hold-reports-lost"]
        assert len(lost) == 1 and lost[0]["count"] == 3
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()
