"""A flood of held-class opens against the whole agent, built as ``nodeagent run`` builds it.

Issue 38's acceptance item, end to end: the agent (enforce mode,
``[peermem] hold_loads = "fanotify"``, its hold root a tmpfs mounted under a
healthy simulated host root, MOFED's ready flag absent so the gate is closed)
and 2000 concurrent loader opens of ``nvidia-peermem.ko`` from one "container"
(4 processes of 500 threads named ``modprobe``, one mount namespace of their
own). While they are held: ``/healthz`` answers, another process's open on
the marked filesystem completes, and the opens past the cap are one timeline
record. Then MOFED's ready flag opens the gate and every held open goes on;
without the flag again the gate file is withdrawn. The responder's own
bounds (caps, descriptors) are tests/guards/peermem/test_fanotify_hold.py's part.

In this process, not a subprocess: the daemon's exporters (the metrics endpoint) and
its agent from ``loop.wiring.build_agent``, with the simulated kernel's module
operations, so the gate's peermem load never reaches this host's kernel (a
subprocess would load the simulated ``.ko`` for real).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

from nodeagent.config import Config
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.guards.peermem.budget import HELD_PER_CONTAINER
from nodeagent.host.ports import HostPorts
from nodeagent.loop.exporters import build_exporters
from nodeagent.loop.wiring import build_agent
from nodeagent.sim.node import GATE, READY
from tests.guards.peermem.rig import driver_root, hold_status, of_kind, records, start_flood
from tests.healthy import healthy_node
from tests.waiting import WAIT, until

PROCS, THREADS = 4, 500  # 2000 opens from one container


def free_port() -> int:
    with socket.socket() as s:  # the address parser refuses port 0
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=WAIT) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def test_a_flood_of_held_opens_leaves_the_agent_answering_and_its_gate_working(
    tmp_path: Path,
) -> None:
    root, driver = driver_root(tmp_path)
    agent = flood = thread = exporters = None
    node = None
    try:
        node = healthy_node(root, ready=False)  # the GPU driver's tree lands on the tmpfs
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        other = driver / "not-a-module"
        other.write_bytes(b"other\n")
        port = free_port()
        # The daemon's own parts, in this process: its exporters (the metrics endpoint on
        # loopback) and its agent built by the one composition root. Its module operations
        # are the simulated kernel's: the gate's peermem load must not reach this host's.
        cfg = Config(
            host_root=str(root),
            mode="enforce",
            uevents=False,
            journal=False,
            metrics_address=f"127.0.0.1:{port}",
            policies={
                "peermem": PeermemPolicy(
                    hold_loads="fanotify", hold_roots=("run/nvidia/driver",), hold_containers=()
                )
            },
        )
        exporters = build_exporters(cfg)
        ports = HostPorts(module_ops=node.kernel, kernel_log=lambda m: [])  # type: ignore[arg-type]
        agent = build_agent(cfg, ports, exporters=exporters)
        thread = threading.Thread(target=agent.run, name="nodeagent", daemon=True)
        thread.start()
        timeline = root / "var/lib/nodeagent/timeline.jsonl"

        until(lambda: hold_status(root).get("marked") == ["run/nvidia/driver"], "the hold's start")
        assert not (root / GATE).exists(), "the gate is open without MOFED's ready flag"
        until(lambda: healthz(port) == 200, "the agent's /healthz")  # served after start

        flood = start_flood(tmp_path, ko, PROCS, THREADS)

        over = PROCS * THREADS - HELD_PER_CONTAINER
        (notice,) = until(
            lambda: of_kind(timeline, "hold-over-cap"),
            "the opens past the cap were not recorded",
        )
        assert notice["count"] == over and notice["past_container_cap"] == over
        # While the flood is held: the agent lives and answers.
        assert thread.is_alive() and flood.poll() is None
        assert healthz(port) == 200
        p = subprocess.run(["cat", str(other)], capture_output=True, timeout=WAIT)
        assert p.returncode == 0 and p.stdout == b"other\n"
        # Status is written after the pass's records (one append, then status.json): the
        # pass that recorded the notice may not have written its status yet.
        now = until(
            lambda: (s := hold_status(root)) and s.get("counts", {}).get("over_cap") == over and s,
            "status did not count the opens past the cap",
        )
        assert now["responder"] == "answering" and now["gate_open"] is False
        assert len(now["held"]) == HELD_PER_CONTAINER
        assert now["counts"]["over_cap"] == over

        # MOFED ready: the gate opens, every held open goes on.
        node.write(READY)
        assert flood.wait(WAIT) == 0, "a flood open failed"
        until((root / GATE).exists, "the gate file was not published")
        # MOFED gone again: the gate is withdrawn.
        (root / READY).unlink()
        until(lambda: not (root / GATE).exists(), "the gate file was not withdrawn")
        until(lambda: hold_status(root).get("gate_open") is False, "the hold's gate did not close")

        def held_opens() -> list[object] | None:
            got = [r["ended"] for r in records(timeline) if r.get("kind") == "held-open"]
            return got if len(got) >= HELD_PER_CONTAINER else None

        ended = until(held_opens, "the held opens were not recorded")
        assert ended == ["gate opened"] * HELD_PER_CONTAINER
        kinds = [r.get("kind") for r in records(timeline)]
        assert kinds.count("hold-over-cap") == 1
        assert thread is not None and thread.is_alive() and healthz(port) == 200
    finally:
        if agent is not None and thread is not None:
            agent.stop()  # its group closes: anything pending is allowed
            thread.join(WAIT)
        if exporters is not None:
            exporters.close()
        if flood is not None:
            if flood.poll() is None:
                os.killpg(flood.pid, signal.SIGKILL)
            flood.wait(WAIT)
        if node is not None:
            node.kernel.uevent_source.close()
        subprocess.run(["umount", "-l", str(driver)], capture_output=True)
        shutil.rmtree(root / "run/nvidia", ignore_errors=True)
