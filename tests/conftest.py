"""Defaults for the whole test session, and the fixtures files in several folders share.

Each test folder's ``conftest.py`` holds what that folder's files share as fixtures;
plain helpers they share are modules of their own (``tests/healthy.py``,
``tests/guards/peermem/rig.py``, ...): no test file imports another test file's helpers
(``tests/test_shape.py`` checks it)."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from nodeagent.sim.node import Node
from tests.healthy import healthy_node

# Daemons the tests start serve no metrics unless a test asks for them with
# --metrics-address (on a free port): the default 127.0.0.1:9808 is one fixed
# port, so two test sessions on one machine would make each other's agents exit 2.
# The default itself is asserted on Config() in tests/test_metrics.py. (Config reads
# the environment when it is loaded, not when nodeagent is imported.)
os.environ.setdefault("NODEAGENT_METRICS_ADDRESS", "off")

# Hypothesis times each example (200 ms) and the data generation ("too_slow"): both are
# timed assertions a busy machine crosses (docs/testing.md). Off for every test, not
# only those that remembered to say so; a hang is still caught by the waits' deadlines.
settings.register_profile("nodeagent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nodeagent")


def _simulated_node(root: Path, *, ready: bool) -> Iterator[Node]:
    """``tests/healthy.py``'s node on ``root``, its uevent source closed after the test
    (after the test's own cleanup)."""
    n = healthy_node(root, ready=ready)
    yield n
    n.kernel.uevent_source.close()


@pytest.fixture
def booting_node(tmp_path: Path) -> Iterator[Node]:
    """A GPU node on ``tmp_path`` with MOFED's RDMA stack and nvidia loaded and no ready
    flag yet."""
    yield from _simulated_node(tmp_path, ready=False)


@pytest.fixture
def ready_node(tmp_path: Path) -> Iterator[Node]:
    """The same node once MOFED said ready: the peermem gate opens on it."""
    yield from _simulated_node(tmp_path, ready=True)


@pytest.fixture
def bare_root(tmp_path: Path) -> Path:
    """A host root with a kernel release and no module loaded: a node without the GPU
    stack, as the command line and the daemon's own guards meet one."""
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    (tmp_path / "sys/module").mkdir(parents=True)
    return tmp_path
