"""A node where MOFED's install is pending (its lock held) and a storage module is loaded
with no user: the storage guard's setting, shared by ``test_storage_agent.py``,
``loop/test_worker.py`` and ``faults/test_storage_kill9.py``."""

from __future__ import annotations

import os
from pathlib import Path

HOLD = "etc/modprobe.d/nodeagent-storage-hold.conf"


LOCK = "run/mellanox/drivers/.lock"


MOUNTINFO = "proc/1/mountinfo"


ROOT_MOUNT = "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"


def node(tmp_path: Path, module: str = "rpcrdma") -> Path:
    """MOFED pending (its lock held) and ``module`` loaded with no user: the agent removes it."""
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / MOUNTINFO).write_text(ROOT_MOUNT)
    d = tmp_path / "sys/module" / module
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
