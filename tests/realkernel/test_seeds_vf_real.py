"""Seed 003 end to end on the real Debian 6.1 kernel (QEMU): MOFED's VF restore after a PF
driver reload runs before the VF netdevs exist, without and with the agent. The replay
(``replay_vf.py``: the igb PF for the ConnectX PF, MOFED's restart, one row per run, which
``bench/seeds_real.py`` prints) is asserted on here."""

from __future__ import annotations

import json

import pytest

from tests.realkernel.replay_vf import NVFS, replay_vf_restore

pytestmark = pytest.mark.realkernel


def test_vf_restore_race_without_the_agent_the_vfs_lose_their_config() -> None:
    row = replay_vf_restore(with_agent=False)
    print(json.dumps(row, indent=1))
    assert row["mofed_exits"] == 1 and row["mofed_ready"], row  # restarted: skips the reload
    assert any('"dev argument required"; VF restore failed' in w for w in row["mofed_words"]), row
    assert row["vfs_back_count"] == 0, row["vf_fields"]


def test_vf_restore_race_with_the_agent_every_vf_gets_its_config_back() -> None:
    row = replay_vf_restore(with_agent=True)
    print(json.dumps(row, indent=1))
    assert row["vfs_back_count"] == NVFS, row["vf_fields"]
    assert row["agent_exit"] == 0, row["agent_log_tail"]
