"""The agent's own CPU and RSS while nothing happens: gate open (lease beats), with and
without the node-problem-detector heartbeat.

``nodeagent run`` (observe mode, metrics off) in its own process on the healthy
simulated node, whose peermem gate is open, so the loop renews the gate's lease
every ``RENEW_S``; then the same with ``[npd] enabled``, whose heartbeat is renewed
every ``RENEW_S`` whatever the gate. psutil's CPU time of the process over
``--seconds`` after a settle.

    .venv/bin/python bench/idle.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo's tests/

from tests.healthy import healthy_node  # noqa: E402


def idle(seconds: float, npd: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "node"
        healthy_node(root).kernel.uevent_source.close()
        config = Path(tmp) / "agent.toml"
        config.write_text(f'mode = "observe"\n[npd]\nenabled = {str(npd).lower()}\n')
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "run", "--host-root", str(root), "--config",
             str(config), "--metrics-address", "off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        try:
            time.sleep(5)  # start-up and the first passes
            p = psutil.Process(proc.pid)
            t0 = p.cpu_times()
            time.sleep(seconds)
            t1 = p.cpu_times()
            return t1.user + t1.system - t0.user - t0.system, p.memory_info().rss / 2**20
        finally:
            proc.terminate()
            proc.wait(10)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args(argv)
    print(f"$ .venv/bin/python bench/idle.py {' '.join(argv or sys.argv[1:])}".rstrip())
    for npd in (False, True):
        cpu, rss = idle(args.seconds, npd)
        what = "gate open, [npd] enabled" if npd else "gate open"
        print(f"{what}: CPU {cpu:.3f} s over {args.seconds:.0f} s, RSS {rss:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
