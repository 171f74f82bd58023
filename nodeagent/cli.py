"""Command line: ``nodeagent run|check|status|wait|timeline|simulate|explain|supervise``.

Exit codes: 0 success / every guard ok; 1 a guard is not ok (a gate closed,
storage blocking MOFED ...), a wait timed out, no status exists or the agent
is not reconciling; 2 a usage or input error (printed as one line); 141 the
reader of our output went away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from nodeagent import __version__
from nodeagent.config import Config, load_config
from nodeagent.errors import NodeagentError

EXIT_OK, EXIT_NOT_OK, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-root", help="the node's root (default: $NODEAGENT_HOST_ROOT or /)")
    p.add_argument("--config", help="TOML config file")


def _gate_names() -> list[str]:
    from nodeagent.core.paths import HostPaths
    from nodeagent.guards.registry import build_guards

    return [g.name for g in build_guards({}, HostPaths()) if g.gate]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    wait.add_argument("--timeout", type=_timeout, default=None, help="seconds (default: forever)")

    tl = sub.add_parser("timeline", help="draw the recorded decisions (lanes over time)")
    _common(tl)
    tl.add_argument("--since", help="30m, 2h, an ISO 8601 time, or epoch seconds")
    tl.add_argument("--format", choices=["text", "html"], default="text")

    explain = sub.add_parser(
        "explain",
        help="name the race in logs you have (kubectl logs, dmesg, journalctl) or in a "
        "support bundle (must-gather, netop-sosreport, sos report)",
    )
    explain.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="log files (a .gz too), directories or .tar[.gz|.xz] bundles (default: stdin)",
    )
    explain.add_argument("--json", action="store_true", help="one JSON object: incidents")
    explain.add_argument(
        "--max-read",
        type=_byte_size,
        metavar="SIZE",
        help="what one bundle or .gz log may give, decompressed (e.g. 64G; default: 200 "
        "times its size on disk, at least 256M, at most 32G)",
    )

    sim = sub.add_parser(
        "simulate", help="replay the seed incidents on a simulated node", add_help=False
    )
    sim.add_argument("rest", nargs=argparse.REMAINDER)
    sup = sub.add_parser(
        "supervise",
        help="the container's first process: runs `nodeagent ARGS...`, restarts it if it "
        "dies unasked, forwards SIGTERM",
        add_help=False,
    )
    sup.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = _main(argv)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at exit
        return rc
    except BrokenPipeError:  # `nodeagent check | head`: the reader left; stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by it would


def _main(argv: list[str]) -> int:
    if argv[:1] == ["supervise"]:  # the container's first process: it runs `nodeagent ARGS`
        from nodeagent.supervise import supervise_main

        return supervise_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from nodeagent.sim.cli import simulate_main

        return simulate_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help/--version (0) or a usage error already printed (2)
        return int(exc.code or 0) if isinstance(exc.code, int | None) else EXIT_USAGE
    if args.command == "explain":  # reads logs, not the node: no config
        return cmd_explain(args.files, args.json, args.max_read)
    try:
        _check_config_file(args.config)
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
        if args.command == "timeline":
            from nodeagent.timeline_view.cli import timeline_main

            return timeline_main(cfg, args.since, args.format)
    except NodeagentError as exc:
        print(f"nodeagent: error: {safe(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # main() stops quietly
    except OSError as exc:  # the node refused what starting needs: one line, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"nodeagent: error: {safe(where)}{safe(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_NOT_OK
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")


def _check_config_file(path: str | None) -> None:
    """A config that is a FIFO would block the read, a directory would confuse it: refuse."""
    if path is None:
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NodeagentError(f"config file {path}: not found") from None
    except OSError as exc:
        raise NodeagentError(f"config file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise NodeagentError(f"config file {path}: not a regular file")


def safe(text: object) -> str:
    """Text from the node, made harmless for a terminal: control characters escaped."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def cmd_run(cfg: Config, once: bool, log_level: str) -> int:
    from nodeagent.host.agentlock import AgentLock
    from nodeagent.host.events import StopOnSignal
    from nodeagent.host.fs import HostRoot
    from nodeagent.log import setup_logging
    from nodeagent.loop.exporters import build_exporters
    from nodeagent.loop.wiring import build_agent

    setup_logging(log_level)
    # One agent per node; the lock is taken before anything is read or written
    # (or a metrics port bound).
    with AgentLock(HostRoot(cfg.host_root)):
        exporters = build_exporters(cfg, once)
        try:
            agent = build_agent(cfg, exporters=exporters)
            with StopOnSignal(agent.stop_on_signal) as signals:
                signals.stop_now = agent.stop
                agent.run(once=once)
        finally:
            exporters.close()
    return 0


