"""The real agent in the guest, as the DaemonSet runs it: ``nodeagent run`` in a process of
its own, with a shipped config file, its state under the guest's ``/run`` (issue 40).

``GuestAgent(...).start()`` runs ``python -m nodeagent run --config <file> --mode enforce``
with the guest's ``/`` as the host root (the DaemonSet mounts the node's ``/`` and sets
``NODEAGENT_HOST_ROOT``; here the guest is the node). Nothing in it stands in for the
agent: the test reads what a user reads (``status.json``, the timeline, the process's
exit) and waits on those conditions, never on sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import waiting

REPO = Path(__file__).resolve().parents[2]
# The peermem-hold component's config: the base's with hold_loads = "fanotify".
HOLD_CONFIG = REPO / "deploy/components/peermem-hold/agent.toml"
STATUS = Path("/run/nodeagent/status.json")
TIMELINE = Path("/var/lib/nodeagent/timeline.jsonl")
WAIT = 120.0  # a hang detector under TCG: the agent's start (imports) takes seconds there


def _remove_state() -> None:
    for leftover in (STATUS.parent, TIMELINE.parent):
        subprocess.run(["rm", "-rf", "--", str(leftover)], check=True)


def _applying(config: Path) -> Path:
    """``config`` with every guard's ``enabled = "auto"`` made ``true``: the guest has no
    NVIDIA GPU and no ConnectX on its PCI bus (the tests' modules and containers stand in
    for them), so under "auto" peermem and storage would say not-applicable (issue 54)."""
    text = config.read_text()
    assert 'enabled = "auto"' in text, f"{config}: the guards' enabled keys changed"
    out = Path("/tmp") / f"applying-{config.name}"
    out.write_text(text.replace('enabled = "auto"', "enabled = true"))
    return out


class GuestAgent:
    def __init__(self, config: Path = HOLD_CONFIG, log: Path = Path("/tmp/nodeagent.log")) -> None:
        self.config = _applying(config)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> GuestAgent:
        """A fresh agent: the state and timeline of an earlier one removed first (a fresh
        node), then ``nodeagent run``; returns once its first pass wrote status."""
        _remove_state()
        env = {
            **os.environ,
            "NODEAGENT_HOST_ROOT": "/",
            "NODEAGENT_METRICS_ADDRESS": "off",  # the guest has no scraper; loopback is moot
            "PYTHONPATH": str(REPO),
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "nodeagent",
                    "run",
                    "--config",
                    str(self.config),
                    "--mode",
                    "enforce",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd="/",
                env=env,
            )
        self.until(lambda: self.status() is not None, "the agent's first status.json")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(STATUS.read_text())
        except (OSError, ValueError):
            return None
        return doc

    def verdict(self, guard: str) -> str | None:
        doc = self.status() or {}
        return ((doc.get("guards") or {}).get(guard) or {}).get("verdict")

    def hold(self) -> dict[str, Any]:
        """status.json's ``hold`` part ({} before the hold is up)."""
        return (self.status() or {}).get("hold") or {}

    def records(self) -> list[dict[str, Any]]:
        try:
            lines = TIMELINE.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return out

    def until(self, pred: Callable[[], object], what: str, timeout: float = WAIT) -> None:
        def met() -> object:
            if not self.alive():
                raise AssertionError(f"the agent exited ({self.exit_code()}): {self.tail()}")
            return pred()

        waiting.until(met, what, timeout)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int | None:
        """SIGTERM, as the kubelet stops a pod; its exit code. Its state and timeline are
        removed then: the guest's other tests run agents on the same ``/run``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _remove_state()
        return self.proc.returncode
