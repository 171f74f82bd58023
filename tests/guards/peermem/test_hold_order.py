"""The hold's side, through the agent loop with a fake group (issue 51): closing comes
first (the responder's lease closes before the gate file a reader asks is withdrawn), and
a root whose mark failed is tried again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from nodeagent.sim.node import GATE, READY
from tests.guards.peermem.fakes import OverflowingGroup, fake_hold_agent, hold_config
from tests.healthy import healthy_node
from tests.waiting import WAIT, until


@pytest.mark.parametrize("why", ["ready flag removed", "decision gone stale"])
def test_the_responder_lease_closes_before_the_gate_file_goes(tmp_path: Path, why: str) -> None:
    """Whatever withdraws the gate file (a closed verdict, or a publish whose decision went
    stale: under load, a pass that opened it may find an event since its observation)."""
    cfg = hold_config(tmp_path)
    node = healthy_node(tmp_path)  # MOFED ready: the gate opens, the lease with it
    agent = fake_hold_agent(cfg, node)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side: Any = agent.side("peermem")
        until(lambda: side.hold is not None and side.gate_open, "the hold never opened")
        assert (tmp_path / GATE).exists()
        told: list[tuple[bool, bool]] = []  # (what the responder was told, gate file there)
        follow = side.hold.follow

        def recording(is_open: bool, verdicts: Any = None, judge_all: bool = False) -> None:
            told.append((is_open, (tmp_path / GATE).exists()))
            follow(is_open, verdicts, judge_all)

        side.hold.follow = recording
        if why == "ready flag removed":
            (tmp_path / READY).unlink()  # MOFED restarts: the pass closes the gate
        else:
            agent.gates.fresh = lambda snap: False  # every publish finds its decision stale
            agent.poke.poke("test")
        closing = until(lambda: [t for t in list(told) if not t[0]], "the lease never closed")
        assert closing[0] == (False, True), "the gate file went before the responder's lease"
        until(lambda: not (tmp_path / GATE).exists(), "the gate file stayed")
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()


class _RefusingMarks(OverflowingGroup):
    """A group whose marks of one root fail (ENOSPC: the user's mark limit) until allowed."""

    def __init__(self, refused: str) -> None:
        super().__init__([])
        self.refused = refused
        self.allow = threading.Event()

    def mark_filesystem(self, path: str) -> None:
        if path.endswith(self.refused) and not self.allow.is_set():
            raise OSError(28, "No space left on device")


def test_a_root_whose_mark_failed_is_marked_once_it_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 51: a hold root whose mark failed (ENOSPC on max_user_marks) was never tried
    again, its loads unheld in silence. Now every pass names it as a problem, and it is
    tried again with backoff until marked."""
    from nodeagent.guards.peermem import side_start as peermem_hold

    monkeypatch.setattr(peermem_hold, "START_RETRY_S", 0.01)
    cfg = hold_config(tmp_path, ("run/nvidia/driver", "run/other/driver"))
    node = healthy_node(tmp_path, ready=False)
    group = _RefusingMarks("run/other/driver")
    agent = fake_hold_agent(cfg, node, group)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side: Any = agent.side("peermem")
        until(lambda: side.hold is not None, "the hold did not start")
        assert side.marked == ["run/nvidia/driver"]
        agent.poke.poke("test")
        until(
            lambda: any("run/other/driver not marked" in p for p in side.problems()),
            "the unmarked root is not a problem",
        )
        group.allow.set()
        until(
            lambda: (agent.poke.poke("test"), "run/other/driver" in side.marked)[1],
            "the root was never marked",
        )
        assert side.problems() == []
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()


def test_an_agent_killed_while_holding_is_said_by_the_next_one(tmp_path: Path) -> None:
    """issue 51: a kill -9 cannot be held (the kernel lets every held open go): the next
    agent says so in one record; after a clean stop the next one says nothing."""
    from nodeagent.guards.peermem.side_start import RUNNING_FILE

    cfg = hold_config(tmp_path)
    node = healthy_node(tmp_path, ready=False)
    running = tmp_path / cfg.paths.state_dir / RUNNING_FILE

    def one_agent() -> list[dict[str, Any]]:
        recorded: list[dict[str, Any]] = []
        agent = fake_hold_agent(cfg, node, recorded=recorded)
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        try:
            side: Any = agent.side("peermem")
            until(lambda: side.hold is not None and running.exists(), "the hold did not start")
            passes = agent.passes
            agent.poke.poke("test")
            until(lambda: agent.passes > passes, "no pass after the hold started")
        finally:
            agent.stop()
            thread.join(WAIT)
        assert not running.exists(), "a clean stop leaves the file"
        return [r for r in recorded if r.get("kind") == "hold-ended-unclean"]

    try:
        assert one_agent() == []  # nothing before it
        running.parent.mkdir(parents=True, exist_ok=True)
        running.write_text("")  # as a killed agent leaves it
        (said,) = one_agent()
        assert said["gate_open_now"] is False and "killed" in str(said["meaning"])
        assert one_agent() == []  # the one before stopped cleanly
    finally:
        node.kernel.uevent_source.close()