def _byte_size(text: str) -> int:
    """``64G``, ``500M``, ``4096``: a positive number of bytes (K, M, G, T: powers of 1024)."""
    shifts = {"K": 10, "M": 20, "G": 30, "T": 40}
    unit = text[-1:].upper()
    number = text[:-1] if unit in shifts else text
    try:
        value = int(float(number) * (1 << shifts.get(unit, 0)))
    except ValueError:
        value = 0
    if value <= 0 or not number.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (like 64G, 500M or 4096)")
    return value


def cmd_explain(files: list[str], as_json: bool, max_read: int | None = None) -> int:
    """Exit 0 whatever was recognised; 2 when no input could be read at all."""
    from nodeagent.explain.files import explain_inputs
    from nodeagent.explain.matcher import Explainer

    ex = Explainer()
    read, problems = explain_inputs(files, ex, max_read)
    for p in problems:
        print(f"nodeagent explain: {safe(p)}", file=sys.stderr)
    if read == 0:
        return EXIT_USAGE
    report = ex.report()
    if as_json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    incidents = report["incidents"]
    print(f"{len(incidents) or 'nothing'} recognised in {report['lines']} lines of {read} input(s)")
    for b in report.get("bundles", []):
        nodes = f"; nodes: {', '.join(map(safe, b['nodes']))}" if b["nodes"] else ""
        print(f"bundle {safe(b['bundle'])} ({b['kind']}): {b['logs']} log file(s){nodes}")
    node = None
    for inc in incidents:
        if inc.get("node") != node:
            node = inc.get("node")
            print(f"\n== node {safe(node)}")
        print(f"\n{inc['kind']}: {inc['title']}")
        for e in inc["evidence"]:
            print(f"  {safe(e['file'])}:{e['line']}: {safe(e['text'])}")
        for note in inc.get("notes", []):
            print(f"  note: {note}")
        print(f"  remedy: {inc['remedy']}")
        if inc["prevented_by"]:
            print(
                f"  nodeagent prevents it in: {', '.join(inc['prevented_by'])} (deploy/README.md)"
            )
        if inc["not_prevented_by"]:
            print(f"  not prevented in: {', '.join(inc['not_prevented_by'])}")
        print(f"  known from: {'; '.join(inc['sources'])}")
    seen = report.get("seen")
    if seen:
        if seen["modules"]:
            print(f"modules mentioned: {', '.join(seen['modules'])}")
        for e in seen["errors"]:
            print(f"error line: {safe(e['file'])}:{e['line']}: {safe(e['text'])}")
        if seen["harmless"]:
            e = seen["harmless"][0]
            print(
                f"harmless: {safe(e['file'])}:{e['line']}: a loaded nvidia-peermem's runtime "
                "message (nv_get_p2p_free_callback), not a load or ordering failure"
            )
    return EXIT_OK


def cmd_check(cfg: Config, as_json: bool) -> int:
    from nodeagent.loop.wiring import check_node
    from nodeagent.timeline import bounded

    snap, rec, problems = check_node(cfg)
    doc = {
        "kernel": snap.kernel,
        "guards": {g: v.to_json() for g, v in rec.verdicts.items()},
    }
    problems = [*problems, *snap.problems]
    if problems:
        doc["problems"] = problems
    if as_json:
        print(json.dumps(bounded(doc), indent=2, default=str))
    else:
        print(f"kernel {safe(snap.kernel)}")
        for p in problems:
            print(f"problem: {safe(p)}")
        for guard, v in rec.verdicts.items():
            print(f"{guard}: {v.verdict}")
            for reason in v.reasons:
                print(f"  - {safe(reason)}")
            for note in v.notes:
                print(f"  note: {safe(note)}")
    return EXIT_OK if all(v.ok for v in rec.verdicts.values()) else EXIT_NOT_OK


