"""Upgrading nodeagent never reopens the race (issue 52): a SIGTERM that finds a load held
with the gate closed drains (the agent keeps running, passes, lease and responder, until
the gate opens or the hold's budget ends) instead of letting the load go. Two agent
processes, as two pods of a rollout would be, on a real fanotify mark; a real open
held across the first one's stop and the second one's start.

The design chosen (drain, not a hand-over of the fanotify group) and why: docs/design.md,
"Upgrading nodeagent".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from nodeagent.sim.node import READY
from tests.guards.peermem.rig import (
    APART_AGENT,
    REPO,
    START_WAIT,
    driver_root,
    fake_modprobe,
    hold_status,
    is_held,
    recorded,
    responder_running,
    unmounted,
)
from tests.waiting import WAIT, until


def _agent(root: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", APART_AGENT, str(root)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def test_a_held_load_stays_held_across_a_rollout_and_goes_on_when_the_gate_opens(
    tmp_path: Path,
) -> None:
    root, driver = driver_root(tmp_path)
    modprobe = fake_modprobe(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    with unmounted(driver):
        try:
            first = _agent(root)
            procs.append(first)
            responder = responder_running(root, "the first agent's hold did not start")
            (ko,) = driver.rglob("nvidia-peermem.ko*")
            want = ko.read_bytes()
            loader = subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE)
            procs.append(loader)
            until(lambda: is_held(root, loader.pid), "the load was not held")

            # The rollout stops the first pod: it drains instead of letting the load go.
            first.send_signal(signal.SIGTERM)
            until(lambda: recorded(root, "draining"), "the agent did not drain")
            assert first.poll() is None and loader.poll() is None
            assert is_held(root, loader.pid, responder)  # its responder still holds it

            # MOFED is ready: the gate opens, the load goes on, then the agent stops.
            (root / READY).write_text("")
            out, _ = loader.communicate(timeout=WAIT)
            assert loader.returncode == 0 and out == want
            assert first.wait(WAIT) == 0
            held = [r for r in recorded(root, "held-open") if r.get("pid") == loader.pid]
            assert [r["ended"] for r in held] == ["gate opened"], held
            assert recorded(root, "stop")

            # The next pod's agent: the gate closed again (MOFED restarting), its own
            # load held; a second signal during its drain stops it at once (the operator's
            # choice, said in the timeline).
            (root / READY).unlink()
            shutil.rmtree(root / "sys")  # (the simulated node is built again by the next)
            second = _agent(root)
            procs.append(second)
            until(
                lambda: (
                    (s := hold_status(root)).get("state") == "running"
                    and s.get("responder_pid") not in (None, responder)
                ),
                "the second agent's hold did not start",
                START_WAIT,
            )
            (ko,) = driver.rglob("nvidia-peermem.ko*")
            late = subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE)
            procs.append(late)
            until(lambda: is_held(root, late.pid), "the second agent did not hold the load")
            drains = len(recorded(root, "draining"))
            second.send_signal(signal.SIGTERM)
            until(lambda: len(recorded(root, "draining")) > drains, "the second did not drain")
            assert late.poll() is None
            second.send_signal(signal.SIGTERM)  # again: stop now
            assert second.wait(WAIT) == 0
            late.communicate(timeout=WAIT)  # let go with the stop (said: held-open record)
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                    p.wait(WAIT)
