"""The metrics endpoint under slowloris and fat-header floods: the agent's RSS, threads, gate p99.

The real agent (``nodeagent run``, observe mode, its own process) on the healthy
simulated node, metrics on loopback. Twice in one run, idle and then with
``--clients`` slow clients that each send half a request and then a byte a
second, reconnecting whenever the agent closes them:

- the agent's RSS and thread count (psutil);
- the gate's latency: MOFED's ready flag created -> ``peermem.gate`` published
  (after the flag is removed and the gate withdrawn), ``--trials`` times, p50/p99;
- ``/healthz`` asked ``--probes`` times: answered, or refused at the cap.

Then the fat-header flood (issue 37): ``--fat`` clients that each send ``GET /metrics``
and 99 header lines of 65,000 bytes, never the blank line (~6.4 MB a connection,
reconnecting whenever the agent cuts them off) and ``--fat-slow`` clients that send
lines just under the caps a little at a time. The agent's RSS before, its peak during
(sampled every 5 ms) and after, with how many bytes the clients tried to send.

    .venv/bin/python bench/endpoint.py [--clients 2000] [--trials 30] [--fat 40]
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo's tests/

from nodeagent.sim.node import GATE, READY  # noqa: E402
from tests.endpoint_flood import FAT_LINE, FAT_LINES, Flood  # noqa: E402
from tests.healthy import healthy_node  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(pred: object, timeout: float = 30.0) -> float:
    t0 = time.perf_counter()
    while not pred():  # type: ignore[operator]
        if time.perf_counter() - t0 > timeout:
            raise SystemExit("timed out")
        time.sleep(0.0005)
    return time.perf_counter() - t0


class Slowloris:
    """``n`` slow clients kept connected (reconnected when the agent closes one)."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.socks: list[socket.socket] = []
        self.failed = 0  # connection attempts that timed out or were refused
        self.established = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            self.established += 1
            return s
        except OSError:
            self.failed += 1
            return None

    def _run(self) -> None:
        while not self.stop.is_set():
            alive = []
            for s in self.socks:
                try:
                    s.send(b"X")
                    alive.append(s)
                except OSError:  # closed by the agent: connect again
                    s.close()
            for _ in range(min(500, self.n - len(alive))):  # a few hundred a second
                if self.stop.is_set():
                    break
                s = self._connect()
                if s is not None:
                    alive.append(s)
            self.socks = alive
            self.stop.wait(1.0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            s.close()


def measure(root: Path, agent: psutil.Process, port: int, trials: int, probes: int) -> str:
    took = []
    for _ in range(trials):
        (root / READY).unlink()
        wait(lambda: not (root / GATE).exists())
        (root / READY).touch()
        took.append(wait(lambda: (root / GATE).exists()))
    answered = 0
    for _ in range(probes):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                answered += r.status in (200, 503)
        except OSError:
            pass
        time.sleep(0.05)
    q = statistics.quantiles(took, n=100)
    return (
        f"RSS {agent.memory_info().rss / 2**20:.1f} MiB, {agent.num_threads()} threads; "
        f"gate p50 {statistics.median(took) * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms; "
        f"/healthz answered {answered}/{probes}"
    )


def fat_flood(root: Path, agent: psutil.Process, port: int, args: argparse.Namespace) -> None:
    """The fat-header flood: RSS before, its peak during, after."""
    rss = lambda: agent.memory_info().rss / 2**20  # noqa: E731
    before = rss()
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    per_client = FAT_LINES * len(FAT_LINE)
    with Flood(port, fat=args.fat, slow=args.fat_slow) as flood:
        t0 = time.monotonic()
        wait(lambda: flood.attempted >= args.fat * per_client, timeout=300)
        during = measure(root, agent, port, args.trials, args.probes)
        seconds = time.monotonic() - t0
    done.set()
    sampler.join(10)
    print(
        f"fat-header flood: {args.fat} clients x {FAT_LINES} header lines of "
        f"{len(FAT_LINE):,} bytes ({per_client / 1e6:.1f} MB a connection, never the blank "
        f"line) + {args.fat_slow} slow clients; {flood.connections} connections, "
        f"{flood.attempted / 2**20:.0f} MiB of headers tried in {seconds:.1f} s"
    )
    print(f"  RSS before {before:.1f} MiB, peak during {peak[0]:.1f} MiB (+{peak[0] - before:.1f})")
    print(f"  during: {during}")
    time.sleep(6)  # past the request deadline: what is given back
    print(f"  after: {measure(root, agent, port, args.trials, args.probes)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--fat", type=int, default=40, help="fat-header clients (0: none)")
    ap.add_argument("--fat-slow", type=int, default=8, help="slow clients just under the caps")
    args = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.clients + 1024)), hard))
    print(f"$ .venv/bin/python bench/endpoint.py {' '.join(argv or sys.argv[1:])}".rstrip())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "node"
        healthy_node(root).kernel.uevent_source.close()
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root), "--mode",
             "observe", "--metrics-address", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        try:
            wait(lambda: (root / GATE).exists())
            agent = psutil.Process(proc.pid)
            print(f"idle: {measure(root, agent, port, args.trials, args.probes)}")
            if args.clients:
                flood = Slowloris(port, args.clients)
                flood.thread.start()
                time.sleep(3)
                time.sleep(5)
                print(
                    f"{args.clients} slowloris clients ({flood.established} connections "
                    f"made, {flood.failed} connects timed out at a full backlog): "
                    f"{measure(root, agent, port, args.trials, args.probes)}"
                )
                flood.close()
                time.sleep(6)  # past the request deadline: what is given back
                print(f"after: {measure(root, agent, port, args.trials, args.probes)}")
            if args.fat:
                fat_flood(root, agent, port, args)
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
