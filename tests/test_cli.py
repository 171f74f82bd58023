"""The commands as an operator runs them: real processes, real inotify, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodeagent.cli import main
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import GateFiles

PY = sys.executable


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "nodeagent", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (tmp_path / "sys/module").mkdir(parents=True)
    return tmp_path


def test_check_json_schema_on_a_node_without_gpu_stack(root: Path) -> None:
    p = run_cli("check", "--host-root", str(root), "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["kernel"] == "6.1.0-test"
    peermem = doc["guards"]["peermem"]
    assert peermem["verdict"] == "closed"
    assert isinstance(peermem["reasons"], list) and all(
        isinstance(r, str) for r in peermem["reasons"]
    )
    assert "nvidia is not loaded" in peermem["reasons"]
    assert isinstance(peermem["evidence"], dict)


def test_run_once_observe_publishes_status_and_no_gate(root: Path) -> None:
    p = run_cli("run", "--once", "--host-root", str(root))
    assert p.returncode == 0, p.stderr
    status = json.loads((root / "run/nodeagent/status.json").read_text())
    assert status["mode"] == "observe" and status["guards"]["peermem"]["verdict"] == "closed"
    assert not (root / "run/nodeagent/peermem.gate").exists()
    # stderr logs are JSON lines
    lines = [json.loads(line) for line in p.stderr.splitlines() if line.strip()]
    assert lines and all("level" in rec and "msg" in rec for rec in lines)
    s = run_cli("status", "--host-root", str(root))
    assert (
        s.returncode == 0 and "peermem: closed" in s.stdout and "nvidia is not loaded" in s.stdout
    )


def test_status_without_agent_says_so(root: Path) -> None:
    s = run_cli("status", "--host-root", str(root))
    assert s.returncode == 1 and "has not run" in s.stdout


def test_sigterm_stops_the_daemon_within_two_seconds(root: Path) -> None:
    proc = subprocess.Popen(
        # No metrics endpoint: a fixed port would collide with concurrent runs.
        [PY, "-m", "nodeagent", "run", "--host-root", str(root), "--metrics-address", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = root / "run/nodeagent/status.json"
        for _ in range(200):
            if status.exists():
                break
            time.sleep(0.05)
        assert status.exists(), "daemon never completed a pass"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=2.0)  # the bound is the promise: TimeoutExpired fails the test
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    kinds = [
        json.loads(line)["kind"]
        for line in (root / "var/lib/nodeagent/timeline.jsonl").read_text().splitlines()
    ]
    assert kinds[0] == "start" and kinds[-1] == "stop"


def test_wait_peermem_returns_when_the_gate_file_appears(root: Path) -> None:
    gate = root / "run/nodeagent/peermem.gate"

    def open_gate() -> None:
        time.sleep(0.3)  # the directory does not exist yet when wait starts
        GateFiles(HostRoot(root), "run/nodeagent").confirm("peermem", time.time())

    t = threading.Thread(target=open_gate)
    t.start()
    rc = main(["wait", "peermem", "--host-root", str(root), "--timeout", "10"])
    t.join()
    assert rc == 0 and gate.exists()


def test_wait_peermem_times_out_with_exit_1(root: Path) -> None:
    p = run_cli("wait", "peermem", "--host-root", str(root), "--timeout", "0.3")
    assert p.returncode == 1 and "timed out" in p.stderr


def test_env_host_root_is_used(root: Path) -> None:
    p = subprocess.run(
        [PY, "-m", "nodeagent", "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "NODEAGENT_HOST_ROOT": str(root)},
        timeout=30,
    )
    assert p.returncode == 1 and "kernel 6.1.0-test" in p.stdout
