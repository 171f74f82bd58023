"""The fanotify hold: ready flag -> a held peermem load goes on; and what the mark costs.

    .venv/bin/python bench/hold_latency.py [--trials 50] [--opens 100000] [--only compile]

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
3. A compile under the mark, each against the same build unmarked, the arms
   alternating (each first in turn, after one warm-up build), ``--rounds``
   rounds, the medians' ratio and the events the responder answered (a fresh
   group and responder each round: every first open paid again):
   - a real out-of-tree kernel module built against real kernel headers, as a
     driver container builds one: the headers the real-kernel suite downloads
     (``tests/realkernel/setup.py``, ``~/.cache/nodeagent-realkernel``) copied
     onto the marked filesystem, ``make -C <headers> M=<dir> modules``;
   - ``gcc -c`` of ``--objects`` files, each including ``--headers`` of
     ``--pool`` headers, one ``gcc`` after another from one shell (as kbuild
     does per object): many distinct files, each opened first once.
4. The same opens (``--busy-opens`` of them) while this process (standing for
   the agent) is busy in Python in another thread, holding the GIL as a long
   pass does: the thread responder waits for the GIL at each open, the
   process apart does not.

Needs root (mount, fanotify) and host PIDs; says so and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.guards.peermem.budget import descriptor_budget
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.side import PeermemHold
from nodeagent.guards.peermem.start import sees_host_pids, spawner
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.sim.node import READY, Node
from nodeagent.sim.scenarios import stack_node

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gate_latency import DEP_LINES, filler_dep, sysfs_module  # the bench beside

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
    """The node's layout as the DaemonSet sees it: ``/run`` a tmpfs (status, gate files),
    ``/var/lib`` on the disk this bench runs from (memory, timeline), and the driver's
    root a tmpfs of its own (the marked filesystem)."""
    run = root / "run"
    run.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench-run", str(run)], check=True)
    driver = run / "nvidia/driver"
    driver.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "nodeagent-bench", str(driver)], check=True)
    node = stack_node(root, KVER)  # the GPU tree is installed into the tmpfs
    pad_to_real_size(root, node)
    return node


REAL_LOADED = 250  # modules loaded on a GPU node (lsmod | wc -l, give or take)


def pad_to_real_size(root: Path, node: Node) -> tuple[int, int]:
    """A real node's size: ``REAL_LOADED`` modules in sysfs (fillers, every fourth held by
    the next, as bench/gate_latency.py builds them) and ``DEP_LINES`` more lines in each
    tree's modules.dep (host, MOFED's, the GPU driver's); (loaded, lines of the largest)."""
    sys_module = root / "sys/module"
    have = len(list(sys_module.iterdir())) if sys_module.is_dir() else 0
    fillers = max(0, REAL_LOADED - have)
    for i in range(fillers):
        holders = (f"host_mod{i + 1}",) if i % 4 == 0 and i + 1 < fillers else ()
        sysfs_module(root, f"host_mod{i}", f"{i:023X}", holders)
    longest = 0
    for tree in ("host", "mofed", "gpu"):
        dep = Path(getattr(node, f"{tree}_moddir")) / "modules.dep"
        old = dep.read_text() if dep.is_file() else ""
        lines = [*old.splitlines(), *filler_dep(f"pad{tree}", DEP_LINES)]
        dep.parent.mkdir(parents=True, exist_ok=True)
        dep.write_text("\n".join(lines) + "\n")
        longest = max(longest, len(lines))
    return have + fillers, longest


