"""What a file's first open costs under the hold's mark, step by step.

    .venv/bin/python bench/hold_first_open.py [--files 3000] [--rounds 7]

A tmpfs is marked ``FAN_MARK_FILESYSTEM`` + ``FAN_OPEN_PERM`` (the hold's group,
``host/fanotify.FanotifyGroup``) and holds ``--files`` distinct small files, as a
build's headers are. An opener process opens each once (a first open each time:
a fresh group per round, so no ignore mark is left from the last) and times it.

1. **Per step**, a responder written out here step by step, in this process,
   timing each step of each event with ``perf_counter_ns``: the ``poll`` return
   to the ``read`` of the group, the parse, the ``readlink`` of the event's
   descriptor, the hold's name check (``core/hold.held_open``), the ``fstat``,
   the 18-byte content check (``pread`` and ``core/hold.could_be_module``), the
   ignore mark (``fanotify_mark`` through ctypes), the response ``write`` and
   the ``close`` of the descriptor. The same syscalls the responder makes, in
   the same order (``IgnoreMarks.add`` then ``respond``).
2. **End to end**: the opener's time per first open with no mark, and with the
   mark answered by the responder as the agent runs it (a process of its own,
   ignore marks on: ``host/responder_apart.spawner``); arms alternate, each
   first in turn, ``--rounds`` rounds, medians.

Needs root (mount, fanotify); says so and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from nodeagent.core.hold import MODULE_HEAD_BYTES, could_be_module, held_open
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
from nodeagent.host.hold import descriptor_budget
from nodeagent.host.responder_apart import spawner

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


def stepwise(top: Path, files: list[str]) -> tuple[dict[str, list[int]], float, int]:
    """Each step's nanoseconds per event (one round), the opener's seconds per open, and
    how many events one read returned at most."""
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
                if held is None and not module and st.st_size >= 0:
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
        per_open = run_opener(files)
    finally:
        stop.set()
        t.join()
        group.close()
    return steps, per_open, most


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
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
        ends: dict[str, list[float]] = {}
        most = 0
        budget, _ = descriptor_budget()
        for r in range(args.rounds):
            plan = ["no mark", "responder apart", "stepwise"]
            for arm in plan[r % 3 :] + plan[: r % 3]:
                if arm == "no mark":
                    ends.setdefault(arm, []).append(run_opener(files))
                elif arm == "stepwise":
                    got, per_open, m = stepwise(top, files)
                    most = max(most, m)
                    for k, v in got.items():
                        steps[k].extend(v)
                    ends.setdefault(arm, []).append(per_open)
                else:
                    group = FanotifyGroup()
                    responder = spawner(group, budget_s=60, ignore_marks="auto")(budget)
                    group.mark_filesystem(str(top))
                    try:
                        ends.setdefault(arm, []).append(run_opener(files))
                    finally:
                        responder.stop()
        print(
            f"first opens of {args.files} distinct files on a marked tmpfs, one opener, "
            f"{args.rounds} rounds alternating (medians):"
        )
        base = statistics.median(ends["no mark"])
        for arm, xs in ends.items():
            us = statistics.median(xs) * 1e6
            extra = us - base * 1e6
            print(f"  {arm:<16} {us:8.1f} us/open  (+{extra:6.1f} us over the unmarked)")
        print(f"the stepwise responder, per event (median, p90; at most {most} events a read):")
        for name, ns in steps.items():
            if not ns:
                continue
            med = statistics.median(ns) / 1000
            p90 = sorted(ns)[int(0.9 * len(ns))] / 1000
            print(f"  {name:<18} {med:7.2f} us  p90 {p90:7.2f} us")
    finally:
        subprocess.run(["umount", "-l", str(top)], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
