"""Kernel uevents for module load and unload, through UeventSource and Waker, in a real kernel.

No udevd runs in the guest (as in a pod): only ``source='kernel'`` can hear these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.host.events import UeventSource, Waker
from nodeagent.host.kmod import LibKmod
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel

NA_UEV = KModule(
    "na_uev",
    {"na_uev.c": '#include <linux/module.h>\nMODULE_LICENSE("GPL");\n'},
)


def _wait_for(waker: Waker, wanted: str, seconds: float = 60.0) -> list[str]:
    """Everything the waker reported until ``wanted`` showed up (bounded)."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {wanted!r} within {seconds}s; saw {seen}")
        seen += [r for r in waker.wait(left) if r != "resync"]
    return seen


def test_module_add_and_remove_uevents(built_modules: Callable[[KModule], Path]) -> None:
    ko = str(built_modules(NA_UEV))
    waker = Waker([UeventSource()])  # module, net, pci
    net_only = Waker([UeventSource(("net",))])
    lk = LibKmod()
    lk.insert_file(ko, [])
    try:
        seen = _wait_for(waker, "uevent add module na_uev")
    finally:
        lk.remove("na_uev")
    assert "uevent remove module na_uev" not in seen
    seen = _wait_for(waker, "uevent remove module na_uev")
    assert "uevent add module na_uev" not in seen
    # The subsystem filter holds: the same events woke the net-only source, and it
    # reported none of them.
    assert not any(" module " in r for r in net_only.wait(1.0))
    assert waker.wait(0.2) == []  # nothing pending any more
