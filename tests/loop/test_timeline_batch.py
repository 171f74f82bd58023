"""A pass writes its records to the timeline together: one write and one sync, not one each.

The write comes before the pass's status (readers see the lines at once), the sync at
the pass's end, after the gate: only a power loss could take unsynced lines, and it
takes ``/run``'s gate files with them.

On a disk each ``fdatasync`` is milliseconds, and they stood between MOFED's
ready flag and a held load (issue 39). The exporters still see each record
the moment it is made; the timeline has the pass's records before its status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.sim.node import Node


def test_a_pass_writes_its_records_in_one_append_before_its_status(
    tmp_path: Path, ready_node: Node
) -> None:
    seen: list[str] = []
    agent = Agent(
        Config(host_root=str(tmp_path), mode="enforce", uevents=False),
        module_ops=ready_node.kernel,
        kernel_log=lambda m: [],
        on_record=lambda r: seen.append(str(r.get("kind"))),
    )
    try:
        timeline = agent.books.timeline
        writes: list[list[str]] = []
        append_many = timeline.append_many

        def counting(records: Any, **kw: Any) -> None:
            writes.append([str(r.get("kind")) for r in records])
            append_many(records, **kw)

        timeline.append_many = counting  # type: ignore[method-assign]
        syncs: list[int] = []
        sync = timeline.sync

        def syncing() -> None:
            syncs.append(len(status_at))
            sync()

        timeline.sync = syncing  # type: ignore[method-assign]
        status_at: list[int] = []
        write_status = agent.books.state.write_status

        def noting(doc: Any) -> None:
            status_at.append(len(writes))
            write_status(doc)

        agent.books.state.write_status = noting  # type: ignore[method-assign]
        agent.run_pass(["start"])
        decisions = [k for k in seen if k == "decision"]
        assert len(decisions) >= 3  # one per guard: the pass records them all
        assert status_at == [1], "the pass's records were not written once, before its status"
        assert syncs == [1], "not one sync for the pass, after its status (at its end)"
        assert writes[0].count("decision") == len(decisions)
        written = [r["kind"] for r in timeline.records()]
        assert written[-len(writes[0]) :] == writes[0]
        # Between passes a record is written at once.
        agent.record({"kind": "state-problem", "problem": "between passes"})
        assert writes[-1] == ["state-problem"]
        assert [r["kind"] for r in timeline.records()][-1] == "state-problem"
    finally:
        agent.close()


def test_the_gate_is_published_before_the_reports_and_taken_back_when_status_fails(
    tmp_path: Path,
    ready_node: Node,
) -> None:
    """Rule 5 and 8 of loop/passes.py: an open gate waits for its observation, decision
    and memory, not for records, status or the other plans; a status that cannot be
    written takes the gate back before the pass ends."""
    agent = Agent(
        Config(host_root=str(tmp_path), mode="enforce", uevents=False),
        module_ops=ready_node.kernel,
        kernel_log=lambda m: [],
    )
    order: list[str] = []
    try:
        publish = agent.gates.publish

        def publishing(gates: Any, *a: Any) -> Any:
            out = publish(gates, *a)
            order.append(f"gate {','.join(out)}")
            return out

        agent.gates.publish = publishing  # type: ignore[method-assign]
        for name, obj, attr in (
            ("memory", agent.books.state, "save_memory"),
            ("status", agent.books.state, "write_status"),
            ("timeline", agent.books.timeline, "append_many"),
            ("plans", agent.workers, "submit"),
        ):
            real = getattr(obj, attr)

            def noting(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                order.append(f"urgent {_name}" if kw.get("only_urgent") else _name)
                return _real(*a, **kw)

            setattr(obj, attr, noting)
        result = agent.run_pass(["start"])
        assert result.verdicts["peermem"].ok, result.verdicts["peermem"].reasons
        gate = order.index("gate peermem")
        # Only the protective (urgent) plans and the write-ahead come before the gate.
        assert order[:gate] == ["urgent plans", "memory"], order
        for later in ("plans", "timeline", "status"):
            assert order.index(later) > gate, order
        assert (tmp_path / "run/nodeagent/peermem.gate").exists()

        # status.json a directory: the pass publishes, then takes the gate back.
        status = tmp_path / "run/nodeagent/status.json"
        status.unlink()
        status.mkdir()
        ready_node.write("run/mellanox/drivers/.driver-ready")  # an event: a new decision
        order.clear()
        agent.run_pass(["property"])
        assert "gate peermem" in order, order
        assert not (tmp_path / "run/nodeagent/peermem.gate").exists()
        assert agent.gates.published == []
        assert any("status write failed" in p for p in agent.books.problems)
    finally:
        agent.close()
