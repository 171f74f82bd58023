"""The hold's test rig, shared by this folder's files: a marked tmpfs as the GPU driver's
root, a module loader by name, the agent apart (``apart_agent.py``) and what it says in its
status and timeline. The fixtures built on it are in ``conftest.py``.

The real-kernel suite runs some of these tests again in the guest
(``tests/realkernel/test_hold_*_real.py``), where this folder's ``conftest.py`` is not
in effect: those tests use the functions here, not the fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.guards.peermem.start import sees_host_pids
from nodeagent.loop.wiring import LoopHooks
from tests.guards.peermem.apart_agent import build
from tests.waiting import WAIT, until

REPO = Path(__file__).resolve().parents[3]
APART_AGENT = "tests.guards.peermem.apart_agent"  # python -m: the daemon's agent, apart


def driver_root(tmp_path: Path) -> tuple[Path, Path]:
    """(host root, its ``run/nvidia/driver``: a tmpfs to mark); skips where either cannot be."""
    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    root = tmp_path / "root"
    driver = root / "run/nvidia/driver"
    driver.mkdir(parents=True)
    why = mount_tmpfs(driver)
    if why:
        pytest.skip(why)
    return root, driver


def fake_modprobe(tmp_path: Path) -> str:
    modprobe = tmp_path / "bin/modprobe"  # a module loader by name, outside the mark
    modprobe.parent.mkdir(exist_ok=True)
    shutil.copy("/bin/cat", modprobe)
    return str(modprobe)


def hold_status(root: Path) -> dict[str, Any]:
    try:
        got = json.loads((root / "run/nodeagent/status.json").read_text()).get("hold")
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def unmounted(driver: Path) -> Iterator[None]:
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(driver)], capture_output=True)


@contextlib.contextmanager
def agent_here(root: Path, hooks: LoopHooks | None = None) -> Iterator[tuple[Any, Any]]:
    """The agent (``apart_agent.py``'s) run in a thread of this process until the block
    ends; (agent, node) once its hold started."""
    agent, node = build(root, hooks)
    thread = threading.Thread(target=agent.run, name="nodeagent", daemon=True)
    thread.start()
    try:
        side = agent.side("peermem")
        until(lambda: side is not None and side.hold is not None, "the hold did not start")
        yield agent, node
        assert thread.is_alive(), "the agent's loop ended"
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()


@contextlib.contextmanager
def loaders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts; any still running at the end is killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(WAIT)


def held_pids(side: Any) -> list[int]:
    return [h[0] for h in side.hold.held()] if side.hold is not None else []


def of_kind(timeline: Path, kind: str) -> list[dict[str, Any]]:
    """The timeline's records of one kind."""
    return [r for r in records(timeline) if r.get("kind") == kind]


def mount_tmpfs(where: Path) -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs to mark"
    p = subprocess.run(["mount", "-t", "tmpfs", "nodeagent-test", str(where)], capture_output=True)
    if p.returncode != 0:
        return f"mount -t tmpfs failed: {p.stderr.decode(errors='replace').strip()}"
    return None


def records(timeline: Path) -> list[dict[str, object]]:
    """The timeline's complete lines (the agent may be appending the next one)."""
    text = timeline.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


# Its first process waits for the others: it ends only when every open of the flood has
# ended, failing if any failed.
FLOOD = r"""
import ctypes, os, sys, threading

# PR_SET_NAME on the main thread: /proc/<pid>/comm says modprobe, a module loader.
ctypes.CDLL(None).prctl(15, b"modprobe", 0, 0, 0)
target, procs, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ready, go = int(sys.argv[4]), int(sys.argv[5])
children = []
for _ in range(procs - 1):  # a few processes of one container (one mount namespace)
    pid = os.fork()
    if pid == 0:
        children = []
        break
    children.append(pid)
threading.stack_size(256 * 1024)
start = threading.Event()
failed = []

def opener():
    start.wait()
    try:
        os.close(os.open(target, os.O_RDONLY))
    except OSError as exc:
        failed.append(exc.errno)

workers = [threading.Thread(target=opener) for _ in range(threads)]
for w in workers:
    w.start()
os.write(ready, b"r")
os.read(go, 1)
start.set()
for w in workers:
    w.join()
bad = [os.waitpid(c, 0)[1] for c in children]
os._exit(1 if failed or any(bad) else 0)
"""


def start_flood(tmp: Path, target: Path, procs: int, threads: int) -> subprocess.Popen[bytes]:
    """``procs`` processes of ``threads`` threads named ``modprobe``, in one mount namespace
    of their own (one container), all opening ``target`` at once: started, every thread
    ready, then released together. The flood's process group is its own."""
    script = tmp / "flood.py"
    script.write_text(FLOOD)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    args = [str(target), str(procs), str(threads), str(ready_w), str(go_r)]
    flood = subprocess.Popen(
        ["unshare", "-m", sys.executable, str(script), *args],
        pass_fds=(ready_w, go_r),
        start_new_session=True,
    )
    os.close(ready_w)
    os.close(go_r)
    try:
        got = b""
        while len(got) < procs:  # every thread started (a hang: the test's timeout)
            chunk = os.read(ready_r, procs)
            assert chunk, "a flood process died before it was ready"
            got += chunk
        os.write(go_w, b"g" * procs)
    finally:
        os.close(ready_r)
        os.close(go_w)
    return flood


# An agent's start (Python's imports, the simulated node's build, its responder process's
# own imports) takes tens of seconds in the TCG guest (tests/realkernel/test_hold_upgrade_real
# runs test_hold_upgrade.py there): a guest run failed once at 30 s waiting for the second agent's.
START_WAIT = 4 * WAIT


def is_held(root: Path, pid: int, responder: int | None = None) -> bool:
    status = hold_status(root)
    if responder is not None and status.get("responder_pid") != responder:
        return False
    return any(h.get("pid") == pid for h in status.get("held", []))


def responder_running(root: Path, what: str) -> int:
    """The responder's pid, once status says the hold runs."""
    status = until(
        lambda: (s := hold_status(root)).get("state") == "running" and s, what, START_WAIT
    )
    return int(status["responder_pid"])


def recorded(root: Path, kind: str) -> list[dict[str, Any]]:
    """The records of one kind in the timeline of the agent on ``root``."""
    return of_kind(root / "var/lib/nodeagent/timeline.jsonl", kind)


def overlay_works(tmp: Path) -> str | None:
    """Why this machine cannot start a container-like root here (None: it can): root,
    the tools, an overlay mounted in a mount namespace of its own."""
    if os.geteuid() != 0:
        return "not root: cannot mount an overlay"
    for tool in ("unshare", "nsenter", "chroot", "ldd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    for d in "luwm":
        (tmp / d).mkdir()
    opts = f"lowerdir={tmp}/l,upperdir={tmp}/u,workdir={tmp}/w"
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t overlay overlay -o {opts} {tmp}/m"],
        capture_output=True,
        text=True,
    )
    return None if p.returncode == 0 else f"cannot mount an overlay here: {p.stderr.strip()}"
