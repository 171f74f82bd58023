"""The metrics endpoint under a fat-header flood, in a real memory cgroup (issue 37).

The finding: 32 connections to the endpoint that each sent ``GET /metrics`` and 99
header lines of 65,000 bytes (never the blank line) took the agent from 30 to 139 MiB,
and in the DaemonSet's 128 MiB memory cgroup the kernel OOM-killed it: every guard gone.

Here, on the real kernel (the sandbox's own cgroup v2 has no memory controller; the
guest's 6.1 has one): a cgroup v2 child with ``memory.max`` = the DaemonSet's limit
(read from ``deploy/base/daemonset.yaml``), the real agent (``python -m nodeagent run``,
observe mode, metrics on 127.0.0.1) started inside it on a healthy simulated node (its
peermem gate open), then 40 fat clients (each trying to send ~6.4 MB of headers, again
and again) and 8 slow ones (lines just under the caps, a few bytes at a time) from this
process, outside the cgroup. Checked: the agent lives, no OOM kill and the cgroup never
reaches its limit (``memory.events``), ``memory.peak`` stays well under it, a scrape and
``/healthz`` are answered during the flood, and the gate reads open before and after as
it did (its lease renewed by the agent's loop throughout). Assertions are on memory;
the waits are hang detectors.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import GateFiles
from nodeagent.sim.node import GATE
from tests.endpoint_flood import FAT_LINE, FAT_LINES, Flood, free_port, get, scraped
from tests.healthy import healthy_node
from tests.waiting import until

pytestmark = pytest.mark.realkernel

REPO = Path(__file__).resolve().parents[2]
CGROOT = Path("/sys/fs/cgroup")
MIB = 2**20
HANG = 300.0  # TCG Python is ~20x slower than native: a hang detector, not a budget


def daemonset_memory_limit() -> int:
    """limits.memory of the nodeagent container, in bytes (``128Mi``)."""
    docs = yaml.safe_load_all((REPO / "deploy/base/daemonset.yaml").read_text())
    ds = next(d for d in docs if d and d.get("kind") == "DaemonSet")
    (ctr,) = (c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "nodeagent")
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", ctr["resources"]["limits"]["memory"])
    assert m, ctr["resources"]["limits"]["memory"]
    return int(m.group(1)) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[m.group(2)]


@contextlib.contextmanager
def memory_cgroup(name: str, limit: int) -> Iterator[Path]:
    """A cgroup v2 child with memory.max = ``limit``; skips (saying why) when it cannot be."""
    mounted = False
    if not (CGROOT / "cgroup.controllers").exists():
        p = subprocess.run(["mount", "-t", "cgroup2", "cgroup2", str(CGROOT)], capture_output=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount cgroup2 on {CGROOT}: {p.stderr.decode().strip()}")
        mounted = True
    cg = CGROOT / name
    try:
        if "memory" not in (CGROOT / "cgroup.controllers").read_text().split():
            pytest.skip(f"no memory controller in {CGROOT}/cgroup.controllers")
        try:
            (CGROOT / "cgroup.subtree_control").write_text("+memory")
            cg.mkdir(exist_ok=True)
            (cg / "memory.max").write_text(str(limit))
            if (cg / "memory.swap.max").exists():
                (cg / "memory.swap.max").write_text("0")
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup {cg}: {exc}")
        yield cg
    finally:
        if cg.exists():
            until(lambda: not (cg / "cgroup.procs").read_text().strip(), "the cgroup empty")
            cg.rmdir()
        if mounted:
            subprocess.run(["umount", str(CGROOT)], capture_output=True)


def answers(port: int) -> bool:
    """A scrape (200, parsed) and /healthz (200) answered; False if refused or reset."""
    try:
        return scraped(port) and get(port, "/healthz")[0] == 200
    except OSError:
        return False


def events(cg: Path) -> dict[str, int]:
    lines = (cg / "memory.events").read_text().split("\n")
    return {k: int(v) for k, v in (ln.split() for ln in lines if ln)}


@pytest.fixture
def cgroup() -> Iterator[tuple[Path, int]]:
    limit = daemonset_memory_limit()
    with memory_cgroup("nodeagent-endpoint-memcg", limit) as cg:
        yield cg, limit


def test_a_fat_header_flood_keeps_the_agent_alive_in_its_memory_cgroup(
    cgroup: tuple[Path, int], tmp_path: Path
) -> None:
    cg, limit = cgroup
    root = tmp_path / "node"
    healthy_node(root).kernel.uevent_source.close()
    port = free_port()
    agent_argv = [
        sys.executable, "-m", "nodeagent", "run", "--host-root", str(root), "--mode", "observe",
        "--metrics-address", f"127.0.0.1:{port}",
    ]  # fmt: skip
    # Into the cgroup before exec: everything the agent ever charges is charged there.
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["sh", "-c", enter, str(cg), *agent_argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    gates = GateFiles(HostRoot(root), "run/nodeagent")

    def state(what: str) -> str:
        rc = proc.poll()
        alive = "alive" if rc is None else f"exited {rc}" + (" (SIGKILL)" if rc == -9 else "")
        peak = int((cg / "memory.peak").read_text()) if (cg / "memory.peak").exists() else -1
        return (
            f"{what}: agent {alive}; memory.events {events(cg)}, memory.peak "
            f"{peak / MIB:.1f} MiB; its output: {log.read_text()[-1500:]!r}"
        )

    try:
        until(lambda: (root / GATE).exists(), "the agent publishing the peermem gate", HANG)
        until(lambda: scraped(port), "the endpoint answering a scrape", HANG)
        agent = psutil.Process(proc.pid)
        assert str(proc.pid) in (cg / "cgroup.procs").read_text().split()
        before_gate = gates.read("peermem")
        assert before_gate.is_open, before_gate.reason
        assert get(port, "/healthz")[0] == 200
        current0 = int((cg / "memory.current").read_text())
        rss0 = agent.memory_info().rss
        if (cg / "memory.peak").exists():  # 5.19+; reset by nothing: this cgroup is new
            peak_of = lambda: int((cg / "memory.peak").read_text())  # noqa: E731
        else:
            peak_of = lambda: int((cg / "memory.current").read_text())  # noqa: E731
        events0 = events(cg)

        rss_peak = [rss0]
        cg_peak = [current0]
        gate_open, gate_reads = [0], [0]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                try:
                    rss_peak[0] = max(rss_peak[0], agent.memory_info().rss)
                except psutil.Error:
                    return  # the agent is gone: the test says how
                cg_peak[0] = max(cg_peak[0], int((cg / "memory.current").read_text()))
                gate_reads[0] += 1
                gate_open[0] += gates.read("peermem").is_open
                done.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        fat = 40
        with Flood(port, fat=fat, slow=8) as flood:
            until(
                lambda: (
                    flood.attempted >= fat * FAT_LINES * len(FAT_LINE) or proc.poll() is not None
                ),
                "the fat clients trying to send ~6.4 MB each",
                HANG,
            )
            assert answers(port), state("a scrape and /healthz during the flood")
            connections = flood.connections
        done.set()
        sampler.join(HANG)

        assert proc.poll() is None, state("after the flood")
        ev = events(cg)
        peak = max(peak_of(), cg_peak[0])
        # Open means a live lease: the agent's loop renewed it within the last 3 s.
        after_gate = gates.read("peermem")
        assert answers(port), state("a scrape and /healthz after the flood")
        print(
            f"memory.max {limit / MIB:.0f} MiB; before the flood memory.current "
            f"{current0 / MIB:.1f} MiB, agent RSS {rss0 / MIB:.1f} MiB; under {connections} "
            f"flood connections ({flood.attempted / MIB:.0f} MiB of headers tried): "
            f"memory.peak {peak / MIB:.1f} MiB, agent RSS peak {rss_peak[0] / MIB:.1f} MiB; "
            f"memory.events {ev}; gate read open {gate_open[0]}/{gate_reads[0]} times during "
            f"the flood, before: {before_gate.reason}; after: {after_gate.reason}"
        )
        assert ev.get("oom_kill", 0) == events0.get("oom_kill", 0) == 0, ev
        assert ev.get("oom", 0) == 0 and ev.get("max", 0) == events0.get("max", 0), ev
        # Under the limit with margin: the flood adds a few MiB at most (the endpoint's
        # bound is ~3 MiB of requests); half the limit is far above what the agent uses.
        assert peak < limit // 2, f"memory.peak {peak / MIB:.1f} MiB"
        assert rss_peak[0] - rss0 < 16 * MIB, f"RSS {rss0 / MIB:.1f} -> {rss_peak[0] / MIB:.1f}"
        assert after_gate.is_open == before_gate.is_open, (before_gate, after_gate)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)
