"""What a file's first open costs under the hold's mark, step by step.

    .venv/bin/python bench/hold_first_open.py [--files 3000] [--rounds 7] [--compile]

A tmpfs is marked ``FAN_MARK_FILESYSTEM`` + ``FAN_OPEN_PERM`` (the hold's group,
``host/fanotify.FanotifyGroup``) and holds ``--files`` distinct small files, as a
build's headers are. An opener process opens each once (a first open each time:
a fresh group per round, so no ignore mark is left from the last) and times it.

1. **Per step** ("the bare steps"), a responder written out here step by step, in this process,
   timing each step of each event with ``perf_counter_ns``: the ``poll`` return
   to the ``read`` of the group, the parse, the ``readlink`` of the event's
   descriptor, the hold's name check (``core/hold.held_open``), the ``fstat``,
   the 18-byte content check (``pread`` and ``core/hold.could_be_module``), the
   ignore mark (``fanotify_mark`` through ctypes), the response ``write`` and
   the ``close`` of the descriptor. The same syscalls the responder makes, in
   the same order (``IgnoreMarks.add`` then ``respond``).
2. **End to end**: the opener's time per first open with no mark, with the
   mark answered by the responder as the agent runs it (a process of its own,
   ignore marks on: ``guards/peermem/process.spawner``), and answered by the bare
   steps of 1; arms alternate, each first in turn, ``--rounds`` rounds, medians.
3. ``--compile``: the same three arms around ``bench/hold_latency.py``'s gcc
   load (40 objects, each including 400 of 1500 headers): how close the
   responder is to the least any responder making these syscalls costs.

Needs root (mount, fanotify); says so and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import select
import shlex
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nodeagent.core.hold import MODULE_HEAD_BYTES, could_be_module, held_open
from nodeagent.guards.peermem.budget import descriptor_budget
from nodeagent.guards.peermem.start import spawner
from nodeagent.host.fanotify import (
    FAN_MARK_ADD,
    FAN_MARK_EVICTABLE,
    FAN_MARK_IGNORED_MASK,
    FAN_OPEN_PERM,
    READ_SIZE,
    RESPONSE,
    FanotifyGroup,
    parse_events,
)

# Opens each file named on stdin (one a line) once, then prints seconds per open.
OPENER = """
import os, sys, time
files = sys.stdin.read().split()
t = time.perf_counter()
for f in files:
    os.close(os.open(f, os.O_RDONLY))
