"""The seeds, end to end on the real Debian 6.1 kernel (QEMU): the kernel-upgrade race
(seeds 000-002) and MOFED's restart over an idle peermem, each replayed without and with
the agent. The replays, and what their modules and containers do, are
``replay_upgrade.py``'s; the bench (``bench/seeds_real.py``) prints the same rows as a
table."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.realkernel.modbuild import KModule
from tests.realkernel.mofed_container import RESTARTS
from tests.realkernel.replay_upgrade import (
    BUILDS,
    EINVAL_WORDS,
    PEER_SYM,
    peermem_records,
    replay_restart_over_peermem,
    replay_upgrade,
)

pytestmark = pytest.mark.realkernel

# What the replays load, built on the host before the guest boots: the plugin builds the
# KModules a test file holds as globals.
MODULES = BUILDS


UNLOAD_FAILED = "Unloading HCA driver: [FAILED]"


def test_mofed_restart_without_the_agent_openibd_fails_on_an_idle_peermem(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_restart_over_peermem(built_modules, with_agent=False)
    print(json.dumps(row, indent=1))
    assert row["mofed_exits"] == 1 + RESTARTS and not row["mofed_ready"], row
    assert "rmmod: ERROR: Module ib_core is in use by: nvidia_peermem" in row["mofed_words"], row
    assert any(UNLOAD_FAILED in w for w in row["mofed_words"]), row
    assert row["peermem_loaded"], row  # still there: what openibd's unload met


def test_mofed_restart_with_the_agent_peermem_steps_aside_and_comes_back(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_restart_over_peermem(built_modules, with_agent=True)
    print(json.dumps(row, indent=1))
    assert row["mofed_exits"] == 0 and row["mofed_ready"], row
    assert not any("rmmod" in w or "[FAILED]" in w for w in row["mofed_words"]), row
    assert row["peermem_loaded"] and row["ib_core"] == "mofed", row
    assert row["agent_exit"] == 0, row["agent_log_tail"]


def test_kernel_upgrade_race_without_the_agent_the_kernel_refuses_peermem(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_upgrade(built_modules, with_agent=False)
    print(json.dumps(row, indent=1))  # the row, as the bench prints it, for the guest log
    # The seed's own words, from the real modprobe, at each start of the driver container.
    assert row["failed_loads"] == 1 + RESTARTS, row
    assert row["container_exits"] == 1 + RESTARTS, row
    assert f"modprobe: ERROR: {EINVAL_WORDS}" in row["tool_words"], row
    # The kernel's: the inbox ib_core the container's modprobe put in, under MOFED's stack.
    assert any(
        re.search(rf"nvidia_peermem: disagrees about version of symbol {PEER_SYM}$", line)
        for line in row["kernel_words"]
    ), row["kernel_words"]
    assert row["mofed_ready"] and row["ib_core"] == "inbox", row
    assert not row["peermem_loaded"]
    # Every start failed in _load_driver, before its _mount_rootfs: the root never mounted.
    assert row["driver_root"] == [
        "at the load: empty",
        "after the load: empty",
        "after the stop: empty",
    ], row["driver_root"]


def test_kernel_upgrade_race_with_the_agent_the_load_waits_and_goes_on(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_upgrade(built_modules, with_agent=True)
    print(json.dumps(row, indent=1))
    assert row["failed_loads"] == 0 and row["container_exits"] == 0, row
    (held, *_) = row["held"]
    assert held["opener"] == "modprobe", row["held"]
    assert held["path"].endswith(("/ib_core.ko", "/nvidia-peermem.ko")), row["held"]
    assert any(r.get("ended") == "gate opened" for r in row["records"]), row["records"]
    # The real modprobe opens the image's inbox ib_core.ko first (no ib_core is loaded
    # then): held, it goes by the gate (no verdict of its own, no why). Its open of the
    # real nvidia-peermem.ko, built against MOFED's ib_core, goes on by its own verdict.
    (peer,) = peermem_records(row)
    assert peer["ended"] == "gate opened", row["records"]
    assert "agrees with it" in str(peer.get("why")), row["records"]
    # nvidia-driver init's order: /run/nvidia/driver empty while the held load waits (the
    # gate opens at MOFED's flag without the file), the container's root there once its
    # load returned (_mount_rootfs), unmounted at its stop (_shutdown).
    assert row["driver_root"] == [
        "at the load: empty",
        "after the load: the container's root",
        "after the stop: empty",
    ], row["driver_root"]
    assert not any("disagrees about version" in line for line in row["kernel_words"]), row
    assert row["peermem_loaded"] and row["ib_core"] == "mofed", row
    assert row["agent_exit"] == 0, row["agent_log_tail"]