# MOFED's container and the GPU driver's, as a process of their own: the loader is
# started and its exit seen, and the ready flag created as ``touch`` does (open O_CREAT,
# then utimensat, then close: three inotify events, the loop woken by the first), by a
# process that does not share the agent's GIL (the bench's thread would see the exit only
# when the loop's pass let go of the interpreter, and time that too). Its times are
# CLOCK_MONOTONIC: one clock for every process. The flag is created once the bench's
# thread is blocked reading the answer (its ``/proc/.../syscall``: ``read`` on that pipe):
# until then it shares the agent's GIL, and the pass woken by the flag handed the GIL back
# and forth with it (up to 0.5 ms, seen with ``perf sched``); on a node no other thread of
# the agent's process runs when MOFED's flag appears.
STOPWATCH = """
import json, os, select, subprocess, sys, time
loader = json.loads(sys.argv[1])
flag, reader, reader_fd = sys.argv[2:5]
def reading():
    try:
        with open(reader) as f:
            call = f.read().split()
    except OSError:
        return True
    return len(call) > 1 and call[0] == "0" and int(call[1], 16) == int(reader_fd)
for _ in sys.stdin:
    proc = subprocess.Popen(loader, stdout=subprocess.DEVNULL)
    fd = os.pidfd_open(proc.pid)
    print(proc.pid, flush=True)
    sys.stdin.readline()  # held, and the loop idle: touch the flag
    end = time.monotonic() + 1.0
    while not reading() and time.monotonic() < end:
        time.sleep(0.0002)
    t0 = time.monotonic()
    ffd = os.open(flag, os.O_WRONLY | os.O_CREAT | os.O_NOCTTY | os.O_NONBLOCK, 0o644)
    os.utime(ffd)
    os.close(ffd)
    ok = select.select([fd], [], [], 20.0)[0]
    gone = time.monotonic()
    os.close(fd)
    if not ok:
        proc.kill()
    proc.wait()
    print(gone - t0 if ok else -1.0, flush=True)
"""


def latency(root: Path, node: Node, trials: int) -> tuple[list[float], list[float]]:
    """Seconds from the flag to the loader's exit, and the CPU seconds the agent's loop
    thread spent in that time (its pass: less noisy than the wall time on a busy host)."""
    ko = next((root / "run/nvidia/driver").rglob("nvidia-peermem.ko*"))
    modprobe = root.parent / "modprobe"
    shutil.copy("/bin/cat", modprobe)
    pol = PeermemPolicy(hold_loads="fanotify", hold_roots=("run/nvidia/driver",))
    agent = bench_agent(root, node, pol)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)  # the peermem guard's host side: the hold
        wait(lambda: side.hold is not None and agent.passes >= 1, "the hold started")
        return flag_trials(agent, thread, node, [str(modprobe), str(ko)], trials)
    finally:
        agent.stop()
        thread.join(10)


def bench_agent(root: Path, node: Node, pol: PeermemPolicy) -> Agent:
    """The agent on ``root`` (enforce mode, no uevents, no journal, no metrics)."""
    cfg = Config(
        host_root=str(root),
        mode="enforce",
        uevents=False,
        journal=False,
        metrics_address="off",
        policies={"peermem": pol},
    )
    return Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [])


def flag_trials(
    agent: Agent,
    thread: threading.Thread,
    node: Node,
    loader: list[str],
    trials: int,
    held: Callable[[int], bool] | None = None,
) -> tuple[list[float], list[float]]:
    """``trials`` times: ``loader`` started (by the stopwatch) with MOFED's ready flag
    absent, held (and ``held(pid)``, when given, says the agent has what it needs), the
    loop idle; the flag touched; the seconds until the loader's exit and the loop thread's
    CPU seconds in that time. Then the flag removed, and the node at rest again (the gate
    closed, peermem unloaded, no held file, the loop idle) before the next."""
    root = Path(node.root)
    side = agent.side("peermem")
    assert isinstance(side, PeermemHold)
    hold = side.hold
    assert hold is not None and thread.ident is not None
    answer_r, answer_w = os.pipe()  # the stopwatch's answers, read by this thread
    stopwatch = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STOPWATCH,
            json.dumps(loader),
            str(root / READY),
            f"/proc/{os.getpid()}/task/{threading.get_native_id()}/syscall",
            str(answer_r),
        ],
        stdin=subprocess.PIPE,
        stdout=answer_w,
        text=True,
    )
    os.close(answer_w)
    answers = os.fdopen(answer_r)
    assert stopwatch.stdin is not None
    loop_cpu = time.pthread_getcpuclockid(thread.ident)
    out: list[float] = []
    cpu: list[float] = []
    try:
        for _ in range(trials):
            stopwatch.stdin.write("go\n")
            stopwatch.stdin.flush()
            pid = int(answers.readline())  # the loader is started
            wait(lambda p=pid: any(h[0] == p for h in hold.held()), "the loader held")
            if held is not None:
                wait(lambda p=pid, f=held: f(p), "the agent's view of the held load")
            settled(agent)  # the pass its report woke is over: the loop idle, as on a node
            c0 = time.clock_gettime(loop_cpu)
            stopwatch.stdin.write("touch\n")
            stopwatch.stdin.flush()
            took = float(answers.readline())
            if took < 0:
                raise SystemExit("bench: the loader did not exit within 20 s")
            out.append(took)
            cpu.append(time.clock_gettime(loop_cpu) - c0)
            node.remove(READY)  # MOFED restarts: the gate closes again
            wait(lambda: not side.gate_open, "the gate closed again")
            # At rest before the next loader: one started while the agent's own load of
            # peermem (the open pass's) and its unload (the restart's) were in flight was
            # let go at once at 3db85ae and after (1 run in 2 of 30 trials, gate closed).
            wait(lambda: not (root / "sys/module/nvidia_peermem").exists(), "peermem unloaded")
            wait(lambda: not hold.held(), "the held load gone")
            settled(agent)
    finally:
        stopwatch.stdin.close()
        stopwatch.wait(30)
        answers.close()
    return out, cpu


