"""``nodeagent simulate [SCENARIO|all] [--without-agent] [--compare [--lanes]] [--speed X]``.

(and ``--seed N``, ``--deployment-mode M``, ``--json``). Replays the seed incidents on
a simulated node (a temp host root, a
simulated kernel, the MOFED and GPU driver containers as actors) and, unless
``--without-agent``, with the real agent running its own loop next to them in
enforce mode. ``--compare`` runs each scenario three ways (without the agent, with
it as shipped, with the peermem hold: the same operator settings, ``<mode>-hold``)
and prints one summary matrix of the verdicts; ``--lanes`` adds each scenario's
timelines side by side. Exit 0 when the simulation ran (whatever the
verdicts), 1 when the simulation itself failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nodeagent.sim.clock import SimError
from nodeagent.sim.modes import MODES, shipped_and_hold
from nodeagent.sim.scenarios import SCENARIOS, RunResult, run_scenario

__all__ = ["DEFAULT_SPEED", "simulate_main"]

# Seed-seconds per wall second: 10 minutes of an incident in one second. Every
# scenario twice (--compare, 2.6 seed-hours) then takes ~16 s of pacing; the
# timeline itself does not depend on the speed (the virtual clock only moves
# when the node and the agent are quiet).
DEFAULT_SPEED = 600.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nodeagent simulate",
        description="Replay the seed incidents on a simulated node, without and with the agent.",
    )
    p.add_argument(
        "scenario",
        nargs="?",
        default="all",
        choices=[*SCENARIOS, "all"],
        help="which incident (default: all)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--without-agent", action="store_true", help="only the run without nodeagent")
    mode.add_argument(
        "--compare",
        action="store_true",
        help="without the agent, with it as shipped and with the peermem hold: one summary "
        "matrix of the verdicts",
    )
    p.add_argument(
        "--lanes",
        action="store_true",
        help="with --compare: also each scenario's timelines side by side, between the summary "
        "and its repeat",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=DEFAULT_SPEED,
        help=f"seed-seconds per wall second (default {DEFAULT_SPEED:g}; 0: as fast as possible)",
    )
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument(
        "--deployment-mode",
        choices=list(MODES),
        help="run every scenario in this deployment mode (default: each seed's own; "
        "see deploy/README.md); with --compare, the mode as shipped and its -hold",
    )
    p.add_argument(
        "--timeline-html",
        metavar="DIR",
        help="write each with-agent run's recorded timeline as DIR/<scenario>.html "
        "(with --compare, the hold's as DIR/<scenario>.hold.html)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (schema v2)")
    return p


MAX_SPEED = 1e6  # seed-seconds per wall second; beyond it the pacing means nothing


def simulate_main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    if not 0 <= args.speed <= MAX_SPEED:  # also refuses nan and inf
        parser.print_usage(sys.stderr)
        print(
            f"nodeagent simulate: error: --speed must be within 0..{MAX_SPEED:g}, "
            f"got {args.speed!r}",
            file=sys.stderr,
        )
        return 2
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    speed = args.speed or None
    try:
        return _run(args, names, speed)
    except BrokenPipeError:  # `| head`: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _plan(args: argparse.Namespace, name: str) -> list[tuple[bool, str | None]]:
    """The runs of one scenario: (with the agent?, deployment mode; None: the seed's own).
    ``--compare``: without the agent and with it as shipped, in the mode as shipped, then
    with the hold (``<mode>-hold``) where that mode has one."""
    if not args.compare:
        return [(not args.without_agent, args.deployment_mode)]
    shipped, hold = shipped_and_hold(args.deployment_mode or SCENARIOS[name].mode)
    return [(False, shipped), (True, shipped), *([(True, hold)] if hold else [])]


def _run(args: argparse.Namespace, names: list[str], speed: float | None) -> int:
    from nodeagent.sim.render import render_compare, render_run, render_summary, to_json

    results: list[RunResult] = []
    lanes: list[str] = []
    progress = args.compare and not args.json and sys.stderr.isatty()
    try:
        for name in names:
            if progress:
                print(f"simulating {name} …", file=sys.stderr, flush=True)
            runs = [
                run_scenario(SCENARIOS[name], agent=agent, seed=args.seed, speed=speed, mode=mode)
                for agent, mode in _plan(args, name)
            ]
            results += runs
            if args.timeline_html:
                for i, r in enumerate(x for x in runs if x.agent):
                    _write_timeline(args.timeline_html, r, ".hold" if i else "")
            if args.json:
                continue
            if not args.compare:
                print(render_run(runs[0]), flush=True)
            elif args.lanes:
                lanes.append(render_compare(*runs[:2]))
                lanes += [render_run(r) for r in runs[2:]]
    except SimError as exc:
        print(f"nodeagent simulate: error: {exc}", file=sys.stderr)
        return 1
    doc = to_json(results, seed=args.seed, speed=speed)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    if args.compare:
        summary = render_summary(doc, scenario=args.scenario, lanes=args.lanes)
        print(summary)
        if lanes:
            print("", *lanes, summary, sep="\n")
    total = sum(r.wall_seconds for r in results)
    print(f"({len(results)} run(s), seed {args.seed}, speed {args.speed:g}: {total:.1f} s)")
    return 0


def _write_timeline(directory: str, r: RunResult, suffix: str = "") -> None:
    """The agent's records of this run, drawn like ``nodeagent timeline --format html``."""
    from nodeagent.sim.render import clock_at
    from nodeagent.timeline_view import build_picture, render_html

    pic = build_picture(r.agent_records, since=0.0, until=r.scenario.duration)
    title = f"{r.scenario.name} (seed {', '.join(r.scenario.seeds)}), mode {r.mode.name}"
    page = render_html(pic, lambda t: clock_at(r.scenario.clock, t), title)
    os.makedirs(directory, exist_ok=True)
    with open(
        os.path.join(directory, f"{r.scenario.name}{suffix}.html"), "w", encoding="utf-8"
    ) as fh:
        fh.write(page)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(simulate_main(sys.argv[1:]))
