"""The guest's kernel as the real-kernel tests read it, written once here: what it has
loaded (each test file had its own ``_loaded``, with four return types), a module's
version, its module directory, its log; and the unload of what a test loaded."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nodeagent.config import Config
from nodeagent.core.snapshot import LoadedModule
from nodeagent.host.fs import HostRoot
from nodeagent.host.observe import Observer


def names() -> set[str]:
    """Every loaded module, by ``/proc/modules``."""
    return {line.split()[0] for line in Path("/proc/modules").read_text().splitlines()}


def is_loaded(name: str) -> bool:
    return name in names()


def versions() -> dict[str, str]:
    """Loaded module -> its ``version`` ('' without one)."""
    out = {}
    for name in names():
        try:
            out[name] = Path(f"/sys/module/{name}/version").read_text().strip()
        except OSError:
            out[name] = ""
    return out


def observed(name: str, observer: Observer | None = None, *, clean: bool = False) -> LoadedModule:
    """``name`` as the agent's observer reads it, asserted live (``clean``: and read with no
    problem)."""
    mod = (observer or Observer(HostRoot("/"), Config())).read_loaded_module(name)
    assert mod is not None and mod.live, mod
    assert not clean or mod.problems == (), mod
    return mod


def observed_names() -> set[str]:
    """Every loaded module as the agent's observer reads them, asserted read whole."""
    mods, problems = Observer(HostRoot("/"), Config()).read_loaded_modules()
    assert problems == []
    return set(mods)


def version(name: str) -> str:
    """A loaded module's ``version`` (its MODULE_VERSION)."""
    return Path(f"/sys/module/{name}/version").read_text().strip()


def unload(*modules: str) -> None:
    """``rmmod`` each of ``modules`` that is loaded, in the order given (users first); one
    that will not go is left for the next test's check to name."""
    for name in modules:
        if is_loaded(name):
            subprocess.run(["rmmod", name], check=False)


def moddir() -> str:
    """The running kernel's module directory."""
    return f"/usr/lib/modules/{os.uname().release}"


def kernel_lines(since: int) -> list[str]:
    """The kernel's log lines after the first ``since`` (``dmesg``: its own words)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[since:]
