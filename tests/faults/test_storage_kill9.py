"""kill -9 anywhere in a storage removal: after a restart and MOFED ready, every module the
agent removed is loaded back.

The killed agent is the real loop in a child process (``storage_runner``), removing three
storage modules at 100 ms each while MOFED is pending (its lock held). It is killed right
after each removal (and as the first begins), and at seeded offsets into the plan. Then
MOFED becomes ready, a new agent starts on the same root, and the test waits until it has
loaded back what is gone. ``bench``-size trials (30 offsets): ``bench/storage_kill9.py``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..test_storage_agent import HOLD, node
from ..waiting import WAIT, until
from .storage_runner import SlowFileKernel, agent, make_module

MODULES = ("ib_iser", "ib_srp", "rpcrdma")
READY = "run/mellanox/drivers/.driver-ready"


def storage_node(root: Path) -> None:
    """MOFED pending (its lock held), three storage modules loaded with no user."""
    node(root, MODULES[0])
    for m in MODULES[1:]:
        make_module(root, m)


def loaded(root: Path) -> set[str]:
    return {m for m in MODULES if (root / "sys/module" / m).is_dir()}


def trial(root: Path, die_after: int | None, offset_s: float | None) -> tuple[set[str], set[str]]:
    """One kill and one restart: (what the killed agent left loaded, what is loaded after)."""
    storage_node(root)
    args = [sys.executable, "-m", "tests.faults.storage_runner", str(root)]
    if die_after is not None:
        args.append(str(die_after))
    child = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[2])
    try:
        if offset_s is not None:
            # The plan's first step is done (or the child died before it: that fails below).
            until(lambda: (root / HOLD).exists() or child.poll() is not None, "the hold file")
            assert child.poll() is None, f"the agent exited {child.returncode} before its plan"
            time.sleep(offset_s)  # the moment of the kill: the behaviour under test
            child.send_signal(signal.SIGKILL)
        child.wait(WAIT)  # a hang detector: it kills itself, or was just killed
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL, child.returncode
    left = loaded(root)
    # MOFED installs and comes up: its lock released, its ready flag written.
    (root / "proc/locks").write_text("")
    (root / READY).write_text("")
    restarted = agent(root, SlowFileKernel(root))

    def converged() -> bool:
        restarted.run_once()
        return loaded(root) == set(MODULES) and not (root / HOLD).exists()

    try:
        until(converged, f"the restarted agent loads back every module, hold gone (left {left})")
    finally:
        restarted.close()
    return left, loaded(root)


@pytest.mark.parametrize("die_after", [0, 1, 2, 3])
def test_killed_after_each_removal_everything_removed_comes_back(
    tmp_path: Path, die_after: int
) -> None:
    left, after = trial(tmp_path, die_after, None)
    assert len(left) == len(MODULES) - die_after  # the kill came where it was asked
    assert after == set(MODULES)
    assert not (tmp_path / HOLD).exists()


@pytest.mark.parametrize("seed", range(4))
def test_killed_at_any_moment_of_the_plan_everything_removed_comes_back(
    tmp_path: Path, seed: int
) -> None:
    offset = random.Random(seed).uniform(0.0, 0.35)  # 3 removals of 100 ms, and beyond
    left, after = trial(tmp_path, None, offset)
    assert after == set(MODULES), (offset, left)
    assert not (tmp_path / HOLD).exists()
