"""A driver container's start -> its root marked by the hold; and what the /proc poll costs.

    .venv/bin/python bench/container_mark.py [--trials 50] [--interval 0.1] [--procs 1000]
    .venv/bin/python -m tests.realkernel.vm .venv/bin/python bench/container_mark.py  # 6.1 guest

1. Start -> mark. Each trial starts a container as a runtime does
   (``tests/containerroot.py``: a fresh overlay mounted only in a new mount
   namespace, a pid that ``exec``s from ``unshare`` to
   ``/bin/sh /usr/local/bin/nvidia-driver init``) while the shipped
   ``RootScanner`` polls ``/proc`` every ``--interval`` s with the default
   rules. Timed: the start (``Popen``) and the entrypoint's ``exec`` (its
   command line seen by a 0.5 ms watcher) to the mark in place, read back from
   the kernel's own list of the group's marks (``fdinfo``), not the scanner's
   stamp. exec -> mark is the time the container's own code runs unmarked:
   what must stay below its first ``modprobe`` (seconds in the GPU Operator's
   driver container, which installs the driver first).
2. The poll's cost with ``--procs`` extra processes alive (``sleep``): one
   scan with nothing new (the steady state), and the first scan that reads
   every command line; the steady state's share of one CPU at ``--interval``.

Needs root (mount, fanotify) and an overlay-capable kernel; says so and exits 0
otherwise.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.containerroot

from nodeagent.core.hold import DRIVER_CONTAINER_RULES
from nodeagent.host.containers import RootScanner
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.host.hold import Responder
from tests import containerroot


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def wait_for(pred: object, timeout: float = 10.0, step: float = 0.0005) -> float:
    end = time.perf_counter() + timeout
    while not pred():  # type: ignore[operator]
        if time.perf_counter() > end:
            raise TimeoutError
        time.sleep(step)
    return time.perf_counter()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_to_mark(
    group: FanotifyGroup, lower: Path, top: Path, trials: int
) -> tuple[list[float], list[float]]:
    from_start: list[float] = []
    from_exec: list[float] = []
    for _ in range(trials):
        t0 = time.perf_counter()
        c = containerroot.start(lower, top)
        try:
            t_exec = wait_for(lambda c=c: b"nvidia-driver" in cmdline(c.pid))

            def marked(c: containerroot.Container = c) -> bool:
                try:
                    return os.stat(f"/proc/{c.pid}/root").st_dev in group.marked_devices()
                except OSError:
                    return False

            t_mark = wait_for(marked)
        finally:
            c.stop()
        from_start.append((t_mark - t0) * 1000)
        from_exec.append((t_mark - t_exec) * 1000)
        wait_for(lambda: not group.marked_devices())  # the overlay gone, its mark with it
    return from_start, from_exec


def scan_cost(nprocs: int, interval: float) -> None:
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(nprocs)]
    try:
        time.sleep(0.2)
        total = sum(1 for n in os.listdir("/proc") if n.isdigit())
        firsts: list[float] = []
        steady: list[float] = []
        for _ in range(5):
            s = RootScanner(lambda p: None, set, DRIVER_CONTAINER_RULES, recheck_s=0.0)
            t = time.perf_counter()
            s.scan()  # every pid new: every command line read
            firsts.append((time.perf_counter() - t) * 1000)
            for _ in range(40):
                t = time.perf_counter()
                s.scan()
                steady.append((time.perf_counter() - t) * 1000)
        med = statistics.median(steady)
        print(f"\n/proc poll, {total} processes alive ({nprocs} extra sleep):")
        print(
            f"  first scan (all new, every cmdline read): median {statistics.median(firsts):.2f} ms"
        )
        print(
            f"  steady scan (nothing new):                median {med:.3f} ms, "
            f"p99 {pct(steady, 0.99):.3f} ms ({len(steady)} scans)"
        )
        share = med / 1000 / interval * 100
        print(f"  steady cost at interval {interval} s: {share:.2f} % of one CPU")
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--procs", type=int, default=1000)
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("kernel:", os.uname().release)
    if os.geteuid() != 0:
        print("not root: cannot mount overlays or mark them; nothing measured")
        return 0
    try:
        group = FanotifyGroup()
    except OSError as exc:
        print(f"this kernel refuses a fanotify permission group ({exc}); nothing measured")
        return 0
    with tempfile.TemporaryDirectory(prefix="na-ctr-bench-") as tmp:
        base = Path(tmp)
        if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", tmp]).returncode != 0:
            print("cannot mount a tmpfs; nothing measured")
            return 0
        try:
            lower, top = base / "lower", base / "starts"
            top.mkdir()
            containerroot.build_lower(lower, [shutil.which("cat") or "/bin/cat"])
            responder = Responder(group, gate_open=lambda: True, budget_s=5.0)
            responder.start()
            scanner = RootScanner(
                group.mark_filesystem,
                group.marked_devices,
                DRIVER_CONTAINER_RULES,
                interval_s=args.interval,
            )
            scanner.start()
            try:
                from_start, from_exec = start_to_mark(group, lower, top, args.trials)
            finally:
                scanner.stop()
                responder.stop()
            print(
                f"\ncontainer start -> root marked, {args.trials} starts, "
                f"scan interval {args.interval} s:"
            )
            for name, xs in (
                ("start (Popen) -> mark", from_start),
                ("entrypoint exec -> mark", from_exec),
            ):
                print(
                    f"  {name:24s} p50 {pct(xs, 0.5):7.1f} ms  p99 {pct(xs, 0.99):7.1f} ms  "
                    f"max {max(xs):7.1f} ms"
                )
        finally:
            subprocess.run(["umount", "-l", tmp])
    scan_cost(args.procs, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
