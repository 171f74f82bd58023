"""The storage guard in the real agent loop on a temp host root: the hold file's life."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from nodeagent.agent import Agent
from nodeagent.config import Config

HOLD = "etc/modprobe.d/nodeagent-storage-hold.conf"
LOCK = "run/mellanox/drivers/.lock"


class Kernel:
    """Module operations mirrored into the temp sysfs (removal only, as this test needs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.removed: list[str] = []

    def insert_file(self, path: str, params: object) -> None:
        raise AssertionError("no load expected")

    def probe(self, name: str, moddir: str, params: object = ()) -> None:
        raise AssertionError("no load expected")

    def remove(self, name: str) -> None:
        d = self.root / "sys/module" / name
        for f in ("initstate", "refcnt"):
            (d / f).unlink()
        (d / "holders").rmdir()
        d.rmdir()
        self.removed.append(name)


def node(tmp_path: Path) -> Path:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    d = tmp_path / "sys/module/rpcrdma"
    (d / "holders").mkdir(parents=True)
    (d / "initstate").write_text("live\n")
    (d / "refcnt").write_text("0\n")
    lock = tmp_path / LOCK
    lock.parent.mkdir(parents=True)
    lock.touch()
    st = os.stat(lock)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    (tmp_path / "proc/locks").write_text(f"1: FLOCK  ADVISORY  WRITE 99 {where} 0 EOF\n")
    return tmp_path


def test_the_hold_file_is_written_then_removed_when_the_agent_stops(tmp_path: Path) -> None:
    root = node(tmp_path)
    kernel = Kernel(root)
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600),
        module_ops=kernel,  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.wait_for_passes(2, 30)  # the removal pass, then the holding pass
        assert kernel.removed == ["rpcrdma"]
        text = (root / HOLD).read_text()
        assert "install rpcrdma /bin/false" in text and "install xprtrdma /bin/false" in text
        assert agent.memory["storage"].holding
    finally:
        agent.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert not (root / HOLD).exists()  # MOFED is still pending, but the agent is gone


def test_a_stale_hold_file_is_removed_on_the_first_pass(tmp_path: Path) -> None:
    root = node(tmp_path)
    (root / "proc/locks").write_text("")  # MOFED not pending
    (root / HOLD).parent.mkdir(parents=True)
    (root / HOLD).write_text("install rpcrdma /bin/false\n")
    agent = Agent(
        Config(host_root=str(root), mode="enforce", uevents=False),
        module_ops=Kernel(root),  # type: ignore[arg-type]
        kernel_log=lambda m: [],
    )
    result = agent.run_pass(["start"])
    assert result.verdicts["storage"].verdict == "clear"
    assert [o.action.describe() for o in result.outcomes] == [f"remove {HOLD}"]
    assert not (root / HOLD).exists()
