"""What this folder's tests share as fixtures; the plain helpers they share are
``rig.py`` (a marked driver root, the agent apart, its status) and ``fakes.py`` (event
sources, a clock, an overflowing group)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.guards.peermem.rig import driver_root, fake_modprobe, unmounted


@pytest.fixture
def driver_tree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(host root, its ``run/nvidia/driver``): a tmpfs to mark, unmounted after the test
    (after its own cleanup: its processes killed, its agent stopped). Skips, with the
    reason, where this process cannot see host PIDs or mount."""
    root, driver = driver_root(tmp_path)
    with unmounted(driver):
        yield root, driver


@pytest.fixture
def modprobe(tmp_path: Path) -> str:
    """A module loader by name (a copy of ``cat`` called ``modprobe``), outside the mark."""
    return fake_modprobe(tmp_path)
