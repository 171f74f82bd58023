"""An agent crash is not a pod death (issue 52) on the real Debian 6.1 kernel (QEMU): the
same supervisor, agent processes, real fanotify mark and real held open as
``tests/guards/peermem/test_hold_adopt.py``, inside the guest (SCM_RIGHTS of a fanotify
group, pidfd, PR_SET_CHILD_SUBREAPER on that kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.guards.peermem.test_hold_adopt import (
    test_an_agent_killed_alone_leaves_its_load_held_and_the_next_one_adopts_it as _adopt,
)

pytestmark = pytest.mark.realkernel


def test_an_agent_killed_alone_is_adopted_on_the_6_1_kernel(tmp_path: Path) -> None:
    _adopt(tmp_path)