def _get(doc: Any, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``doc[key]`` when ``doc`` is an object and the value has the expected type."""
    if isinstance(doc, dict):
        value = doc.get(key)
        if isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind)):
            return value
    return default


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def cmd_status(cfg: Config, as_json: bool) -> int:
    """Print what the agent last decided; exit 1 when it is not reconciling (or never ran).

    Any shape of status.json is read without a traceback: fields of the wrong
    type are shown as unknown.
    """
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.gatefile import GateFiles, stale_reason, when
    from nodeagent.host.state import StateStore

    host = HostRoot(cfg.host_root)
    store = StateStore(host, cfg.paths.state_dir)
    try:
        status = store.read_status()
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise NodeagentError(f"{store.status_rel}: unreadable: {why}") from None
    if status is None:
        print(f"no agent status at {store.status_rel}: nodeagent has not run on this node")
        return EXIT_NOT_OK
    now = time.time()
    last = _get(status, "time", (int, float))
    resync = _get(status, "resync_seconds", (int, float), cfg.resync_seconds)
    if last is None or not math.isfinite(last) or not math.isfinite(resync) or resync <= 0:
        liveness = "agent state unknown: status.json has no valid pass time"
        alive = False
    else:
        stale = stale_reason(float(last), float(resync), now)
        alive = stale is None
        liveness = (
            stale or f"agent reconciling: last pass {max(0.0, now - last):.0f}s ago ({when(last)})"
        )
    gates = GateFiles(host, cfg.paths.state_dir)
    guards = _get(status, "guards", dict, {})
    gate_names = _gate_names()
    if as_json:
        extra = {
            "agent": {"reconciling": alive, "summary": liveness},
            "gate_files": {g: vars(gates.read(g)) for g in gate_names},
        }
        # The agent's document as written, with what this reader found added.
        doc = {**status, **extra} if isinstance(status, dict) else {"status": status, **extra}
        print(json.dumps(doc, indent=2, default=str))
        return EXIT_OK if alive else EXIT_NOT_OK
    print(
        f"nodeagent {safe(_get(status, 'version', str, '?'))} "
        f"mode={safe(_get(status, 'mode', str, '?'))} "
        f"kernel={safe(_get(status, 'kernel', str, '?'))}"
    )
    print(safe(liveness))
    for guard, v in guards.items():
        verdict = f"{safe(guard)}: {safe(_get(v, 'verdict', str, 'unknown'))} (last pass)"
        if guard in gate_names:
            verdict += f"; gate file: {safe(gates.read(guard).reason)}"
        print(verdict)
        for reason in _get(v, "reasons", list, []):
            print(f"  - {safe(reason)}")
        for note in _get(v, "notes", list, []):
            print(f"  note: {safe(note)}")
    for p in _get(status, "problems", list, []):
        print(f"problem: {safe(p)}")
    for guard, steps in _get(status, "plans_in_flight", dict, {}).items():
        for step in steps if isinstance(steps, list) else []:
            print(f"in flight: {safe(str(guard))}: {safe(str(step))}")
    for a in _get(status, "last_actions", list, []):
        state = "done" if _get(a, "performed", bool) else "decided (observe mode)"
        result = "ok" if _get(a, "ok", bool) else f"failed: {safe(_get(a, 'error', str, '?'))}"
        print(f"last action: {safe(_get(a, 'action', str, '?'))} — {state}, {result}")
    return EXIT_OK if alive else EXIT_NOT_OK


def cmd_wait(cfg: Config, gate: str, timeout: float | None) -> int:
    """Exit 0 once the gate file says open and is recent; 1 on timeout (with the last reason)."""
    from nodeagent.host.events import FileWatch, Waker
    from nodeagent.host.fs import HostRoot
    from nodeagent.host.gatefile import GateFiles

    host = HostRoot(cfg.host_root)
    gates = GateFiles(host, cfg.paths.state_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = FileWatch(host.root, [host.path(cfg.paths.state_dir)])
    try:
        waker = Waker([watch])
        while True:
            reading = gates.read(gate)
            if reading.is_open:
                print(f"{gate} gate is {reading.reason}")
                return EXIT_OK
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                print(
                    f"timed out waiting for the {gate} gate: {safe(reading.reason)}",
                    file=sys.stderr,
                )
                return EXIT_NOT_OK
            # Poll every second too: a watch set on a parent that later moved, and a
            # gate going stale, produce no event.
            waker.wait(1.0 if left is None else min(1.0, left))
            watch.refresh()
    finally:
        watch.close()
