"""Timelines and verdicts as text (the seeds' style) and as JSON (schema version 2).

The text is for people: one row per moment, a column per party (time | MOFED |
GPU driver | agent | kernel state), times as the seed's wall clock. The JSON
is for programs; its schema is documented in docs/simulator.md and is stable:
fields are only ever added, and ``version`` changes if one is removed or
changes meaning.
"""

from __future__ import annotations

import math
import re
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any

from nodeagent.sim.node import COLUMNS, SimEvent
from nodeagent.sim.scenarios import RunResult, Scenario, Verdict

__all__ = [
    "JSON_SCHEMA",
    "JSON_VERSION",
    "SUMMARY_WIDTH",
    "clock_at",
    "render_compare",
    "render_run",
    "render_summary",
    "to_json",
]

JSON_SCHEMA = "nodeagent-simulate"
JSON_VERSION = 2


def clock_at(start: str, t: float) -> str:
    """The seed's wall-clock time ``t`` seed-seconds after ``start`` ("HH:MM:SS")."""
    h, m, s = (int(x) for x in start.split(":"))
    total = (h * 3600 + m * 60 + s + math.floor(t + 1e-6)) % 86400
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _width() -> int:
    return max(100, shutil.get_terminal_size((160, 40)).columns)


def _table(
    header: Sequence[str], widths: Sequence[int], rows: Sequence[Sequence[str]], bars: set[int]
) -> list[str]:
    """Rows of cells wrapped to their column; ``bars``: column indexes preceded by '║'."""

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            sep = "" if i == 0 else (" ║ " if i in bars else " │ ")
            out.append(sep + cell.ljust(w))
        return "".join(out).rstrip()

    lines = [line(header), "═" * (sum(widths) + 3 * (len(widths) - 1))]
    for row in rows:
        wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(row, widths, strict=True)]
        for i in range(max(len(c) for c in wrapped)):
            lines.append(line([c[i] if i < len(c) else "" for c in wrapped]))
    return lines


_LONG_PATH = re.compile(r"\b(run|lib|etc|sys)/(?:[^\s/]+/){2,}([^\s/]+)")


def _short(text: str) -> str:
    """Long paths shortened for a narrow column (the JSON keeps them whole)."""
    return _LONG_PATH.sub(lambda m: f"{m.group(1)}/…/{m.group(2)}", text)


def _rows(
    scenario: Scenario, runs: Sequence[tuple[Sequence[SimEvent], Sequence[str]]]
) -> list[list[str]]:
    """Merge the runs' events by the second: one row per second, a cell per (run, column)."""
    second = lambda e: math.floor(e.t + 1e-6)  # noqa: E731
    times = sorted({second(e) for events, _cols in runs for e in events})
    rows = []
    for t in times:
        row = [clock_at(scenario.clock, t)]
        for events, cols in runs:
            for col in cols:
                here = [e for e in events if second(e) == t and e.column == col]
                states = [e for e in here if e.kind == "state"]
                # several kernel states within one second: the last one is what the row shows
                texts = [_short(e.text) for e in here if e.kind != "state" or e is states[-1]]
                row.append("; ".join(texts))
        rows.append(row)
    return rows


def _title(scenario: Scenario) -> list[str]:
    seeds = ", ".join(scenario.seeds)
    return [
        f"━━ {scenario.name} (seed{'s' if len(scenario.seeds) > 1 else ''} {seeds}): "
        f"{scenario.title}",
        textwrap.fill(scenario.story, _width()),
        "",
    ]


def render_run(result: RunResult) -> str:
    cols = [c for c in COLUMNS if result.agent or c != "agent"]
    n = len(cols)
    w = (_width() - 8 - 3 * n) // n
    header = ["time", *cols]
    rows = _rows(result.scenario, [(result.events, cols)])
    mode = "with nodeagent (enforce)" if result.agent else "without the agent"
    lines = [*_title(result.scenario), f"── {mode}"]
    lines += _table(header, [8, *[w] * n], rows, set())
    lines += render_verdicts(result.scenario, [result])
    return "\n".join(lines)


def render_compare(without: RunResult, with_agent: RunResult) -> str:
    left = [c for c in COLUMNS if c != "agent"]
    right = list(COLUMNS)
    n = len(left) + len(right)
    w = (_width() - 8 - 3 * n) // n
    header = ["time", *[f"{c} (no agent)" for c in left], *[f"{c} (agent)" for c in right]]
    rows = _rows(without.scenario, [(without.events, left), (with_agent.events, right)])
    lines = _title(without.scenario)
    lines += _table(header, [8, *[w] * n], rows, {1 + len(left)})
    lines += render_verdicts(without.scenario, [without, with_agent])
    return "\n".join(lines)


