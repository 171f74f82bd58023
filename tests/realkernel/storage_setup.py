"""The storage chain on the guest's kernel, shared by ``test_storage_real.py`` and
``replay_storage.py``: the modules, MOFED's lock and flag, the agent's hold file,
and unloading what a test left loaded."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

from nodeagent.host.kmod import LibKmod, ModuleOpError
from tests.realkernel.loaded import observed_names

STORAGE = {"ib_iser", "ib_isert", "ib_srp", "ib_srpt", "nvme_rdma", "nvmet_rdma", "rpcrdma"}
MOFED = Path("/run/mellanox/drivers")
LOCK = MOFED / ".lock"
READY = MOFED / ".driver-ready"
HOLD = Path("/etc/modprobe.d/nodeagent-storage-hold.conf")


def force_back(before: set[str]) -> None:
    """Unload what was loaded since ``before`` (users before what they use: ten rounds)."""
    for _ in range(10):
        extra = observed_names() - before
        if not extra:
            return
        for name in sorted(extra):
            with contextlib.suppress(ModuleOpError):
                LibKmod().remove(name)


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
