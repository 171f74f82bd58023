"""The rollout drain (issue 52) on the real Debian 6.1 kernel (QEMU): the same two agent
processes and real fanotify mark as ``tests/guards/peermem/test_hold_upgrade.py``, inside the
guest."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.guards.peermem.test_hold_upgrade import (
    test_a_held_load_stays_held_across_a_rollout_and_goes_on_when_the_gate_opens as _drain,
)

pytestmark = pytest.mark.realkernel


def test_a_held_load_stays_held_across_a_rollout_on_the_6_1_kernel(tmp_path: Path) -> None:
    _drain(tmp_path)
