"""The fanotify hold: ready flag -> a held peermem load goes on; and what the mark costs.

    .venv/bin/python bench/hold_latency.py [--trials 50] [--opens 100000]

1. The real agent loop (enforce mode, real inotify, ``[peermem] hold_loads =
   "fanotify"``) on a simulated node whose GPU driver root is a tmpfs marked
   ``FAN_MARK_FILESYSTEM``. Each trial starts a loader (a copy of ``cat`` named
   ``modprobe``, outside the mark) on ``nvidia-peermem.ko`` with MOFED's ready
   flag absent, waits until the agent holds it, creates the flag, and times
   flag -> the loader's exit (its open allowed, the file read). Then the flag
   is removed and the agent closes the gate again.
2. A compile-like workload: one process opening and closing ``--opens`` other
   files of the marked filesystem, timed without the mark and with it, the
   responder answering every open in a thread of this process or in a process
   of its own (as the agent runs it), alternating, in one run.
3. The same opens (``--busy-opens`` of them) while this process (standing for
   the agent) is busy in Python in another thread, holding the GIL as a long
   pass does: the thread responder waits for the GIL at each open, the
   process apart does not.

Needs root (mount, fanotify) and host PIDs; says so and exits 0 otherwise.
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
import threading
import time
from pathlib import Path

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.guards.peermem_hold import PeermemHold
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.host.hold import Responder, descriptor_budget, sees_host_pids
from nodeagent.host.responder_apart import spawner
from nodeagent.sim.node import READY, Node
from nodeagent.sim.scenarios import stack_node

KVER = "6.1.0-bench"
OPENER = """
import os, sys, time
files = sys.argv[2:]
n = int(sys.argv[1])
t = time.perf_counter()
for i in range(n):
    os.close(os.open(files[i % len(files)], os.O_RDONLY))
print(time.perf_counter() - t)
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def wait(pred: object, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > end:
            raise SystemExit(f"bench: {what} within {timeout:g} s")
        time.sleep(0.001)


def node_with_marked_driver_root(root: Path) -> Node:
    driver = root / "run/nvidia/driver"
    driver.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench", str(driver)], check=True)
    return stack_node(root, KVER)  # the GPU tree is installed into the tmpfs


def latency(root: Path, node: Node, trials: int) -> list[float]:
    ko = next((root / "run/nvidia/driver").rglob("nvidia-peermem.ko*"))
    modprobe = root.parent / "modprobe"
    shutil.copy("/bin/cat", modprobe)
    pol = PeermemPolicy(hold_loads="fanotify", hold_roots=("run/nvidia/driver",))
    cfg = Config(
        host_root=str(root),
        mode="enforce",
        uevents=False,
        journal=False,
        metrics_address="off",
        policies={"peermem": pol},
    )
    agent = Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [])
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    out: list[float] = []
    try:
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)  # the peermem guard's host side: the hold
        wait(lambda: side.hold is not None and agent.passes >= 1, "the hold started")
        hold = side.hold
        assert hold is not None
        for _ in range(trials):
            proc = subprocess.Popen([str(modprobe), str(ko)], stdout=subprocess.DEVNULL)
            wait(hold.held, "the loader held")
            t0 = time.perf_counter()
            node.write(READY)
            proc.wait(20)
            out.append(time.perf_counter() - t0)
            node.remove(READY)  # MOFED restarts: the gate closes again
            wait(lambda: not side.gate_open, "the gate closed again")
    finally:
        agent.stop()
        thread.join(10)
    return out


def _busy(stop: threading.Event) -> None:
    """Pure-Python work holding the GIL between switches, as a long pass does."""
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def mark_cost(root: Path, opens: int, rounds: int, busy_opens: int) -> dict[str, list[float]]:
    """Seconds per round of each arm, the arms alternating within each round."""
    files_dir = root / "run/nvidia/driver/usr/include"
    files_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(500):  # headers, as a compiler reads them
        f = files_dir / f"h{i}.h"
        f.write_text("#define X 1\n")
        files.append(str(f))
    budget, _ = descriptor_budget()
    out: dict[str, list[float]] = {}

    def run(arm: str, n: int, how: str | None, busy: bool) -> None:
        argv = [sys.executable, "-c", OPENER, str(n), *files]
        responder = None
        stop = threading.Event()
        hog = threading.Thread(target=_busy, args=(stop,), daemon=True)
        if how is not None:
            group = FanotifyGroup()
            if how == "apart":
                responder = spawner(group, budget_s=60)(budget)
            else:
                responder = Responder(group, gate_open=lambda: False, budget_s=60)
                responder.start()
            group.mark_filesystem(str(files_dir))
        try:
            if busy:
                hog.start()
            p = subprocess.run(argv, capture_output=True, text=True, check=True)
            out.setdefault(arm, []).append(float(p.stdout) / n)
        finally:
            stop.set()
            if busy:
                hog.join()
            if responder is not None:
                responder.stop()

    for _ in range(rounds):
        run("no mark", opens, None, False)
        run("thread", opens, "thread", False)
        run("apart", opens, "apart", False)
        run("no mark, agent busy", busy_opens, None, True)
        run("thread, agent busy", busy_opens, "thread", True)
        run("apart, agent busy", busy_opens, "apart", True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--opens", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy-opens", type=int, default=2_000)
    args = ap.parse_args()
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"# machine: {os.cpu_count()} cpus, kernel {os.uname().release}")
    if os.geteuid() != 0 or not sees_host_pids():
        print("bench: needs root and host PIDs (mount, fanotify); nothing measured")
        return 0
    top = Path(tempfile.mkdtemp(prefix="nodeagent-bench-hold-"))
    root = top / "root"
    root.mkdir()
    node = node_with_marked_driver_root(root)
    try:
        lat = latency(root, node, args.trials)
        ms = [x * 1000 for x in lat]
        print(
            f"ready flag -> held load goes on (real agent loop, {len(ms)} trials): "
            f"p50 {pct(ms, 0.5):.2f} ms  p99 {pct(ms, 0.99):.2f} ms  max {max(ms):.2f} ms"
        )
        arms = mark_cost(root, args.opens, args.rounds, args.busy_opens)
        base = statistics.median(arms["no mark"])
        print(
            f"opens of other files on the marked filesystem, one process, {args.rounds} "
            f"rounds alternating ({args.opens} opens per round; {args.busy_opens} while "
            "this process is busy in Python, as the agent in a long pass):"
        )
        for arm, xs in arms.items():
            us = statistics.median(xs) * 1e6
            print(f"  {arm:<22} {us:9.2f} us/open  ({us / (base * 1e6):6.1f}x the unmarked)")
    finally:
        node.kernel.uevent_source.close()
        subprocess.run(["umount", "-l", str(root / "run/nvidia/driver")], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
