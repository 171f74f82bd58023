"""The gate judges the held file (issue 65), on the real Debian 6.1 kernel (QEMU): the
upgrade replay (``replay_upgrade.py``) with the real ``modprobe -a nvidia-peermem`` of a
real ``nvidia-peermem.ko``, held by the real agent (``nodeagent run``, the peermem-hold
config, enforce), and let go by its own verdict. ``tests/guards/peermem/
test_hold_real_order.py`` is the same on this machine's kernel with a fake modprobe.

- the GPU image's ``nvidia-peermem.ko`` built against the **inbox** ``ib_core``: after
  MOFED's restart and flag its CRC of ``ib_register_peer_memory_client`` can never match
  the loaded MOFED ``ib_core``: the held open is let go as ``rebuild`` (its why naming the
  symbol and both CRCs) well before the hold's budget (900 s: the component's config
  leaves the default), the kernel refuses the module, the gate says ``rebuild``;
- the load between MOFED's insert and its flag (``FLAG_PENDING``): MOFED's ``ib_core``
  live, ``modprobe`` skips it and ``nvidia`` (the container's ``/sys/module``) and opens
  ``nvidia-peermem.ko`` alone, held with the gate closed until its verdict. In the seeds'
  order (the load after MOFED's unload) ``modprobe`` opens the image's ``ib_core.ko``
  first, held until the gate opens, and its open of ``nvidia-peermem.ko`` comes with the
  gate open: the first test asks that this open, too, be let go by its own verdict
  (``rebuild``), as ``test_seeds_real.py`` asks it for the go verdict (both fail at
  246b308: answered at once, never judged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.realkernel.modbuild import KModule
from tests.realkernel.replay_upgrade import (
    BUILDS,
    EINVAL_WORDS,
    FLAG_PENDING,
    PEER_SYM,
    peermem_records,
    replay_upgrade,
)

pytestmark = pytest.mark.realkernel

MODULES = BUILDS  # built on the host before the boot (the plugin reads the globals)

BUDGET_S = 900.0  # the peermem-hold component's hold_budget_seconds (the default)
SOON_S = 60.0  # "well before the budget": the flag, a pass, the lease


def _crcs(why: str) -> list[str]:
    return re.findall(r"\b0x[0-9a-f]{8}\b", why)


def _assert_let_go_for_a_rebuild(row: dict[str, Any]) -> None:
    (peer,) = peermem_records(row)
    # By its own verdict, not by the budget ("budget expired", 900 s).
    assert peer["ended"] == "rebuild", row["records"]
    assert peer["seconds"] < min(SOON_S, BUDGET_S), row["records"]
    why = str(peer.get("why"))
    assert f"needs {PEER_SYM} CRC" in why and "but the loaded ib_core exports" in why, why
    crcs = _crcs(why)
    assert len(crcs) == 2 and crcs[0] != crcs[1], why
    # The real modprobe then fails: the kernel refuses the module.
    assert row["failed_loads"] == 1 and row["container_exits"] == 1, row
    assert f"modprobe: ERROR: {EINVAL_WORDS}" in row["tool_words"], row["tool_words"]
    assert any(
        re.search(rf"nvidia_peermem: disagrees about version of symbol {PEER_SYM}$", line)
        for line in row["kernel_words"]
    ), row["kernel_words"]
    assert not row["peermem_loaded"] and row["ib_core"] == "mofed", row
    # The agent's verdict for peermem (status.json's, each change in the timeline): rebuild,
    # naming the symbol.
    assert any(d.startswith("rebuild:") and PEER_SYM in d for d in row["gate_since_flag"]), row[
        "gate_since_flag"
    ]
    assert row["agent_exit"] == 0, row["agent_log_tail"]


def test_seeds_order_a_peermem_built_against_the_inbox_ib_core_is_let_go_for_a_rebuild(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_upgrade(built_modules, with_agent=True, built_against="inbox")
    print(json.dumps(row, indent=1))
    ib_core = [r for r in row["records"] if str(r.get("path")).endswith("/ib_core.ko")]
    assert [r["ended"] for r in ib_core] == ["gate opened"], row["records"]
    _assert_let_go_for_a_rebuild(row)


def test_flag_pending_a_held_peermem_built_against_mofeds_ib_core_goes_on_at_the_flag(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_upgrade(built_modules, with_agent=True, load_at=FLAG_PENDING)
    print(json.dumps(row, indent=1))
    (peer,) = row["records"]  # MOFED's ib_core live: modprobe opened nvidia-peermem.ko only
    assert peer in peermem_records(row), row["records"]
    assert peer["ended"] == "gate opened" and peer["seconds"] < SOON_S, row["records"]
    assert "agrees with it" in str(peer.get("why")), row["records"]
    assert row["failed_loads"] == 0 and row["container_exits"] == 0, row
    assert row["peermem_loaded"] and row["ib_core"] == "mofed", row
    assert row["driver_root"][1] == "after the load: the container's root", row["driver_root"]
    assert row["agent_exit"] == 0, row["agent_log_tail"]


def test_flag_pending_a_held_peermem_built_against_the_inbox_ib_core_is_let_go_for_a_rebuild(
    built_modules: Callable[[KModule], Path],
) -> None:
    row = replay_upgrade(
        built_modules, with_agent=True, built_against="inbox", load_at=FLAG_PENDING
    )
    print(json.dumps(row, indent=1))
    assert len(row["records"]) == 1, row["records"]
    _assert_let_go_for_a_rebuild(row)
