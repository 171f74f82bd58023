"""A guard is its own file plus one entry: a toy guard plugged in with nothing else changed.

The toy guard (tests/loop/toyguard.py) is appended to the real guard list and the
real agent is built from it through the one composition root. A pass sees
its decision; its action, of a kind no shared executor knows, is carried out
by its host side; its record, its memory, its part of status.json and its
metric family all arrive with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nodeagent.config import Config
from nodeagent.guards.registry import GUARDS, GuardEntry, build_reconciler
from nodeagent.host.ports import HostPorts
from nodeagent.loop.wiring import LoopHooks, build_agent
from nodeagent.metrics import MetricsExporter
from tests.healthy import healthy_node
from tests.loop.toyguard import BELL, RUNG, ToyGuard, ToyPolicy, ToySide, parse_policy
from tests.waiting import WAIT

TOY = GuardEntry("toy", ToyPolicy(), parse_policy, ToyGuard, ToySide)


def samples(metrics: MetricsExporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.scrape(None)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def test_a_toy_guard_is_its_own_file_plus_one_entry(tmp_path: Path) -> None:
    node = healthy_node(tmp_path)
    node.kernel.uevent_source.close()
    guards = (*GUARDS, TOY)
    cfg = Config(host_root=str(tmp_path), mode="enforce", uevents=False)
    metrics = MetricsExporter(
        build_reconciler(cfg.policies, cfg.paths, guards).guards,
        mode="enforce",
        liveness_seconds=60,
    )
    records: list[dict[str, object]] = []

    def on_record(rec: dict[str, object]) -> None:
        records.append(rec)
        metrics.on_record(rec)

    agent = build_agent(
        cfg,
        HostPorts(module_ops=node.kernel, kernel_log=lambda m: []),  # type: ignore[arg-type]
        LoopHooks(on_record=on_record, on_pass=metrics.on_pass),
        guards,
    )
    state = tmp_path / "run/nodeagent"
    orphan = tmp_path / "etc/toy/.rung.tmp.4242"  # what a killed write of the side left
    orphan.parent.mkdir(parents=True)
    orphan.write_text("half a write")
    try:
        agent.run(once=True)
        assert not orphan.exists()  # removed at start, in the side's own directory too
        quiet = [r for r in records if r.get("kind") == "decision" and r.get("guard") == "toy"]
        assert quiet and quiet[-1]["verdict"] == "quiet" and quiet[-1]["ok"] is True
        assert (state / "toy.gate").exists()  # its gate, published like any other
        assert (
            samples(metrics)[("nodeagent_guard_state", (("guard", "toy"), ("state", "quiet")))] == 1
        )

        (tmp_path / BELL).write_text("ding\n")
        agent.run_pass()  # decides and hands the plan to the toy's worker
        assert agent.workers.wait_idle(WAIT), "the toy's plan did not end"
        agent.run_pass()  # absorbs its outcome: memory, record, metric
        toy = [r for r in records if r.get("guard") == "toy"]
        decisions = [r for r in toy if r.get("kind") == "decision"]
        assert [d["actions"] for d in decisions[-2:]] == [["ring the toy bell"], []]  # once
        assert decisions[-1]["verdict"] == "ringing" and decisions[-1]["ok"] is False
        assert not (state / "toy.gate").exists()  # closed: withdrawn
        action = [r for r in toy if r.get("kind") == "action"]
        assert action and action[-1]["ok"] is True  # its own executor, from its host side
        assert (tmp_path / RUNG).read_text() == "1\n"
        assert agent.memory["toy"].rings == 1
        saved = json.loads((state / "state.json").read_text())
        assert json.dumps(saved).count('"rings": 1') == 1  # its memory, written by the loop
        status = json.loads((state / "status.json").read_text())
        assert status["guards"]["toy"]["verdict"] == "ringing"
        got = samples(metrics)
        assert got[("nodeagent_toy_rings_total", ())] == 1
        assert got[("nodeagent_guard_state", (("guard", "toy"), ("state", "ringing")))] == 1
        assert got[("nodeagent_guard_ok", (("guard", "toy"),))] == 0
        assert status["toy"] == {"rung": 1}  # the side's part of status.json
    finally:
        agent.close()
