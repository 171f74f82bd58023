"""The daemon's memory and CPU on a real-size node, as its own /metrics reports them.

Sizes the DaemonSet's requests and limits (deploy/base/daemonset.yaml).

    .venv/bin/python bench/footprint.py [--seconds 60] [--modules 250] [--dep-lines 6000]

The node: a temp-dir host root with ``--modules`` loaded modules in sysfs (the
RDMA stack and nvidia among them), a ``modules.dep`` of ``--dep-lines`` lines
in each of the host, MOFED and GPU driver trees, and
the .ko files the peermem gate reads (bench/gate_latency.py's real-size node). The agent
runs as deployed: ``nodeagent run`` with metrics on, observe mode, a pass every
0.1 s (300x the default rate) and MOFED's ready flag toggled every 0.5 s, so
every pass re-reads the whole node and decisions and records keep flowing.
RSS is sampled from ``nodeagent_process_resident_memory_bytes`` once a second.

Then the CPU of one pass on the same node (issue 50): an agent built in this
process (observe mode, as ``nodeagent run`` builds it, metrics off) makes
``--passes`` passes one after another, each timed with ``time.thread_time``
(the loop thread's CPU, not the wall clock), MOFED's ready flag present (the
gate open: the pass observes, decides and publishes); p50/p99/max printed.
``--profile`` adds where a pass's CPU goes (cProfile, by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import quantiles

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gate_latency import FLAG, build_node, free_port


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def pass_cpu(modules: int, dep_lines: int, passes: int, profile: bool) -> None:
    """Each pass's CPU (the loop thread's), on a freshly built node, gate open."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loaded, lines = build_node(root, modules, dep_lines)
        (root / FLAG).parent.mkdir(parents=True, exist_ok=True)
        (root / FLAG).touch()
        agent = Agent(Config(host_root=str(root), mode="observe", uevents=False))
        try:
            agent.run_pass(["start"])  # the first pass parses the .ko files
            prof = cProfile.Profile() if profile else None
            cpu: list[float] = []
            for _ in range(passes):
                t0 = time.thread_time()
                if prof:
                    prof.enable()
                agent.run_pass(["bench"])
                if prof:
                    prof.disable()
                cpu.append(time.thread_time() - t0)
            gate = agent.gates.published
        finally:
            agent.close()
    q = quantiles(cpu, n=100)
    print(
        f"pass CPU ({passes} passes, {loaded} loaded modules, modules.dep {lines} lines, "
        f"gates published {gate}): p50 {q[49] * 1000:.2f} ms  p99 {q[98] * 1000:.2f} ms  "
        f"max {max(cpu) * 1000:.2f} ms"
    )
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--modules", type=int, default=250)
    ap.add_argument("--dep-lines", type=int, default=6000)
    ap.add_argument("--passes", type=int, default=300, help="passes timed for the pass CPU")
    ap.add_argument("--profile", action="store_true", help="where a pass's CPU goes")
    ap.add_argument("--only-pass-cpu", action="store_true", help="skip the 60 s daemon run")
    args = ap.parse_args()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    if args.only_pass_cpu:
        pass_cpu(args.modules, args.dep_lines, args.passes, args.profile)
        return 0
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loaded, dep_lines = build_node(root, args.modules, args.dep_lines)
        flag = root / FLAG
        flag.parent.mkdir(parents=True, exist_ok=True)
        cfg = root / "agent.toml"
        cfg.write_text("resync_seconds = 0.1\n")
        argv = [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root)]
        argv += ["--config", str(cfg), "--metrics-address", f"127.0.0.1:{port}"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            for _ in range(400):
                try:
                    first = metrics(url)
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                raise SystemExit("the agent never served /metrics")
            rss: list[float] = []
            end = time.monotonic() + args.seconds
            next_toggle = time.monotonic()
            next_sample = time.monotonic() + 1
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_toggle:
                    flag.unlink() if flag.exists() else flag.touch()
                    next_toggle = now + 0.5
                if now >= next_sample:
                    rss.append(metrics(url)["nodeagent_process_resident_memory_bytes"])
                    next_sample = now + 1
                time.sleep(0.01)
            last = metrics(url)
        finally:
            proc.terminate()
            proc.wait(10)
    passes = last.get("nodeagent_pass_duration_seconds_count", 0) - first.get(
        "nodeagent_pass_duration_seconds_count", 0
    )
    cpu = last["nodeagent_process_cpu_seconds_total"] - first["nodeagent_process_cpu_seconds_total"]
    mean_pass = last["nodeagent_pass_duration_seconds_sum"] / max(
        1, last["nodeagent_pass_duration_seconds_count"]
    )
    mib = 2**20
    print(
        f"node: {loaded} loaded modules in sysfs, modules.dep {dep_lines} lines per tree; "
        f"{args.seconds:.0f} s, ready flag toggled every 0.5 s, resync 0.1 s"
    )
    print(f"passes {passes:.0f}, mean pass {mean_pass * 1000:.1f} ms, CPU {cpu:.2f} s")
    start = first["nodeagent_process_resident_memory_bytes"] / mib
    print(
        f"RSS (nodeagent_process_resident_memory_bytes): start {start:.1f} MiB, "
        f"max {max(rss) / mib:.1f} MiB, last {rss[-1] / mib:.1f} MiB"
    )
    pass_cpu(args.modules, args.dep_lines, args.passes, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
