"""kill -9 anywhere in a storage removal: the removal and the load-back converge.

The trials (``storage_trials.py``: the real loop in a child process removing three storage
modules while MOFED is pending, killed after each removal or at an offset into the plan,
then restarted) are asserted on here:

- Restarted with MOFED ready: the new agent loads back what is gone.
- Restarted with MOFED still pending (the adversarial pass's case): after its first pass
  and the plan it decided, none of the chain is loaded; then MOFED becomes ready and one
  more pass (and its load time) brings every module back, whatever backoff the removal
  had. An unload that finds its module gone is done, not failed.

``bench``-size trials (30 offsets each): ``bench/storage_kill9.py``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.faults.storage_trials import MODULES, pending_trial, trial
from tests.storage_node import HOLD


@pytest.mark.parametrize("die_after", [0, 1, 2, 3])
def test_killed_after_each_removal_everything_removed_comes_back(
    tmp_path: Path, die_after: int
) -> None:
    left, after = trial(tmp_path, die_after, None)
    assert len(left) == len(MODULES) - die_after  # the kill came where it was asked
    assert after == set(MODULES)
    assert not (tmp_path / HOLD).exists()


@pytest.mark.parametrize("seed", range(4))
def test_killed_at_any_moment_of_the_plan_everything_removed_comes_back(
    tmp_path: Path, seed: int
) -> None:
    offset = random.Random(seed).uniform(0.0, 0.35)  # 3 removals of 100 ms, and beyond
    left, after = trial(tmp_path, None, offset)
    assert after == set(MODULES), (offset, left)
    assert not (tmp_path / HOLD).exists()


@pytest.mark.parametrize("seed", range(6))
def test_killed_mid_removal_restarted_while_mofed_waits_then_ready_converges(
    tmp_path: Path, seed: int
) -> None:
    offset = random.Random(100 + seed).uniform(0.0, 0.35)
    left, while_pending, after, error = pending_trial(tmp_path, offset)
    assert while_pending == set(), (offset, left, error)  # seed 004 itself, otherwise
    assert after == set(MODULES), (offset, left, error)  # one pass after ready
    assert not (tmp_path / HOLD).exists()
