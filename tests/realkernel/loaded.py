"""What the guest's kernel has loaded, read the ways the real-kernel tests need it: written
once here (each test file had its own ``_loaded``, with four return types)."""

from __future__ import annotations

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
