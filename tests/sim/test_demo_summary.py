"""The demo's output (``scripts/demo.sh`` = ``nodeagent simulate all --compare``): one
summary matrix first, whose every cell is a simulated run's verdict as ``--json`` gives
it; short and narrow; the lanes behind ``--lanes``."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from nodeagent.sim.cli import simulate_main
from nodeagent.sim.modes import shipped_and_hold
from nodeagent.sim.render import clock_at
from nodeagent.sim.scenarios import SCENARIOS

DEMO = ["all", "--compare", "--speed", "0"]  # scripts/demo.sh's arguments, unpaced


@cache
def _outputs() -> tuple[str, dict[str, Any]]:
    """The demo's text and the JSON of the same runs (the same seed: the same runs)."""
    import contextlib
    import io

    outs = []
    for argv in (DEMO, [*DEMO, "--json"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert simulate_main(argv) == 0
        outs.append(buf.getvalue())
    return outs[0], json.loads(outs[1])


def _matrix(text: str) -> dict[tuple[str, str], list[str]]:
    """The printed matrix: (scenario, run) -> the verdict cells, as printed."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("═"))
    rows: dict[tuple[str, str], list[str]] = {}
    scenario = ""
    for line in lines[start + 1 :]:
        if not line:
            break
        if line.startswith("─"):
            scenario = ""
            continue
        label, run, *cells = re.split(r"\s{2,}", line)
        scenario = scenario or label
        rows[(scenario, run)] = cells
    return rows


def test_the_demo_script_runs_simulate_compare() -> None:
    script = (Path(__file__).parents[2] / "scripts/demo.sh").read_text()
    assert 'nodeagent simulate "${@:-all}" --compare' in script


def test_every_cell_of_the_summary_is_the_json_verdict_of_the_same_run() -> None:
    text, doc = _outputs()
    matrix = _matrix(text)
    assert [sc["name"] for sc in doc["scenarios"]] == list(SCENARIOS)
    seen = 0
    for sc in doc["scenarios"]:
        runs = {
            (
                "without"
                if not r["agent"]
                else "with hold"
                if r["deployment_mode"].endswith("-hold")
                else "as shipped"
            ): r
            for r in sc["runs"]
        }
        # A mode with no -hold variant (dma-buf: nobody loads peermem) runs twice.
        hold = shipped_and_hold(runs["as shipped"]["deployment_mode"])[1]
        assert list(runs) == ["without", "as shipped", *(["with hold"] if hold else [])]
        assert hold is None or runs["with hold"]["deployment_mode"] == hold
        for name, run in runs.items():
            failed, restarts, mofed, vfs, healthy = matrix[(sc["name"], name)]
            v = run["verdict"]
            assert int(failed) == v["peermem_failed_loads"]
            m = re.fullmatch(r"(\d+)(?: \(\+(\d+)\))?", restarts)
            assert m is not None
            assert int(m.group(1)) == v["driver_restarts"]
            assert int(m.group(2) or 0) == v["sidecar_restarts"]
            assert mofed == ("yes" if v["mofed_installed"] else "no")
            want_vfs = f"{v['vfs_config_back']}/{v['vfs_total']}" if v["vfs_total"] else "n/a"
            assert vfs == want_vfs
            if v["healthy_at"] is None:
                assert healthy == "never"
            else:
                assert healthy.split()[0] == clock_at(sc["clock_start"], v["healthy_at"])
            seen += 1
    assert seen == len(matrix) == sum(len(sc["runs"]) for sc in doc["scenarios"])


def test_the_summary_names_the_modes_and_the_headline_incident_both_ways() -> None:
    text, _doc = _outputs()
    matrix = _matrix(text)
    # Seeds 000-002 as shipped (their own operator settings): the driver container's load
    # still fails and it restarts; with the hold, none.
    assert matrix[("kernel-upgrade-race", "as shipped")][:2] == ["1", "1 (+2)"]
    assert matrix[("kernel-upgrade-race", "with hold")][:2] == ["0", "0 (+1)"]
    lines = text.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("kernel-upgrade-race ")))
    assert lines[i + 2].startswith("operator-peermem-dm09 ")  # the mode as shipped, named
    words = " ".join(text.split())  # the notes are wrapped
    assert "kernel-upgrade-race, as shipped: 1 failed nvidia_peermem load(s)" in words
    assert "not prevented in mode operator-peermem-dm09:" in words
    # Held from mid-openibd restart until the gate opens at MOFED's ready flag (the driver
    # container's own root, not yet mounted at run/nvidia/driver: the real init's order).
    assert "nvidia-driver-ctr's modprobe held 103.6 s" in words
    assert "nvidia-peermem.ko: gate opened" in words
    assert "nodeagent simulate all --compare --lanes" in text  # where the detail is


def test_the_demo_output_is_short_and_narrow() -> None:
    # Before: 2,131 lines, up to 465 characters wide, the verdicts after the lanes.
    text, _doc = _outputs()
    lines = text.splitlines()
    assert len(lines) <= 60
    assert max(len(x) for x in lines) <= 100
    assert lines[0].startswith("nodeagent simulate: ")
    assert not any(x.startswith("time ") for x in lines)  # no lane table


def test_lanes_show_the_timelines_between_the_summary_and_its_repeat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert simulate_main(["kernel-upgrade-race", "--compare", "--lanes", "--speed", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [i for i, x in enumerate(lines) if x.startswith("nodeagent simulate: ")]
    tables = [i for i, x in enumerate(lines) if x.startswith("time ")]
    assert len(heads) == 2 and len(tables) == 2  # as shipped side by side; the hold's own
    assert heads[0] < tables[0] < tables[1] < heads[1]
    assert "MOFED (no agent)" in lines[tables[0]] and "agent (agent)" in lines[tables[0]]
    assert "deployment mode operator-peermem-dm09-hold: " in "\n".join(lines)
