"""A driver container's start -> its root marked by the hold; and what noticing costs.

    .venv/bin/python bench/container_mark.py [--trials 50] [--interval 0.1] [--procs 1000]
        [--idle-procs 300] [--execs 25] [--idle-seconds 20] [--settle 11] [--rounds 3]
        [--batch 0.1] [--stream]
    .venv/bin/python -m tests.realkernel.vm .venv/bin/python bench/container_mark.py  # 6.1 guest

1. Start -> mark, both ways of noticing in one run, alternating trial by trial:
   the kernel's exec events (``host/procevents.py``) and the ``--interval``
   poll of ``/proc`` (where the connector refuses). Each trial starts a
   container as a runtime does (``tests/containerroot.py``: a fresh overlay
   mounted only in a new mount namespace, a pid that ``exec``s from
   ``unshare`` to ``/bin/sh /usr/local/bin/nvidia-driver init``) while the
   shipped ``RootScanner`` runs with the default rules. Timed: the start
   (``Popen``) and the entrypoint's ``exec`` (its command line seen by a 0.5 ms
   watcher) to the mark in place, read back from the kernel's own list of the
   group's marks (``fdinfo``), not the scanner's stamp. exec -> mark is the
   time the container's own code runs unmarked: what must stay below its first
   ``modprobe`` (seconds in the GPU Operator's driver container, which installs
   the driver first).
2. The scanner's own CPU at idle, both modes alternating round by round, with
   ``--idle-procs`` extra processes alive (``sleep``) and ``--execs`` execs a
   second (a shell loop of ``/bin/true``, started by the bench): the scanner
   thread's CPU from ``/proc/self/task/<tid>/schedstat`` over ``--idle-seconds``
   after ``--settle`` s (every process is young for ``recheck_s`` = 10 s after
   the scanner starts), as CPU-s per minute. No root is marked in this part.
3. One poll scan's cost with ``--procs`` extra processes alive (``sleep``): one
   scan with nothing new (the steady state), and the first scan that reads
   every command line; the steady state's share of one CPU at ``--interval``.

Needs root (mount, fanotify) and an overlay-capable kernel; says so and exits 0
otherwise. Where the connector refuses, only the poll is measured (said).
"""

from __future__ import annotations

import argparse
import os
import random
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
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.roots import RootScanner
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.host.procevents import ConnectorRefused, ExecEvents
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


MODES = ("exec events", "poll")


def scanner_for(
    mode: str, group: FanotifyGroup | None, interval: float, batch: float | None = None
) -> RootScanner:
    """A started scanner noticing by ``mode``, once it has chosen (an exec-events scanner
    whose connector refuses raises ``ConnectorRefused``)."""
    s = RootScanner(
        group.open_root if group is not None else (lambda p: None),
        group.marked_devices if group is not None else set,
        DRIVER_CONTAINER_RULES,
        interval_s=interval,
        exec_events=ExecEvents if mode == "exec events" else None,
        batch_s=batch,
    )
    s.start()
    wait_for(lambda: s.mode != "starting")
    if mode == "exec events" and s.mode != "exec events":
        s.stop()
        raise ConnectorRefused(s.mode)
    return s


def start_to_mark(
    group: FanotifyGroup,
    lower: Path,
    top: Path,
    trials: int,
    modes: tuple[str, ...],
    interval: float,
    gap: float,
    batch: float | None,
) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
    for i in range(trials * len(modes)):
        mode = modes[i % len(modes)]  # alternating: a drift of the machine hits both
        scanner = scanner_for(mode, group, interval, batch)
        # A start at a random phase of the poll, as on a node where the scanner runs for
        # days (right after its first scan would be the poll's worst case), and after the
        # scanner's first full scans (every command line read: ~0.2 s each in the guest).
        time.sleep(gap + random.uniform(0, interval))
        try:
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
        finally:
            scanner.stop()
        out[mode][0].append((t_mark - t0) * 1000)
        out[mode][1].append((t_mark - t_exec) * 1000)
        wait_for(lambda: not group.marked_devices())  # the overlay gone, its mark with it
    return out


def exec_stream(execs: int) -> subprocess.Popen[bytes]:
    """A shell loop making about ``execs`` execs a second (``/bin/true``, then ``sleep``:
    a builtin sleep would be none, sleep itself is one more)."""
    loop = f"while :; do /bin/true; sleep {2 / execs:.4f}; done"
    return subprocess.Popen(["/bin/sh", "-c", loop])