def _verdict_cells(scenario: Scenario, v: Verdict) -> list[str]:
    at = lambda t: clock_at(scenario.clock, t)  # noqa: E731
    failed = str(v.peermem_failed_loads)
    if v.peermem_failed_by:
        failed += " (" + ", ".join(f"{who} {n}" for who, n in v.peermem_failed_by.items()) + ")"
    if v.peermem_loaded and v.peermem_first_loaded_at is not None:
        peermem = f"yes, at {at(v.peermem_first_loaded_at)}"
        if v.peermem_loads > 1:
            peermem += f" ({v.peermem_loads} loads)"
    else:
        peermem = "no"
    restarts = str(v.driver_restarts)
    if v.sidecar_restarts:
        restarts += f" (+{v.sidecar_restarts} nvidia-peermem-ctr)"
    mofed = "yes" if v.mofed_installed else "no"
    if v.mofed_restarts:
        mofed += f"; {v.mofed_restarts} MOFED restart(s)"
    if v.vfs_total:
        vfs = f"{v.vfs_config_back}/{v.vfs_total}"
        if v.vfs_partly_back:
            vfs += f" ({v.vfs_partly_back} partly)"
    else:
        vfs = "n/a (no VFs)"
    healthy = (
        f"{at(v.healthy_at)} (+{_duration(v.healthy_at)})" if v.healthy_at is not None else "never"
    )
    return [failed, peermem, restarts, mofed, vfs, healthy]


VERDICT_ROWS = (
    "failed nvidia_peermem loads",
    "nvidia_peermem loaded at the end",
    "GPU driver-container restarts",
    "MOFED installed",
    "VFs with their config back",
    "healthy node at (seed time)",
)


def render_verdicts(scenario: Scenario, results: Sequence[RunResult]) -> list[str]:
    heads = ["with nodeagent" if r.agent else "without the agent" for r in results]
    cells = [_verdict_cells(scenario, r.verdict) for r in results]
    width = 44
    lines = ["verdict".ljust(34) + "".join(h.ljust(width) for h in heads).rstrip()]
    for i, label in enumerate(VERDICT_ROWS):
        lines.append(label.ljust(34) + "".join(c[i].ljust(width) for c in cells).rstrip())
    modes = {r.mode.name: r.mode for r in results}
    for mode in modes.values():
        lines.append(f"deployment mode {mode.name}: {mode.title} ({'; '.join(mode.settings)})")
    for r in results:
        for held in r.verdict.held_opens or ():
            lines.append(f"with nodeagent, held: {held}")
        for label in r.verdict.not_prevented:
            lines.append(f"with nodeagent, {label}")
    return ["", *lines, ""]


SUMMARY_WIDTH = 98
# The summary's columns: (heading line 1, heading line 2, width).
_SUMMARY_COLS = (
    ("incident", "(seeds, mode)", 22),
    ("run", "", 10),
    ("failed", "loads", 6),
    ("driver-ctr", "restarts", 10),
    ("MOFED", "installed", 9),
    ("VFs", "back", 5),
    ("healthy at", "(seed clock)", 18),
)
_RUN_NAMES = ("without", "as shipped", "with hold")


_HELD_FOR = re.compile(r" held (\d+(?:\.\d+)?) s opening ")


def _brief_hold(text: str) -> bool:
    """A held open that went on within a second (a driver container's load held while its
    file was judged, the gate open): the summary leaves it to ``--json``."""
    m = _HELD_FOR.search(text)
    return m is not None and float(m[1]) < 1.0 and text.endswith(": gate opened")


def _run_name(run: dict[str, Any]) -> str:
    if not run["agent"]:
        return _RUN_NAMES[0]
    return _RUN_NAMES[2] if run["deployment_mode"].endswith("-hold") else _RUN_NAMES[1]


def summary_cells(clock: str, verdict: dict[str, Any]) -> list[str]:
    """One run's verdict as the summary's cells: failed loads, driver-container restarts
    (+ the nvidia-peermem-ctr sidecar's), MOFED installed, VFs back, healthy at."""
    v = verdict
    restarts = str(v["driver_restarts"])
    if v["sidecar_restarts"]:
        restarts += f" (+{v['sidecar_restarts']})"
    vfs = f"{v['vfs_config_back']}/{v['vfs_total']}" if v["vfs_total"] else "n/a"
    healthy = v["healthy_at"]
    at = f"{clock_at(clock, healthy)} (+{_duration(healthy)})" if healthy is not None else "never"
    return [
        str(v["peermem_failed_loads"]),
        restarts,
        "yes" if v["mofed_installed"] else "no",
        vfs,
        at,
    ]