print((time.perf_counter() - t) / len(files))
"""

STEPS = (
    "read",
    "parse",
    "readlink",
    "held_open",
    "fstat",
    "pread 18 + check",
    "ignore mark",
    "response write",
    "close",
)


def make_files(top: Path, n: int) -> list[str]:
    d = top / "inc"
    d.mkdir()
    files = []
    for i in range(n):
        f = d / f"h{i}.h"
        f.write_text(f"#define H{i} {i}\n")
        files.append(str(f))
    return files


def opener(files: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", OPENER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def run_opener(files: list[str]) -> float:
    p = opener(files)
    out, _ = p.communicate("\n".join(files))
    return float(out)


def stepwise(top: Path, work: Callable[[], float]) -> tuple[dict[str, list[int]], float, int]:
    """Each step's nanoseconds per event (one round of ``work``), what ``work`` returned,
    and how many events one read returned at most."""
    group = FanotifyGroup()
    libc = group._libc
    steps: dict[str, list[int]] = {s: [] for s in STEPS}
    stop = threading.Event()
    most = 0

    def respond() -> None:
        nonlocal most
        poller = select.poll()
        poller.register(group.fd, select.POLLIN)
        flags = FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | FAN_MARK_EVICTABLE
        clock = time.perf_counter_ns
        while not stop.is_set():
            if not poller.poll(50):
                continue
            t0 = clock()
            try:
                buf = os.read(group.fd, READ_SIZE)
            except BlockingIOError:
                continue
            t1 = clock()
            events, _ = parse_events(buf)
            t2 = clock()
            most = max(most, len(events))
            steps["read"].append(t1 - t0)
            steps["parse"].append((t2 - t1) // max(1, len(events)))
            for ev in events:
                a = clock()
                path = os.readlink(f"/proc/self/fd/{ev.fd}")
                b = clock()
                held = held_open(path)
                c = clock()
                st = os.fstat(ev.fd)
                d = clock()
                head = os.pread(ev.fd, MODULE_HEAD_BYTES, 0)
                module = could_be_module(head)
                e = clock()
                if held is None and not module and stat.S_ISREG(st.st_mode):
                    libc.fanotify_mark(group.fd, flags, FAN_OPEN_PERM, ev.fd, None)
                f = clock()
                os.write(group.fd, RESPONSE.pack(ev.fd, 1))
                g = clock()
                os.close(ev.fd)
                h = clock()
                for name, ns in zip(
                    STEPS[2:], (b - a, c - b, d - c, e - d, f - e, g - f, h - g), strict=True
                ):
                    steps[name].append(ns)

    t = threading.Thread(target=respond, daemon=True)
    t.start()
    group.mark_filesystem(str(top))
    try:
        got = work()
    finally:
        stop.set()
        t.join()
        group.close()
    return steps, got, most


def timed(argv: list[str]) -> Callable[[], float]:
    def run() -> float:
        t = time.perf_counter()
        subprocess.run(argv, check=True)
        return time.perf_counter() - t

    return run


def arms(
    top: Path, work: Callable[[], float], rounds: int, bare: Callable[[], float] | None = None
) -> dict[str, list[float]]:
    """``work``'s result per arm, the arms alternating, each first in turn: no mark; the
    responder apart as the agent runs it; the bare steps (``stepwise``, or ``bare``)."""
    budget, _ = descriptor_budget()
    out: dict[str, list[float]] = {}
    plan = ["no mark", "responder apart", "bare steps"]
    for r in range(rounds):
        for arm in plan[r % 3 :] + plan[: r % 3]:
            if arm == "no mark":
                out.setdefault(arm, []).append(work())
            elif arm == "bare steps":
                got = bare() if bare is not None else stepwise(top, work)[1]
                out.setdefault(arm, []).append(got)
            else:
                group = FanotifyGroup()
                responder = spawner(group, budget_s=60, ignore_marks="auto")(budget)
                group.mark_filesystem(str(top))
                try:
                    out.setdefault(arm, []).append(work())
                finally:
                    responder.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also time bench/hold_latency.py's gcc load (40 objects, 400 of 1500 headers)",
    )
    args = ap.parse_args()
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"# machine: {os.cpu_count()} cpus, kernel {os.uname().release}")
    if os.geteuid() != 0:
        print("bench: needs root (mount, fanotify); nothing measured")
        return 0
    top = Path(tempfile.mkdtemp(prefix="nodeagent-bench-first-open-"))
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench", str(top)], check=True)
    try:
        files = make_files(top, args.files)
        run_opener(files)  # warm: the opener's start, the dentries
        steps: dict[str, list[int]] = {s: [] for s in STEPS}
        most = 0

        def opens() -> float:
            return run_opener(files)

        def bare() -> float:
            nonlocal most
            got, per_open, m = stepwise(top, opens)
            most = max(most, m)
            for k, v in got.items():
                steps[k].extend(v)
            return per_open

        ends = arms(top, opens, args.rounds, bare)
        print(
            f"first opens of {args.files} distinct files on a marked tmpfs, one opener, "
            f"{args.rounds} rounds alternating (medians):"
        )
        base = statistics.median(ends["no mark"])
        for arm, xs in ends.items():
            us = statistics.median(xs) * 1e6
            extra = us - base * 1e6
            print(f"  {arm:<16} {us:8.1f} us/open  (+{extra:6.1f} us over the unmarked)")
        print(f"the bare steps, per event (median, p90; at most {most} events a read):")
        for name, ns in steps.items():
            if not ns:
                continue
            med = statistics.median(ns) / 1000
            p90 = sorted(ns)[int(0.9 * len(ns))] / 1000
            print(f"  {name:<18} {med:7.2f} us  p90 {p90:7.2f} us")
        if args.compile:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from hold_latency import compile_tree  # the bench beside

            script, used = compile_tree(top / "build", 40, 400, 1500)
            build = timed(["sh", str(script)])
            build()  # a warm-up: caches, the objects' files
            got = arms(top, build, args.rounds)
            base = statistics.median(got["no mark"])
            print(
                f"gcc -O0 -c of 40 objects, each including 400 of 1500 headers ({used} "
                f"distinct), one after another ({script}), {args.rounds} rounds alternating "
                "(medians):"
            )
            for arm, xs in got.items():
                m = statistics.median(xs)
                each = " ".join(f"{x:.2f}" for x in xs)
                print(f"  {arm:<16} {m:6.2f} s  ratio {m / base:.3f}  (rounds: {each})")
    finally:
        subprocess.run(["umount", "-l", str(top)], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
