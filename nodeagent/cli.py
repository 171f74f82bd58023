"""Command line: ``nodeagent run|check|status|wait|simulate``.

Exit codes: 0 success / every guard ok; 1 a guard is not ok (a gate closed,
storage blocking MOFED ...), a wait timed out or no status exists; 2 a usage
or input error (printed as one line).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from nodeagent import __version__
from nodeagent.config import Config, load_config
from nodeagent.errors import NodeagentError

EXIT_OK, EXIT_NOT_OK, EXIT_USAGE = 0, 1, 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-root", help="the node's root (default: $NODEAGENT_HOST_ROOT or /)")
    p.add_argument("--config", help="TOML config file")


def _gate_names() -> list[str]:
    from nodeagent.core.paths import HostPaths
    from nodeagent.core.registry import build_guards

    return [g.name for g in build_guards({}, HostPaths()) if g.gate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeagent",
        description="Orders kernel-module loads on GPU/RDMA nodes (nvidia_peermem, MOFED).",
    )
    parser.add_argument("--version", action="version", version=f"nodeagent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the daemon: watch the node and reconcile")
    _common(run)
    run.add_argument("--mode", choices=["observe", "enforce"], help="observe (default) or enforce")
    run.add_argument("--once", action="store_true", help="one pass, then exit")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--metrics-address",
        help="HOST:PORT for /metrics, /healthz, /readyz, or 'off' (default 127.0.0.1:9808)",
    )

    check = sub.add_parser("check", help="one observation: every guard's verdict and reasons")
    _common(check)
    check.add_argument("--json", action="store_true", help="machine-readable output")

    status = sub.add_parser("status", help="what the running agent last decided")
    _common(status)
    status.add_argument("--json", action="store_true")

    wait = sub.add_parser("wait", help="block until a gate is open (for init containers)")
    _common(wait)
    wait.add_argument("gate", choices=_gate_names())
    wait.add_argument("--timeout", type=float, default=None, help="seconds (default: forever)")

    sim = sub.add_parser(
        "simulate", help="replay the seed incidents on a simulated node", add_help=False
    )
    sim.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        from nodeagent.sim.cli import simulate_main

        return simulate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = load_config(
            args.config,
            host_root=args.host_root,
            mode=getattr(args, "mode", None),
            metrics_address=getattr(args, "metrics_address", None),
        )
        if args.command == "run":
            return cmd_run(cfg, args.once, args.log_level)
        if args.command == "check":
            return cmd_check(cfg, args.json)
        if args.command == "status":
            return cmd_status(cfg, args.json)
        if args.command == "wait":
            return cmd_wait(cfg, args.gate, args.timeout)
    except NodeagentError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


def cmd_run(cfg: Config, once: bool, log_level: str) -> int:
    from nodeagent.agent import Agent
    from nodeagent.exporters import build_exporters
    from nodeagent.log import setup_logging

    setup_logging(log_level)
    exporters = build_exporters(cfg, once)
    try:
        agent = Agent(cfg, on_record=exporters.on_record, on_pass=exporters.on_pass)

        def on_signal(signum: int, _frame: Any) -> None:
            agent.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        agent.run(once=once)
    finally:
        exporters.close()
    return 0


def cmd_check(cfg: Config, as_json: bool) -> int:
    from nodeagent.core.registry import build_reconciler
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.observe import Observer
    from nodeagent.host.state import StateStore

    host = HostRoot(cfg.host_root)
    reconciler = build_reconciler(cfg.policies, cfg.paths)
    # Read-only use of the daemon's memory, so a stale flag is judged as the daemon would.
    memory, problems = StateStore(host, cfg.paths.state_dir).load_memory(reconciler, read_only=True)
    snap = Observer(host, cfg, reconciler.needs()).observe(time.time())
    rec = reconciler.decide(snap, memory)
    doc = {
        "kernel": snap.kernel,
        "guards": {g: v.to_json() for g, v in rec.verdicts.items()},
    }
    problems = [*problems, *snap.problems]
    if problems:
        doc["problems"] = problems
    if as_json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"kernel {snap.kernel}")
        for p in problems:
            print(f"problem: {p}")
        for guard, v in rec.verdicts.items():
            print(f"{guard}: {v.verdict}")
            for reason in v.reasons:
                print(f"  - {reason}")
    return EXIT_OK if all(v.ok for v in rec.verdicts.values()) else EXIT_NOT_OK


def cmd_status(cfg: Config, as_json: bool) -> int:
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.state import StateStore

    store = StateStore(HostRoot(cfg.host_root), cfg.paths.state_dir)
    try:
        status = store.read_status()
    except (OSError, ValueError) as exc:
        raise NodeagentError(f"{store.status_rel}: unreadable: {exc}") from None
    if status is None:
        print(f"no agent status at {store.status_rel}: nodeagent has not run on this node")
        return EXIT_NOT_OK
    if as_json:
        print(json.dumps(status, indent=2, default=str))
        return EXIT_OK
    age = time.time() - float(status.get("time") or 0)
    print(
        f"nodeagent {status.get('version')} mode={status.get('mode')} "
        f"kernel={status.get('kernel')} last pass {age:.0f}s ago"
    )
    for guard, v in (status.get("guards") or {}).items():
        print(f"{guard}: {v.get('verdict')}")
        for reason in v.get("reasons") or []:
            print(f"  - {reason}")
    for a in status.get("last_actions") or []:
        state = "done" if a.get("performed") else "decided (observe mode)"
        result = "ok" if a.get("ok") else f"failed: {a.get('error')}"
        print(f"last action: {a.get('action')} — {state}, {result}")
    return EXIT_OK


def cmd_wait(cfg: Config, gate: str, timeout: float | None) -> int:
    from nodeagent.host.events import FileWatch, Poke, Waker
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.state import StateStore

    host = HostRoot(cfg.host_root)
    store = StateStore(host, cfg.paths.state_dir)
    rel = store.gate_rel(gate)
    deadline = None if timeout is None else time.monotonic() + timeout
    poke = Poke()
    watch = FileWatch(host.root, [host.path(cfg.paths.state_dir)], poke)
    try:
        waker = Waker([poke])
        while True:
            if host.file_fact(rel).present:
                print(f"{gate} gate is open")
                return EXIT_OK
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                print(f"timed out waiting for the {gate} gate ({rel})", file=sys.stderr)
                return EXIT_NOT_OK
            # Poll every second too, in case the watch was set on a parent that later moved.
            waker.wait(1.0 if left is None else min(1.0, left))
            watch.refresh()
    finally:
        watch.close()
        poke.close()
