"""``nodeagent simulate [SCENARIO|all] [--without-agent] [--compare] [--speed X] [--seed N]``.

(and ``--deployment-mode M``, ``--json``). Replays the seed incidents on a simulated
node (a temp host root, a
simulated kernel, the MOFED and GPU driver containers as actors) and, unless
``--without-agent``, with the real agent running its own loop next to them in
enforce mode. ``--compare`` runs each scenario both ways and prints the two
timelines side by side. Exit 0 when the simulation ran (whatever the
verdicts), 1 when the simulation itself failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nodeagent.sim.clock import SimError
from nodeagent.sim.modes import MODES
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
    mode.add_argument("--compare", action="store_true", help="both runs, side by side")
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
        "see deploy/README.md)",
    )
    p.add_argument(
        "--timeline-html",
        metavar="DIR",
        help="write each with-agent run's recorded timeline as DIR/<scenario>.html",
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
    modes = [False, True] if args.compare else [not args.without_agent]
    speed = args.speed or None
    try:
        return _run(args, names, modes, speed)
    except BrokenPipeError:  # `| head`: stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace, names: list[str], modes: list[bool], speed: float | None) -> int:
    from nodeagent.sim.render import render_compare, render_run, to_json

    results: list[RunResult] = []
    try:
        for name in names:
            runs = [
                run_scenario(
                    SCENARIOS[name],
                    agent=agent,
                    seed=args.seed,
                    speed=speed,
                    mode=args.deployment_mode,
                )
                for agent in modes
            ]
            results += runs
            if args.timeline_html:
                for r in runs:
                    if r.agent:
                        _write_timeline(args.timeline_html, r)
            if not args.json:
                text = render_compare(*runs) if args.compare else render_run(runs[0])
                print(text, flush=True)
    except SimError as exc:
        print(f"nodeagent simulate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(to_json(results, seed=args.seed, speed=speed), indent=1))
    else:
        total = sum(r.wall_seconds for r in results)
        print(f"({len(results)} run(s), seed {args.seed}, speed {args.speed:g}: {total:.1f} s)")
    return 0


def _write_timeline(directory: str, r: RunResult) -> None:
    """The agent's records of this run, drawn like ``nodeagent timeline --format html``."""
    from nodeagent.sim.render import clock_at
    from nodeagent.timeline_view import build_picture, render_html

    pic = build_picture(r.agent_records, since=0.0, until=r.scenario.duration)
    title = f"{r.scenario.name} (seed {', '.join(r.scenario.seeds)}), mode {r.mode.name}"
    page = render_html(pic, lambda t: clock_at(r.scenario.clock, t), title)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{r.scenario.name}.html"), "w", encoding="utf-8") as fh:
        fh.write(page)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(simulate_main(sys.argv[1:]))
