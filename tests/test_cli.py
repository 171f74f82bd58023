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
from nodeagent.host.gatefile import RENEW_S, GateFiles
from tests.waiting import WAIT, until

PY = sys.executable


def run_cli(*args: str, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "nodeagent", *args], capture_output=True, text=True, timeout=timeout
    )


def test_check_json_schema_on_a_node_without_gpu_stack(bare_root: Path) -> None:
    p = run_cli("check", "--host-root", str(bare_root), "--json")
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


def test_run_once_observe_publishes_status_and_no_gate(bare_root: Path) -> None:
    p = run_cli("run", "--once", "--host-root", str(bare_root))
    assert p.returncode == 0, p.stderr
    status = json.loads((bare_root / "run/nodeagent/status.json").read_text())
    assert status["mode"] == "observe" and status["guards"]["peermem"]["verdict"] == "closed"
    assert not (bare_root / "run/nodeagent/peermem.gate").exists()
    # stderr logs are JSON lines
    lines = [json.loads(line) for line in p.stderr.splitlines() if line.strip()]
    assert lines and all("level" in rec and "msg" in rec for rec in lines)
    s = run_cli("status", "--host-root", str(bare_root))
    assert (
        s.returncode == 0 and "peermem: closed" in s.stdout and "nvidia is not loaded" in s.stdout
    )


def test_status_without_agent_says_so(bare_root: Path) -> None:
    s = run_cli("status", "--host-root", str(bare_root))
    assert s.returncode == 1 and "has not run" in s.stdout


def test_sigterm_stops_the_daemon_within_two_seconds(bare_root: Path) -> None:
    """Exit 0 and a last "stop" record say the loop itself returned. The deadline here
    only catches the hang (a daemon that ignores SIGTERM sleeps until its resync, an
    hour)."""
    proc = subprocess.Popen(
        # No metrics endpoint: a fixed port would collide with concurrent runs.
        [PY, "-m", "nodeagent", "run", "--host-root", str(bare_root), "--metrics-address", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = bare_root / "run/nodeagent/status.json"
        until(status.exists, "daemon never completed a pass")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=WAIT)  # TimeoutExpired: SIGTERM did not stop it
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0
    kinds = [
        json.loads(line)["kind"]
        for line in (bare_root / "var/lib/nodeagent/timeline.jsonl").read_text().splitlines()
    ]
    assert kinds[0] == "start" and kinds[-1] == "stop"


SLOW_PASS_AGENT = """
import pathlib, sys, time
from nodeagent.cli import main
from nodeagent.loop.agent import Agent

in_pass = pathlib.Path(sys.argv[2])
run_pass = Agent.run_pass


def slow(self, woken_by=()):
    # Every pass after the first lasts 4 s (a loaded node's pass, a slow read).
    if in_pass.parent.joinpath("first").exists():
        in_pass.touch()
        time.sleep(4.0)
    in_pass.parent.joinpath("first").touch()
    return run_pass(self, woken_by)


Agent.run_pass = slow
sys.exit(main(["run", "--host-root", sys.argv[1], "--metrics-address", "off"]))
"""


def test_sigterm_during_a_slow_pass_finishes_it_and_exits_0(
    bare_root: Path, tmp_path: Path
) -> None:
    """A pass in flight when SIGTERM comes is finished, then the loop stops: exit 0, the
    last record "stop". Before: a pass past the 1.5 s grace made it exit 143 (issue 55).
    The deadline only catches the hang."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen(
        [PY, "-c", SLOW_PASS_AGENT, str(bare_root), str(marks / "in-pass")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until((bare_root / "run/nodeagent/status.json").exists, "daemon never completed a pass")
        ready = bare_root / "run/mellanox/drivers/.driver-ready"  # a watched file: a pass
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.touch()
        until((marks / "in-pass").exists, "the second pass never began")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read() if proc.stderr else ""
    kinds = [
        json.loads(line)["kind"]
        for line in (bare_root / "var/lib/nodeagent/timeline.jsonl").read_text().splitlines()
    ]
    assert kinds[-1] == "stop"


def test_wait_peermem_returns_when_the_gate_file_appears(
    bare_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = bare_root / "run/nodeagent/peermem.gate"
    first_read = threading.Event()
    done = threading.Event()
    dir_at_first_read: list[bool] = []
    read = GateFiles.read

    def reading(self: GateFiles, *a: object, **k: object) -> object:
        got = read(self, *a, **k)  # type: ignore[arg-type]
        first_read.set()
        return got

    monkeypatch.setattr(GateFiles, "read", reading)

    def open_gate() -> None:
        # wait has started watching, and read the gate closed, before the directory exists
        if not first_read.wait(WAIT):
            return
        dir_at_first_read.append(gate.parent.exists())
        gates = GateFiles(HostRoot(bare_root), "run/nodeagent")
        while not done.is_set():  # renewed as the agent's loop does, until wait answers
            gates.confirm("peermem", time.time())
            done.wait(RENEW_S)

    t = threading.Thread(target=open_gate)
    t.start()
    try:
        rc = main(["wait", "peermem", "--host-root", str(bare_root), "--timeout", str(WAIT)])
    finally:
        done.set()
        t.join()
    assert dir_at_first_read == [False], "the state dir existed before wait started"
    assert rc == 0 and gate.exists()


def test_wait_peermem_times_out_with_exit_1(bare_root: Path) -> None:
    p = run_cli("wait", "peermem", "--host-root", str(bare_root), "--timeout", "0.3")
    assert p.returncode == 1 and "timed out" in p.stderr


def test_env_host_root_is_used(bare_root: Path) -> None:
    p = subprocess.run(
        [PY, "-m", "nodeagent", "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "NODEAGENT_HOST_ROOT": str(bare_root)},
        timeout=30,
    )
    assert p.returncode == 1 and "kernel 6.1.0-test" in p.stdout


def test_check_says_what_the_gate_means_before_the_driver_root_is_mounted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A healthy node whose GPU driver container has not mounted its root yet (the real
    script mounts it after its own load of nvidia-peermem): open, with the note (issue 65)."""
    import shutil

    from tests.healthy import healthy_node

    node = healthy_node(tmp_path)
    node.kernel.uevent_source.close()
    driver = tmp_path / "run/nvidia/driver"
    assert main(["check", "--host-root", str(tmp_path)]) == 0
    assert "note:" not in capsys.readouterr().out  # mounted: the file is judged, no note
    shutil.rmtree(driver)
    driver.mkdir()  # the mount point, empty
    assert main(["check", "--host-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peermem: open\n  note: nvidia-peermem.ko not checked: the GPU driver root" in out
    assert main(["check", "--host-root", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["guards"]["peermem"]["evidence"]["abi"]["deferred"].startswith("nvidia-peermem")


def test_check_on_a_node_whose_mofed_keeps_its_tree_in_its_container(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DOCA's driver container shares only its headers on the host (issue 65): with MOFED's
    tree gone from run/mellanox/drivers, a healthy node's gate is open, with the note;
    before, MOFED's loaded stack was compared with the host's inbox files: closed."""
    import shutil

    from tests.healthy import healthy_node

    node = healthy_node(tmp_path)
    node.kernel.uevent_source.close()
    shutil.rmtree(tmp_path / "run/mellanox/drivers/lib")
    assert main(["check", "--host-root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peermem: open\n  note: MOFED's module files are not on the host" in out
