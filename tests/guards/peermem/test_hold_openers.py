"""Only an opener that can load a module is ever held (issue 51), against the real kernel:
the agent's responder apart, a real fanotify mark on a tmpfs, real user namespaces.

An unprivileged user could hold opens of the peermem module file from a user namespace
of its own (``unshare -Ur``: a full capability set, but not in the host's namespace) and
so spend the hold's caps and grow what the responder reports until it went silent and
was killed. ``finit_module`` needs ``CAP_SYS_MODULE`` in the initial user namespace: an
opener without it there is let go at once and counted; the driver container's own load
is still held.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nodeagent.guards.peermem.openers import opener_may_load
from nodeagent.sim.node import READY
from tests.guards.peermem.rig import (
    agent_here,
    held_pids,
    loaders,
    unmounted,
)
from tests.waiting import WAIT, until


def test_opener_may_load_reads_the_capability_and_the_namespace(tmp_path: Path) -> None:
    why = opener_may_load()
    assert why(os.getpid()) is None  # (this test runs as root in the host's namespaces)
    sleeper = subprocess.Popen(["unshare", "-U", "-r", "sleep", "30"])
    dropped = subprocess.Popen(["setpriv", "--bounding-set=-sys_module", "sleep", "30"])
    try:
        until(lambda: why(sleeper.pid) is not None, "the user namespace was not seen")
        assert why(sleeper.pid) == "not in the host's user namespace"
        until(lambda: why(dropped.pid) == "no CAP_SYS_MODULE", "the dropped capability")
    finally:
        for p in (sleeper, dropped):
            p.kill()
            p.wait(WAIT)
    assert why(2**22 + 12345) is not None  # gone: cannot be shown to load


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
def test_only_an_opener_that_can_load_a_module_is_held(
    driver_tree: tuple[Path, Path], modprobe: str
) -> None:
    root, driver = driver_tree
    with loaders() as procs, agent_here(root) as (agent, node):
        side = agent.side("peermem")
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        want = ko.read_bytes()
        # The gate is closed (no ready flag): each of these would be held if it could load.
        for argv in (
            ["unshare", "-U", "-r", modprobe, str(ko)],  # its own user namespace
            ["setpriv", "--bounding-set=-sys_module", modprobe, str(ko)],  # no capability
        ):
            done = subprocess.run(argv, capture_output=True, timeout=WAIT)
            assert done.returncode == 0 and done.stdout == want, (argv, done.stderr)
        until(
            lambda: side.hold is not None and side.hold.counts.get("incapable") == 2,
            "the two incapable opens were not counted",
        )
        assert held_pids(side) == []
        # The driver container's own load (root in the host's namespace) is held.
        procs.append(subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE))
        until(lambda: procs[0].pid in held_pids(side), "the capable load was not held")
        node.write(READY)
        out, _ = procs[0].communicate(timeout=WAIT)
        assert procs[0].returncode == 0 and out == want


def test_no_path_an_opener_picks_silences_the_responder(
    tmp_path: Path, driver_tree: tuple[Path, Path], modprobe: str
) -> None:
    """An unprivileged flood of 500 opens, then 64 held opens (the per-container cap) of
    the module file, all through a bind mount at a 3.5 KB deep path: the responder's
    state lists them with paths cut and the exact count, and its heartbeat, a message of
    its own, keeps coming (issue 51: the state outgrew its 64 KB cap, no heartbeat went
    out, the agent killed the responder as stuck after 10 s, and every held load went
    on with the gate closed)."""
    from nodeagent.guards.peermem.process_main import PATH_LISTED

    root, driver = driver_tree
    deep = tmp_path / "/".join(["d" * 250] * 14)  # 3.5 KB
    deep.mkdir(parents=True)
    with (
        unmounted(deep),
        loaders() as procs,
        agent_here(root) as (
            agent,
            _node,
        ),
    ):
        side = agent.side("peermem")
        hold = side.hold
        hold.stuck_s = 2.0  # silent this long: killed (10 s as shipped)
        subprocess.run(["mount", "--bind", str(driver), str(deep)], check=True)
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        far = deep / ko.relative_to(driver)
        assert len(str(far)) > 3500
        # An unprivileged flood first (a user namespace of its own, any count): all let go.
        flood = 'i=0; while [ $i -lt 500 ]; do "$0" "$1" >/dev/null; i=$((i+1)); done'
        done = subprocess.run(
            ["unshare", "-U", "-r", "sh", "-c", flood, modprobe, str(far)], timeout=WAIT
        )
        assert done.returncode == 0
        until(lambda: hold.counts.get("incapable") == 500, "the flood was not counted")
        assert hold.held_count() == 0 and hold.alive()
        for _ in range(64):
            procs.append(subprocess.Popen([modprobe, str(far)], stdout=subprocess.DEVNULL))
        until(lambda: hold.held_count() == 64, "the 64 opens were not all held")
        listed = hold.held()
        assert len(listed) == 64  # (cut paths: they all fit)
        assert all(
            len(p) <= PATH_LISTED and p.endswith("nvidia-peermem.ko") for _, _, p, _ in listed
        )
        beats = hold.beats
        until(lambda: hold.beats >= beats + 4, "the heartbeat stopped", timeout=WAIT)
        assert hold.alive() and not hold.stuck and side.hold is hold
        assert all(p.poll() is None for p in procs)  # every load still held