def thread_cpu_s(tid: int) -> float:
    """A thread's time on a CPU so far (ns precision: schedstat's first field)."""
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def idle_cost(
    modes: tuple[str, ...],
    nprocs: int,
    execs: int,
    seconds: float,
    settle: float,
    rounds: int,
    interval: float,
    batch: float | None,
) -> None:
    procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(nprocs)]
    spawner = exec_stream(execs)
    try:
        counter: ExecEvents | None = ExecEvents() if "exec events" in modes else None
    except ConnectorRefused:
        counter = None
    results: dict[str, list[float]] = {m: [] for m in modes}
    try:
        total = sum(1 for n in os.listdir("/proc") if n.isdigit())
        rate: list[float] = []
        for _ in range(rounds):
            for mode in modes:
                scanner = scanner_for(mode, None, interval, batch)
                try:
                    time.sleep(settle)
                    tid = scanner._thread.native_id
                    assert tid is not None
                    if counter is not None:
                        counter.read()
                    c0, t0 = thread_cpu_s(tid), time.perf_counter()
                    time.sleep(seconds)
                    c1, t1 = thread_cpu_s(tid), time.perf_counter()
                    if counter is not None:
                        n = 0
                        while True:
                            pids, _lost = counter.read()
                            if not pids:
                                break
                            n += len(pids)
                        rate.append(n / (t1 - t0))
                finally:
                    scanner.stop()
                results[mode].append((c1 - c0) / (t1 - t0) * 60)
        print(
            f"\nthe scanner's CPU at idle: {total} processes alive ({nprocs} extra sleep), "
            + (f"{statistics.median(rate):.0f} execs/s (counted), " if rate else "")
            + f"{rounds} rounds of {seconds:g} s after {settle:g} s, modes alternating:"
        )
        for mode in modes:
            xs = results[mode]
            print(
                f"  {mode:12s} median {statistics.median(xs):.4f} CPU-s per minute "
                f"(min {min(xs):.4f}, max {max(xs):.4f})"
            )
    finally:
        spawner.kill()
        spawner.wait()
        if counter is not None:
            counter.close()
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


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
    ap.add_argument("--idle-procs", type=int, default=300)
    ap.add_argument("--execs", type=int, default=25, help="execs a second while idle")
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=11.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--start-gap", type=float, default=0.2, help="scanner started -> container start (s)"
    )
    ap.add_argument(
        "--batch",
        type=float,
        default=None,
        help="the scanner's batch_s (exec events; default: --interval, as the agent does)",
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="starts timed under a stream of --execs execs a second (a busy node)",
    )
    args = ap.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print("kernel:", os.uname().release)
    if os.geteuid() != 0:
        print("not root: cannot mount overlays or mark them; nothing measured")
        return 0
    modes = MODES
    try:
        ExecEvents().close()
    except ConnectorRefused as exc:
        print(f"the connector refuses here ({exc}): the poll only")
        modes = ("poll",)
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
            stream = exec_stream(args.execs) if args.stream else None
            try:
                marks = start_to_mark(
                    group,
                    lower,
                    top,
                    args.trials,
                    modes,
                    args.interval,
                    args.start_gap,
                    args.batch,
                )
            finally:
                responder.stop()
                if stream is not None:
                    stream.kill()
                    stream.wait()
            print(
                f"\ncontainer start -> root marked, {args.trials} starts per mode, "
                f"alternating; poll interval {args.interval} s, exec events' batch "
                f"{args.interval if args.batch is None else args.batch} s; "
                + (f"under a stream of {args.execs} execs/s" if args.stream else "no other execs")
                + ":"
            )
            for mode in modes:
                from_start, from_exec = marks[mode]
                for name, xs in (
                    ("start (Popen) -> mark", from_start),
                    ("entrypoint exec -> mark", from_exec),
                ):
                    print(
                        f"  {mode:12s} {name:24s} p50 {pct(xs, 0.5):7.1f} ms  "
                        f"p99 {pct(xs, 0.99):7.1f} ms  max {max(xs):7.1f} ms"
                    )
        finally:
            subprocess.run(["umount", "-l", tmp])
    idle_cost(
        modes,
        args.idle_procs,
        args.execs,
        args.idle_seconds,
        args.settle,
        args.rounds,
        args.interval,
        args.batch,
    )
    scan_cost(args.procs, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
