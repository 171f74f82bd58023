"""kill -9 anywhere in a storage removal: the removal and the load-back converge.

The killed agent is the real loop in a child process (``storage_runner``), removing three
storage modules at 100 ms each while MOFED is pending (its lock held); an unload it began
is finished by the "kernel" after the kill, as the real one does. It is killed right
after each removal (and as the first begins), and at seeded offsets into the plan.

- Restarted with MOFED ready: the new agent loads back what is gone.
- Restarted with MOFED still pending (the adversarial pass's case): after its first pass
  and the plan it decided, none of the chain is loaded; then MOFED becomes ready and one
  more pass (and its load time) brings every module back, whatever backoff the removal
  had. An unload that finds its module gone is done, not failed.

``bench``-size trials (30 offsets each): ``bench/storage_kill9.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults.storage_runner import SlowFileKernel, agent, make_module
from tests.storage_node import HOLD, node

from ..waiting import WAIT, until

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
        # a module going (an unload the killed agent began) is on its way out, not back
        return loaded(root) == set(MODULES) and not going(root) and not (root / HOLD).exists()

    try:
        until(converged, f"the restarted agent loads back every module, hold gone (left {left})")
    finally:
        restarted.close()
    return left, loaded(root)


def kill_during_removal(root: Path, offset_s: float) -> set[str]:
    """The agent removing the chain, SIGKILLed ``offset_s`` into its plan; what it left
    loaded once the unloads it began have finished."""
    storage_node(root)
    args = [sys.executable, "-m", "tests.faults.storage_runner", str(root)]
    child = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[2])
    try:
        until(lambda: (root / HOLD).exists() or child.poll() is not None, "the hold file")
        assert child.poll() is None, f"the agent exited {child.returncode} before its plan"
        time.sleep(offset_s)  # the moment of the kill: the behaviour under test
        child.send_signal(signal.SIGKILL)
        child.wait(WAIT)
    finally:
        child.kill()
        child.wait()
    return loaded(root)


def going(root: Path) -> set[str]:
    """Modules whose unload is under way (it ends on its own)."""
    out = set()
    for m in MODULES:
        try:
            if (root / "sys/module" / m / "initstate").read_text().strip() == "going":
                out.add(m)
        except FileNotFoundError:
            pass
    return out


def pending_trial(root: Path, offset_s: float) -> tuple[set[str], set[str], set[str], str]:
    """Killed mid-removal, restarted with MOFED still pending, then MOFED ready.

    (left by the kill, loaded after the restarted agent's first pass while MOFED waits,
    loaded after one pass once MOFED is ready, the restarted agent's last error)."""
    left = kill_during_removal(root, offset_s)
    restarted = agent(root, SlowFileKernel(root))
    try:
        restarted.run_once()  # its first pass, the plan it decided carried out
        until(lambda: not going(root), "the unloads under way end")
        while_pending = loaded(root)
        # MOFED installs and comes up: its lock released, its ready flag written.
        (root / "proc/locks").write_text("")
        (root / READY).write_text("")
        restarted.run_once()  # one pass, and the load time of what it loads back
        after = loaded(root)
        error = restarted.memory["storage"].last_error or ""
    finally:
        restarted.close()
    return left, while_pending, after, error