def render_summary(doc: dict[str, Any], *, scenario: str = "all", lanes: bool = False) -> str:
    """One matrix of ``--compare``'s runs, from their JSON (``to_json``): a row per
    scenario and run (without the agent, as shipped, with the hold), a column per verdict;
    under it what the agent did not prevent and what the hold held, in words."""
    widths = [w for _h1, _h2, w in _SUMMARY_COLS]
    rule = sum(widths) + 2 * (len(widths) - 1)

    def row(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [
        f"nodeagent simulate: the seed incidents on a simulated node (seed {doc['seed']}), "
        "each run three ways:",
        *textwrap.wrap(
            "without = no nodeagent; as shipped = nodeagent as deploy/base installs it, in the "
            "seed's own operator settings (the mode named under the incident); with hold = "
            "the same plus deploy/components/peermem-hold (mode <mode>-hold).",
            SUMMARY_WIDTH,
        ),
        "",
        row([h1 for h1, _h2, _w in _SUMMARY_COLS]),
        row([h2 for _h1, h2, _w in _SUMMARY_COLS]),
        "═" * rule,
    ]
    notes: list[str] = []
    for i, sc in enumerate(doc["scenarios"]):
        shipped = next((r["deployment_mode"] for r in sc["runs"] if r["agent"]), "")
        seeds = ("seeds " if len(sc["seeds"]) > 1 else "seed ") + ", ".join(sc["seeds"])
        seeds = seeds if sc["seeds"] else "a node kind"
        first = [sc["name"], seeds, shipped]
        if i:
            out.append("─" * rule)
        for j, run in enumerate(sc["runs"]):
            name = _run_name(run)
            label = first[j] if j < len(first) else ""
            out.append(row([label, name, *summary_cells(sc["clock_start"], run["verdict"])]))
            for text in run["verdict"].get("held_opens") or ():
                if not _brief_hold(text):  # (a load judged and let go in a pass: --json)
                    notes.append(f"{sc['name']}, {name}: held: {_short(text)}")
            for text in run["verdict"]["not_prevented"]:
                notes.append(f"{sc['name']}, {name}: {text}")
            if not sc["seeds"] and name == "as shipped":  # a node kind: each guard's word
                at_end = run["verdict"]["guards_at_end"].items()
                said = ", ".join(f"{g} {w.split(':')[0]}" for g, w in at_end)
                notes.append(f"{sc['name']}, {name}: {said} (why: --json, guards_at_end)")
    out += [
        "",
        "(+N): restarts of the nvidia-peermem-ctr sidecar; never: not healthy at the end.",
    ]
    for note in notes:
        out += textwrap.wrap(note, SUMMARY_WIDTH, subsequent_indent="    ", break_on_hyphens=False)
    where = (
        "below, then this summary again"
        if lanes
        else (f"nodeagent simulate {scenario} --compare --lanes (scripts/demo.sh --lanes)")
    )
    out += [
        "",
        *textwrap.wrap(
            f"Each row is one simulated run; --json gives the same runs' verdicts and events. "
            f"The lanes (each run's timeline, side by side): {where}.",
            SUMMARY_WIDTH,
        ),
    ]
    return "\n".join(out)


def to_json(results: Sequence[RunResult], *, seed: int, speed: float | None) -> dict[str, Any]:
    scenarios: dict[str, dict[str, Any]] = {}
    for r in results:
        sc = r.scenario
        doc = scenarios.setdefault(
            sc.name,
            {
                "name": sc.name,
                "title": sc.title,
                "seeds": list(sc.seeds),
                "clock_start": sc.clock,
                "kernel": sc.kver,
                "duration_s": sc.duration,
                "needs_guards": list(sc.needs),
                "runs": [],
            },
        )
        doc["runs"].append(
            {
                "agent": r.agent,
                "deployment_mode": r.mode.name,
                "verdict": r.verdict.to_json(),
                "events": [
                    {
                        "t": e.t,
                        "clock": clock_at(sc.clock, e.t),
                        "column": e.column,
                        "kind": e.kind,
                        "text": e.text,
                    }
                    for e in r.events
                ],
                "kernel_log": [{"t": t, "text": text} for t, text in r.kernel_log],
            }
        )
    modes = {r.mode.name: r.mode for r in results}
    return {
        "schema": JSON_SCHEMA,
        "version": JSON_VERSION,
        "seed": seed,
        "speed": speed,
        "deployment_modes": {
            m.name: {
                "title": m.title,
                "settings": list(m.settings),
                "peermem_loaders": list(m.loaders),
                "not_prevented": m.not_prevented,
                **({"nodeagent_hold": "fanotify"} if m.hold else {}),
            }
            for m in modes.values()
        },
        "scenarios": list(scenarios.values()),
        "wall_seconds": round(sum(r.wall_seconds for r in results), 3),
    }
