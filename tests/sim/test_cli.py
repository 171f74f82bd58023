"""``nodeagent simulate``: options, the text views and the JSON schema (version 2)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nodeagent.sim.cli import simulate_main
from nodeagent.sim.modes import MODES
from nodeagent.sim.node import COLUMNS
from nodeagent.sim.scenarios import SCENARIOS

VERDICT_TYPES: dict[str, tuple[type, ...]] = {
    "peermem_loaded": (bool,),
    "peermem_loads": (int,),
    "peermem_failed_loads": (int,),
    "peermem_failed_by": (dict,),
    "peermem_first_loaded_at": (float, int, type(None)),
    "ready_flag_at": (float, int, type(None)),
    "driver_restarts": (int,),
    "sidecar_restarts": (int,),
    "mofed_installed": (bool,),
    "mofed_restarts": (int,),
    "vfs_total": (int,),
    "vfs_config_back": (int,),
    "vfs_partly_back": (int,),
    "healthy_at": (float, int, type(None)),
    "missing_guards": (list,),
    "not_prevented": (list,),
}


def check_schema(doc: dict[str, Any]) -> None:
    """The schema docs/simulator.md documents, checked field by field."""
    assert doc["schema"] == "nodeagent-simulate" and doc["version"] == 2
    assert set(doc) == {
        "schema", "version", "seed", "speed", "deployment_modes", "scenarios", "wall_seconds",
    }  # fmt: skip
    for name, mode in doc["deployment_modes"].items():
        assert name in MODES
        assert set(mode) - {"nodeagent_hold"} == {
            "title", "settings", "peermem_loaders", "not_prevented",
        }  # fmt: skip
        assert mode.get("nodeagent_hold", "fanotify") == "fanotify"
        assert ("nodeagent_hold" in mode) == MODES[name].hold
    assert isinstance(doc["seed"], int) and isinstance(doc["wall_seconds"], float)
    for sc in doc["scenarios"]:
        assert set(sc) == {
            "name", "title", "seeds", "clock_start", "kernel", "duration_s", "needs_guards", "runs",
        }  # fmt: skip
        assert sc["name"] in SCENARIOS and all(isinstance(s, str) for s in sc["seeds"])
        for run in sc["runs"]:
            assert set(run) == {"agent", "deployment_mode", "verdict", "events", "kernel_log"}
            assert isinstance(run["agent"], bool)
            assert run["deployment_mode"] in doc["deployment_modes"]
            assert all(isinstance(n, int) for n in run["verdict"]["peermem_failed_by"].values())
            assert run["agent"] or not run["verdict"]["not_prevented"]
            assert set(run["verdict"]) - {"held_opens", "guards_at_end"} == set(VERDICT_TYPES)
            # With the agent: each guard's last verdict (issue 54's node kinds read it).
            at_end = run["verdict"].get("guards_at_end")
            assert ("guards_at_end" in run["verdict"]) == run["agent"]
            assert at_end is None or set(at_end) == {"peermem", "storage", "sriov"}
            held = run["verdict"].get("held_opens")  # only in a hold mode's runs, with the agent
            hold_run = run["agent"] and MODES[run["deployment_mode"]].hold
            assert ("held_opens" in run["verdict"]) == hold_run
            assert held is None or all(isinstance(x, str) for x in held)
            for key, types in VERDICT_TYPES.items():
                assert isinstance(run["verdict"][key], types), key
            times = [e["t"] for e in run["events"]]
            assert times == sorted(times) and all(t >= 0 for t in times)
            for e in run["events"]:
                assert set(e) == {"t", "clock", "column", "kind", "text"}
                assert e["column"] in COLUMNS and isinstance(e["text"], str)
                assert e["kind"] in ("line", "state")
                assert e["kind"] == "line" or e["column"] == "kernel"
                assert len(e["clock"]) == 8 and e["clock"][2] == ":"
            for line in run["kernel_log"]:
                assert set(line) == {"t", "text"}


def test_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["kernel-upgrade-race", "--compare", "--json", "--speed", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    check_schema(doc)
    (sc,) = doc["scenarios"]
    assert [r["agent"] for r in sc["runs"]] == [False, True, True]
    assert sc["clock_start"] == "11:51:06"
    first = sc["runs"][0]["events"][0]
    assert first["t"] == 0 and first["clock"] == "11:51:06"
    # The seed's own mode: the GPU Operator's driver container loads peermem itself, so
    # the agent cannot prevent its EINVAL; the with-agent run says so.
    # The third run: the same operator settings, nodeagent with the hold component.
    modes = [r["deployment_mode"] for r in sc["runs"]]
    assert modes == ["operator-peermem-dm09"] * 2 + ["operator-peermem-dm09-hold"]
    for run in sc["runs"][:2]:
        assert run["verdict"]["peermem_failed_by"] == {"nvidia-driver-ctr": 1}
    labels = sc["runs"][1]["verdict"]["not_prevented"]
    assert any(
        "by nvidia-driver-ctr: not prevented in mode operator-peermem-dm09" in x for x in labels
    )
    hold = sc["runs"][2]["verdict"]
    assert hold["peermem_failed_by"] == {} and hold["driver_restarts"] == 0


def test_compare_lanes_prints_both_timelines_and_the_verdicts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert simulate_main(["storage-module-race", "--compare", "--speed", "0"]) == 0
    short = capsys.readouterr().out
    assert "time " not in short and "storage-module-race --compare --lanes" in short
    assert simulate_main(["storage-module-race", "--compare", "--lanes", "--speed", "0"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("time"))
    assert "MOFED (no agent)" in header and "agent (agent)" in header and "║" in header
    assert "without the agent" in out and "with nodeagent" in out
    assert "healthy node at (seed time)" in out
    assert "guard not built yet" not in out  # the storage guard is built
    assert "00:20:00" in out  # the MOFED pod's first start, in the seed's clock


def test_without_agent_has_no_agent_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["vf-restore", "--without-agent", "--speed", "0"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("time"))
    assert "agent" not in header and "MOFED" in header
    assert "VFs with their config back        0/50" in out
    verdict = out.splitlines().index(next(x for x in out.splitlines() if x.startswith("verdict ")))
    assert out.splitlines()[verdict + 1].startswith("failed nvidia_peermem loads ")
    assert "deployment mode operator-peermem: " in out


def test_deployment_mode_option_runs_the_scene_with_other_operator_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The same scene with k8s-driver-manager waiting for the ready flag (>= v0.10.0): the
    # driver container starts after MOFED is done and its load succeeds; no agent needed.
    argv = ["kernel-upgrade-race", "--compare", "--json", "--speed", "0"]
    assert simulate_main([*argv, "--deployment-mode", "operator-peermem"]) == 0
    doc = json.loads(capsys.readouterr().out)
    check_schema(doc)
    runs = doc["scenarios"][0]["runs"]
    assert [r["deployment_mode"] for r in runs] == [
        "operator-peermem", "operator-peermem", "operator-peermem-hold",
    ]  # fmt: skip
    for run in runs:
        assert run["verdict"]["peermem_failed_loads"] == 0
        assert run["verdict"]["driver_restarts"] == 0 and run["verdict"]["peermem_loaded"]


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-scenario"],
        ["--compare", "--without-agent"],
        ["--speed", "-1"],
        ["--seed", "x"],
        ["--deployment-mode", "no-such-mode"],
    ],
)
def test_bad_usage_is_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(argv) == 2
    assert "usage" in capsys.readouterr().err


def test_speed_paces_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    start = time.monotonic()
    assert simulate_main(["vf-restore", "--without-agent", "--speed", "1200"]) == 0
    assert time.monotonic() - start >= 600 / 1200 * 0.9  # 600 seed-seconds at 1200x
    capsys.readouterr()
