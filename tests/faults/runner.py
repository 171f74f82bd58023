"""One agent pass in a child process, killed with SIGKILL at a chosen step (test-only).

``python -m tests.faults.runner ROOT STEP``: runs one enforce-mode pass of the
real agent on the host root ROOT, with a file-backed kernel (module state is
the ``sys/module/<name>`` directories, so it survives the kill), and at STEP
sends itself SIGKILL:

- ``after-observe``      the snapshot is read, nothing decided yet
- ``after-memory-save``  the write-ahead memory save completed
- ``mid-action``         inside the module operation, after it took effect
- ``before-publish``     the write-ahead memory written; gate files, timeline and
                         status not (the pass publishes as soon as its decision is
                         durable: ``loop/passes.py`` rule 5)
- ``none``               the pass completes

At every step boundary of the pass (memory save, action, timeline record,
status write, publish) it checks the promise: a gate file is never present
while the pass's decision for that gate is closed. A violation exits 3 with
one line on stderr. Nothing here is imported by the agent.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nodeagent.agent import Agent
from nodeagent.config import Config
from nodeagent.core.reconcile import Reconciler
from nodeagent.host.act import Actuator
from nodeagent.host.gatefile import GateFiles
from nodeagent.host.kmod import ModuleOpError
from nodeagent.host.modfile import read_module_fd
from nodeagent.host.observe import Observer
from nodeagent.host.state import StateStore
from nodeagent.loop.gates import Gates
from nodeagent.timeline import Timeline

STEPS = ("after-observe", "after-memory-save", "mid-action", "before-publish", "none")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FileKernel:
    """Module state as sysfs directories under the root: what a restarted agent sees."""

    def __init__(self, root: Path, on_effect: Callable[[], None]) -> None:
        self.sys = root / "sys/module"
        self.on_effect = on_effect

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        info = read_module_fd(fd, name)  # the very file the gate verified
        d = self.sys / info.name
        if d.exists():
            raise ModuleOpError("load", name, errno.EEXIST)
        # Built aside and renamed in: a kill mid-load leaves no half module (the kernel's
        # own load is atomic as seen from sysfs; a torn fake would test the fake).
        new = self.sys / f".loading-{info.name}"
        shutil.rmtree(new, ignore_errors=True)
        (new / "holders").mkdir(parents=True)
        (new / "refcnt").write_text("0\n")
        (new / "initstate").write_text("live\n")
        new.rename(d)
        self.on_effect()

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise AssertionError("the agent loads by descriptor")

    def remove(self, name: str) -> None:
        d = self.sys / name
        if not d.exists():
            raise ModuleOpError("unload", name, errno.ENOENT)
        gone = self.sys / f".unloading-{name}"
        d.rename(gone)  # one step, as the kernel's: no module left without its refcnt
        shutil.rmtree(gone)
        self.on_effect()

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        raise AssertionError("not used")


def main(argv: list[str]) -> int:
    root, step = Path(argv[0]), argv[1]
    assert step in STEPS, step
    decided: dict[str, bool] = {}  # this pass's decision, once made

    def check(where: str) -> None:
        for guard, is_open in decided.items():
            if not is_open and (root / f"run/nodeagent/{guard}.gate").exists():
                print(f"VIOLATION at {where}: {guard} gate file present, decision closed",
                      file=sys.stderr)  # fmt: skip
                os._exit(3)

    def wrap(cls: Any, name: str, before: Callable[[], None] = lambda: None,
             after: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        orig = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            check(f"{cls.__name__}.{name}")
            before()
            result = orig(*args, **kwargs)
            after()
            return result

        setattr(cls, name, wrapper)

    orig_decide = Reconciler.decide

    def decide(self: Reconciler, *args: Any, **kwargs: Any) -> Any:
        rec = orig_decide(self, *args, **kwargs)
        decided.update({g: rec.verdicts[g].ok for g in self.gates})
        return rec

    Reconciler.decide = decide  # type: ignore[method-assign]
    wrap(Observer, "observe", after=die if step == "after-observe" else lambda: None)
    wrap(StateStore, "save_memory", after=die if step == "after-memory-save" else lambda: None)
    wrap(Actuator, "perform")
    wrap(Timeline, "append")
    wrap(StateStore, "write_status")
    wrap(GateFiles, "publish")
    # The publication step itself, reached whether or not a gate is open to publish.
    wrap(Gates, "settle", before=die if step == "before-publish" else lambda: None)
    cfg = Config(host_root=str(root), mode="enforce", uevents=False)
    kernel = FileKernel(root, die if step == "mid-action" else lambda: None)
    agent = Agent(cfg, module_ops=kernel, kernel_log=lambda m: [])
    result = agent.run_once(["fault-test"])
    check("end of pass")
    print(result.verdicts["peermem"].verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
