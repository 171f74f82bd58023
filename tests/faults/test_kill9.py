"""kill -9 at each step of a pass, then restart: the node converges, nothing is torn,
and the gate file is never present while the last decision was closed.

Each pass runs in a child process (``tests/faults/runner.py``) that SIGKILLs
itself at the step under test and checks the promise at every step boundary
while it lives; this side checks the files it left and that the next agent
converges: the MOFED restart's unload happens, then the reload once MOFED
is ready again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.sim.node import BLACKLIST, GATE, READY
from tests.faults.runner import STEPS

from ..healthy import healthy_node

PEERMEM = Path("sys/module/nvidia_peermem")


def run_pass(root: Path, step: str = "none") -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "tests.faults.runner", str(root), step],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "VIOLATION" not in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return p


def assert_nothing_torn(root: Path) -> None:
    for rel in ("run/nodeagent/state.json", "run/nodeagent/status.json", GATE):
        if (root / rel).exists():
            json.loads((root / rel).read_text())  # a whole document, old or new
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    if timeline.exists():
        for line in timeline.read_text().splitlines():
            json.loads(line)  # one write per record: whole lines only


@pytest.mark.parametrize("step", [s for s in STEPS if s != "none"])
def test_kill9_at_each_step_then_restart_converges(tmp_path: Path, step: str) -> None:
    node = healthy_node(tmp_path)
    root = tmp_path
    try:
        first = run_pass(root)
        assert first.returncode == 0 and first.stdout.strip() == "open", first.stderr
        assert (root / PEERMEM).exists() and (root / GATE).exists()

        node.write_blacklist()  # MOFED: openibd restart begins
        killed = run_pass(root, step)
        assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
        assert_nothing_torn(root)
        if step == "after-observe":  # killed before deciding: the last decision was open
            assert (root / GATE).exists()
        else:  # the closed decision withdrew the gate first, before anything else
            assert not (root / GATE).exists()

        again = run_pass(root)
        assert again.returncode == 0 and again.stdout.strip() == "closed", again.stderr
        assert not (root / PEERMEM).exists(), "the MOFED-restart unload happened"
        assert not (root / GATE).exists()

        node.remove(BLACKLIST)  # MOFED: restart done, flag re-created
        node.remove(READY)
        node.write(READY)
        done = run_pass(root)
        assert done.returncode == 0 and done.stdout.strip() == "open", done.stderr
        assert (root / PEERMEM).exists() and (root / GATE).exists()
        assert_nothing_torn(root)
    finally:
        node.kernel.uevent_source.close()