def print_latency(title: str, lat: list[float], cpu: list[float]) -> None:
    ms = [x * 1000 for x in lat]
    print(
        f"{title} (real agent loop, {len(ms)} trials): "
        f"p50 {pct(ms, 0.5):.2f} ms  p99 {pct(ms, 0.99):.2f} ms  max {max(ms):.2f} ms"
    )
    cms = [x * 1000 for x in cpu]
    print(
        f"  the loop thread's CPU in that time: p50 {pct(cms, 0.5):.2f} ms  "
        f"p99 {pct(cms, 0.99):.2f} ms"
    )


def settled(agent: Any, quiet_s: float = 0.05) -> None:
    """Until the loop has waited for an event, with no pass started, for ``quiet_s``: the
    flag then meets an idle loop, as MOFED's does on a node (seconds after the held load)."""
    end = time.monotonic() + 20.0
    while time.monotonic() < end:
        count = agent.passes
        if agent.waiting.wait(1.0) and not agent.stopping.is_set():
            time.sleep(quiet_s)
            if agent.waiting.is_set() and agent.passes == count:
                return
    raise SystemExit("bench: the loop never settled within 20 s")


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
            if how.startswith("apart"):  # "apart": every open answered; "+ignore": as shipped
                ignore = "auto" if how.endswith("+ignore") else "off"
                responder = spawner(group, budget_s=60, ignore_marks=ignore)(budget)
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
        run("apart, ignore marks", opens, "apart+ignore", False)
        run("no mark, agent busy", busy_opens, None, True)
        run("thread, agent busy", busy_opens, "thread", True)
        run("apart, agent busy", busy_opens, "apart", True)
    return out


