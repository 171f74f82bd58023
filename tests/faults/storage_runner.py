"""The real agent loop removing a storage chain in a child process, to be killed (test-only).

``python -m tests.faults.storage_runner ROOT [DIE_AFTER]``: runs ``Agent.run`` in
enforce mode on the host root ROOT with a file-backed kernel whose
``delete_module`` takes 100 ms (the module's directory under ``sys/module`` goes
at its end, so the state survives a kill). ``DIE_AFTER`` = n: SIGKILL itself
right after the n-th removal took effect (0: as the first removal begins, the
hold file already written). Without it the parent kills it at a time of its
choosing. Nothing here is imported by the agent.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.host.kmod import ModuleOpError

DELETE_S = 0.1


class SlowFileKernel:
    """Module state as ``sys/module/<name>`` directories; removal takes ``DELETE_S``.

    As the kernel does: an unload, once begun, is finished whatever happens to its caller
    (``delete_module`` runs the module's exit; a SIGKILL lands after), so the directory
    goes in a process of its own, and meanwhile reads ``going``; a second unload of a
    going module is EBUSY, of a missing one ENOENT."""

    def __init__(self, root: Path, die_after: int | None = None) -> None:
        self.sys = root / "sys/module"
        self.die_after = die_after
        self.removed = 0

    def remove(self, name: str) -> None:
        if self.die_after == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        d = self.sys / name
        try:
            state = (d / "initstate").read_text().strip()
        except FileNotFoundError:
            raise ModuleOpError("unload", name, errno.ENOENT) from None
        if state != "live":
            raise ModuleOpError("unload", name, errno.EBUSY)
        (d / "initstate").write_text("going\n")
        # The directory goes at once, as the kernel's does (kobject_del): renamed out of
        # sys/module, then removed. A bare `rm -rf` took its files first, leaving for a
        # moment a module directory with no initstate, which no reader of the real sysfs
        # sees (the kill -9 tests' flake: read as loaded, not going).
        gone = self.sys.parent / f".gone-{name}-{os.getpid()}-{time.monotonic_ns()}"
        unload = [
            "sh",
            "-c",
            'sleep "$1"; mv -- "$2" "$3" && rm -rf -- "$3"',
            "sh",
            str(DELETE_S),
            str(d),
            str(gone),
        ]
        subprocess.run(unload, start_new_session=True, check=True)
        self.removed += 1
        if self.die_after is not None and self.removed >= self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        make_module(self.sys.parent.parent, name)

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise ModuleOpError("load", os.path.basename(path), errno.ENOENT)

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        raise ModuleOpError("load", name, errno.ENOENT)


def make_module(root: Path, name: str) -> None:
    d = root / "sys/module" / name
    (d / "holders").mkdir(parents=True, exist_ok=True)
    (d / "initstate").write_text("live\n")
    (d / "refcnt").write_text("0\n")


def agent(root: Path, kernel: SlowFileKernel) -> Agent:
    cfg = Config(host_root=str(root), mode="enforce", uevents=False, resync_seconds=3600)
    return Agent(cfg, module_ops=kernel, kernel_log=lambda m: [])  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    die_after = int(argv[1]) if len(argv) > 1 else None
    agent(root, SlowFileKernel(root, die_after)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
