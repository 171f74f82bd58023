"""Seed 004 replayed on the real guest kernel, without and with the real agent (issue 40):
the NFS-over-RDMA mount that loads the storage chain before MOFED installs. The replay
(``replay_storage.py``: what each party does, one row per run, which ``bench/seeds_real.py``
prints as a table) is asserted on here."""

from __future__ import annotations

import pytest

from tests.realkernel.replay_storage import RESTARTS, replay_storage

pytestmark = pytest.mark.realkernel

REFUSAL = (
    "Storage modules are loaded for current driver, terminating prior driver reload "
    'failure due to UNLOAD_STORAGE_MODULES not set to "true"'
)
HOLD_REL = "etc/modprobe.d/nodeagent-storage-hold.conf"


def test_without_the_agent_mofed_refuses_every_restart() -> None:
    row = replay_storage(with_agent=False)
    # The kernel loaded the chain for the mount and refused the connection, every retry.
    assert row["mount_errors"] == ["Connection refused"] * (1 + RESTARTS), row
    assert row["rpcrdma_after_mount"], row
    assert not row["mofed_installed"] and row["refusals"] == 1 + RESTARTS, row
    assert all(a["storage_loaded"] == ["rpcrdma"] for a in row["attempts"]), row
    assert REFUSAL in row["tool_words"], row["tool_words"]
    assert row["left_loaded"] == [], row


def test_with_the_agent_mofed_installs_and_the_chain_comes_back() -> None:
    row = replay_storage(with_agent=True)
    assert row["mount_errors"][0] == "Connection refused", row
    assert row["mofed_installed"], row
    # No refusal once the agent removed the chain; a mount retried while the agent held
    # it out did not load it again (the hold file fails the kernel's request_module:
    # mount(2) is refused at once, "Invalid argument").
    assert all(a["installed"] for a in row["attempts"] if not a["storage_loaded"]), row
    held = [r for r in row["mount_retries"] if r["held"]]
    assert all(r["error"] == "Invalid argument" and r["after"] == [] for r in held), row
    verdicts = row["agent_verdicts"]
    assert "blocking" in verdicts and "holding" in verdicts and verdicts[-1] == "clear", verdicts
    done = row["agent_done"]
    assert done[:2] == [f"write {HOLD_REL}", "unload rpcrdma"], done
    assert f"remove {HOLD_REL}" in done and any(d.startswith("load rpcrdma") for d in done), done
    # MOFED ready: the hold file gone, rpcrdma loaded back.
    assert row["storage_back"], row
    assert row["agent_exit"] == 0, row
    assert row["left_loaded"] == [], row


def test_an_agent_started_while_mofed_crash_loops_sees_its_next_attempt() -> None:
    """MOFED refused once before the agent was up; its restarts reopen the lock file the
    first attempt made (a flock: no inotify event). The storage guard watches the lock
    file's openings (``Needs.opens``): the opening wakes a pass, which finds the flock
    (or looks again for 0.5 s), so the next attempt finds the chain out.

    Without the wake (the FileWatch given no ``opens``) this fails: MOFED never installs
    (2026-11-28, once; the lease beats no longer being full passes, nothing else wakes
    the agent in the attempt's 1.7 s). The wake's own tests: tests/test_storage_agent.py,
    tests/test_events.py."""
    row = replay_storage(with_agent=True, agent_late=True)
    assert row["agent_started_after"] == 1 and not row["attempts"][0]["installed"], row
    assert row["mofed_installed"], row
    assert row["refusals"] == 1, row  # the one before the agent, none after
    verdicts = row["agent_verdicts"]
    assert verdicts[0] == "clear" and "blocking" in verdicts and verdicts[-1] == "clear", row
    assert row["storage_back"] and row["agent_exit"] == 0, row
    assert row["left_loaded"] == [], row