def cpu_seconds(pid: int | None) -> float:
    """A process's user + system CPU so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compile_tree(top: Path, objects: int, headers: int, pool: int) -> tuple[Path, int]:
    """``inc/`` with ``pool`` headers, ``src/`` with ``objects`` sources each including
    ``headers`` of them (a fixed sample per object: across objects, most of the pool),
    ``obj/`` for the objects, and ``build.sh`` compiling them in turn; (script, how many
    distinct headers some source includes)."""
    inc, src, obj = top / "inc", top / "src", top / "obj"
    for d in (inc, src, obj):
        d.mkdir(parents=True, exist_ok=True)
    for i in range(pool):
        (inc / f"h{i}.h").write_text(
            f"#ifndef H{i}\n#define H{i}\nstruct s{i} {{ int a; long b; }};\n"
            f"static inline int f{i}(int x) {{ return x * {i} + 1; }}\n#endif\n"
        )
    used: set[int] = set()
    for j in range(objects):
        picked = sorted(random.Random(j).sample(range(pool), min(headers, pool)))
        used.update(picked)
        includes = "".join(f'#include "h{i}.h"\n' for i in picked)
        (src / f"o{j}.c").write_text(
            f"{includes}int g{j}(int x) {{ return f{picked[0]}(x) + {j}; }}\n"
        )
    script = top / "build.sh"
    script.write_text(
        "set -e\n"
        f'for f in "{src}"/*.c; do\n'
        f'  gcc -O0 -c -I "{inc}" "$f" -o "{obj}/$(basename "$f" .c).o"\n'
        "done\n"
    )
    return script, len(used)


# An out-of-tree module as a driver container builds one (nvidia-peermem is three .c files
# against the kernel's headers): several sources, each including a spread of the kernel's
# headers, built by kbuild (make -C <headers> M=<dir> modules).
KMOD_HEADERS = (
    "linux/module.h linux/slab.h linux/pci.h linux/netdevice.h linux/fs.h",
    "linux/cdev.h linux/interrupt.h linux/dma-mapping.h linux/mm.h linux/scatterlist.h",
    "linux/device.h linux/uaccess.h linux/workqueue.h linux/mmu_notifier.h linux/pagemap.h",
    "linux/skbuff.h linux/etherdevice.h linux/ethtool.h linux/if_vlan.h linux/vmalloc.h",
    "linux/hugetlb.h linux/blkdev.h linux/timer.h linux/kthread.h linux/crypto.h",
    "linux/random.h linux/highmem.h linux/sched/mm.h linux/seq_file.h linux/proc_fs.h",
)
KMOD_NAME = "bench_peer"


def kernel_headers() -> tuple[str, Path] | None:
    """(kver, the extracted headers' root) the real-kernel suite downloaded
    (``tests/realkernel/setup.py``: ``~/.cache/nodeagent-realkernel``), or None."""
    cache = Path(os.environ.get("NODEAGENT_REALKERNEL_CACHE", "~/.cache/nodeagent-realkernel"))
    for ready in sorted(cache.expanduser().glob("k/*/ready.json"), reverse=True):
        info = json.loads(ready.read_text())
        hdr = ready.parent / "hdr"
        if (Path(info["headers"]) / "Makefile").is_file() and hdr.is_dir():
            return str(info["kver"]), hdr
    return None


def kmod_tree(top: Path, kver: str, hdr: Path) -> tuple[Path, int]:
    """The kernel's headers (``linux-headers-<kver>``, its ``-common`` and
    ``linux-kbuild``) copied onto the marked filesystem, and the module's sources
    beside them; (the build script, how many files the headers' tree holds)."""
    dest = top / "hdr"
    shutil.copytree(hdr, dest, symlinks=True)
    headers = dest / "usr/src" / f"linux-headers-{kver}"
    makefile = headers / "Makefile"  # an include of -common's Makefile by absolute path
    makefile.write_text(
        makefile.read_text().replace(str(hdr), str(dest)),
    )
    mod = top / "kmod"
    mod.mkdir()
    objs = []
    for k, names in enumerate(KMOD_HEADERS):
        includes = "".join(f"#include <{h}>\n" for h in names.split())
        body = f"int {KMOD_NAME}_part{k}(void) {{ return {k}; }}\n"
        if k == 0:
            body += (
                f"static int __init m_init(void) {{ return {KMOD_NAME}_part0(); }}\n"
                "static void __exit m_exit(void) {}\n"
                'module_init(m_init);\nmodule_exit(m_exit);\nMODULE_LICENSE("GPL");\n'
            )
        else:
            body = f"int {KMOD_NAME}_part{k}(void);\n" + body
        (mod / f"part{k}.c").write_text(includes + body)
        objs.append(f"part{k}.o")
    (mod / "Kbuild").write_text(f"obj-m := {KMOD_NAME}.o\n{KMOD_NAME}-y := {' '.join(objs)}\n")
    script = top / "kmod.sh"
    script.write_text(
        "set -e\n"
        f'make -s -j1 -C "{headers}" M="{mod}" clean >/dev/null\n'
        f'make -s -j1 -C "{headers}" M="{mod}" modules >"{top}/kmod.log" 2>&1\n'
        f'test -f "{mod}/{KMOD_NAME}.ko"\n'
    )
    files = sum(len(f) for _, _, f in os.walk(dest))
    return script, files


def compile_cost(top: Path, script: Path, rounds: int) -> dict[str, tuple[list[float], list[int]]]:
    """Per arm: seconds per round, and the events the responder answered per round. The
    arms alternate, each first in turn, after one warm-up build: no mark; the mark as the
    agent runs it (the responder apart, ignore marks as this kernel gives them)."""
    budget, _ = descriptor_budget()
    out: dict[str, tuple[list[float], list[int]]] = {}
    per_event: dict[str, list[float]] = {}
    plan = ["no mark", "mark"]
    subprocess.run(["sh", str(script)], check=True)  # a warm-up: caches, the outputs' files
    for r in range(rounds):
        for arm in plan[r % 2 :] + plan[: r % 2]:
            times, events = out.setdefault(arm, ([], []))
            responder = None
            if arm != "no mark":
                group = FanotifyGroup()
                responder = spawner(group, budget_s=60, ignore_marks="auto")(budget)
                group.mark_filesystem(str(top))
            try:
                cpu0 = cpu_seconds(responder.pid) if responder is not None else 0.0
                t = time.perf_counter()
                subprocess.run(["sh", str(script)], check=True)
                times.append(time.perf_counter() - t)
                cpu = cpu_seconds(responder.pid) - cpu0 if responder is not None else 0.0
            finally:
                if responder is not None:
                    responder.stop()  # its last state says what it answered
                    n = sum(responder.counts.values())
                    events.append(n)
                    per_event.setdefault(arm, []).append(cpu / max(n, 1))
                    status = responder.ignore_status() or {}
                    out.setdefault(f"ignore marks {status.get('mode')}", ([], []))
    for arm, xs in per_event.items():
        us = statistics.median(xs) * 1e6
        out.setdefault(f"{arm}: the responder's CPU per event {us:.0f} us", ([], []))
    return out


def print_compile(title: str, arms: dict[str, tuple[list[float], list[int]]]) -> None:
    base = statistics.median(arms["no mark"][0])
    print(title)
    for arm, (times, events) in arms.items():
        if not times:
            print(f"  ({arm})")
            continue
        m = statistics.median(times)
        ev = f"{statistics.median(events):8.0f} events" if events else " " * 15
        each = " ".join(f"{t:.2f}" for t in times)
        print(f"  {arm:<13} {m:7.2f} s  ratio {m / base:.3f}  {ev}  (rounds: {each})")


def compiles(marked: Path, args: argparse.Namespace) -> None:
    """The real module build, then the many-headers gcc load, each on the marked tmpfs."""
    found = kernel_headers()
    if found is None:
        print(
            "kernel module build: no headers (run tests/realkernel/setup.py first: "
            "python -m tests.realkernel.setup); not measured"
        )
    else:
        kver, hdr = found
        top = marked / "usr/src/kmod-bench"
        script, files = kmod_tree(top, kver, hdr)
        arms = compile_cost(top, script, args.rounds)
        print_compile(
            f"out-of-tree module ({len(KMOD_HEADERS)} sources) against linux-headers-{kver} "
            f"({files} files) on the marked filesystem: make -C <headers> M=<dir> modules "
            f"(after make clean), {args.rounds} rounds alternating (medians):",
            arms,
        )
        shutil.rmtree(top, ignore_errors=True)
    top = marked / "usr/src/bench"
    script, used = compile_tree(top, args.objects, args.headers, args.pool)
    arms = compile_cost(top, script, args.rounds)
    print_compile(
        f"gcc -c of {args.objects} objects, each including {args.headers} of {args.pool} "
        f"headers ({used} distinct in all), on the marked filesystem, one gcc after another, "
        f"{args.rounds} rounds alternating (medians):",
        arms,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--opens", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--busy-opens", type=int, default=2_000)
    ap.add_argument("--objects", type=int, default=40)
    ap.add_argument("--headers", type=int, default=400)
    ap.add_argument("--pool", type=int, default=1500)
    ap.add_argument("--only", choices=("latency", "opens", "compile"), default=None)
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
    dep_lines = len((Path(node.gpu_moddir) / "modules.dep").read_text().splitlines())
    print(
        f"# node: {len(list((root / 'sys/module').iterdir()))} modules loaded, modules.dep "
        f"of {dep_lines} lines in each tree (host, MOFED's, the GPU driver's)"
    )
    try:
        if args.only in (None, "latency"):
            lat, cpu = latency(root, node, args.trials)
            print_latency("ready flag -> held load goes on", lat, cpu)
        if args.only in (None, "compile"):
            compiles(root / "run/nvidia/driver", args)
        if args.only not in (None, "opens"):
            return 0
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
        subprocess.run(["umount", "-l", str(root / "run")], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
