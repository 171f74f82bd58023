"""What this folder's tests share as fixtures. Plain helpers: ``toyguard.py`` (the toy
guard) and ``node_changes.py`` (what can happen to a node, for the property tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.sim.node import Node
from tests.healthy import healthy_node


@pytest.fixture
def ready_node(tmp_path: Path) -> Iterator[Node]:
    """A healthy simulated node on ``tmp_path`` (MOFED ready, the GPU stack validated);
    its uevent source closed after the test, after the test's own cleanup."""
    n = healthy_node(tmp_path)
    yield n
    n.kernel.uevent_source.close()
