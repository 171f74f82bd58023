"""An agent crash is not a pod death (issue 52). The agent runs under ``nodeagent
supervise`` (the container's first process) with its hold on a real fanotify mark; a real
open of ``nvidia-peermem.ko`` is held, gate closed. Then the agent alone is killed
(``SIGKILL``, as an OOM kill of it alone): its responder holds on (its gate closed), the
supervisor starts the agent again, the new agent adopts the responder (``hold-adopted``,
the same ``responder_pid``) and the load goes on only when the gate opens. A stop then
lets go as before, and leaves no process and no socket behind.

The design: docs/design.md, "An agent crash is not a pod death".
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent.guards.peermem.adopt import ADOPT_SOCKET
from nodeagent.sim.node import READY
from tests.guards.peermem.rig import (
    APART_AGENT,
    REPO,
    alive,
    driver_root,
    fake_modprobe,
    hold_status,
    is_held,
    recorded,
    responder_running,
    unmounted,
)
from tests.waiting import WAIT, until


def _supervised(root: Path) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from nodeagent.supervise import Supervisor; "
        "sys.exit(Supervisor(sys.argv[1:]).run())"
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            sys.executable,
            "-m",
            "tests.guards.peermem.apart_agent",
            str(root),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _agent_pid(sup: int) -> int | None:
    from nodeagent.supervise import children

    # The agent is the supervisor's child that runs APART_AGENT (a responder left behind
    # is its child too, until it ends).
    for pid in children(sup):
        with contextlib.suppress(OSError):
            if APART_AGENT.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def test_an_agent_killed_alone_leaves_its_load_held_and_the_next_one_adopts_it(
    tmp_path: Path,
) -> None:
    root, driver = driver_root(tmp_path)
    modprobe = fake_modprobe(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    responder = second = 0
    with unmounted(driver):
        try:
            sup = _supervised(root)
            procs.append(sup)
            responder = responder_running(root, "the agent's hold did not start")
            assert hold_status(root)["responder_adopted"] is False
            first = until(lambda: _agent_pid(sup.pid), "no agent under the supervisor")
            sock = root / "run/nodeagent" / ADOPT_SOCKET
            st = sock.lstat()
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            (ko,) = driver.rglob("nvidia-peermem.ko*")
            want = ko.read_bytes()
            loader = subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE)
            procs.append(loader)
            until(lambda: is_held(root, loader.pid), "the load was not held")

            # The agent alone dies (an OOM kill of it alone): the pod lives.
            os.kill(first, signal.SIGKILL)
            second = until(
                lambda: (p := _agent_pid(sup.pid)) not in (None, first) and p,
                "the supervisor did not start the agent again",
            )
            # The next agent adopts the responder, which held on meanwhile.
            until(lambda: recorded(root, "hold-adopted"), "the next agent did not adopt it")
            (adopted,) = recorded(root, "hold-adopted")
            assert adopted["responder_pid"] == responder and adopted["held_count"] == 1
            assert [h[0] for h in adopted["held"]] == [loader.pid]
            assert not recorded(root, "hold-ended-unclean")  # nothing went through
            until(  # (the dead agent's status.json said the same pid and load)
                lambda: (
                    hold_status(root).get("responder_adopted")
                    and is_held(root, loader.pid, responder)
                ),
                "the new agent's status does not list the adopted responder's load",
            )
            assert loader.poll() is None and alive(responder)
            assert sup.poll() is None and alive(second)
            # The adopted responder told the new agent what it holds: judged (issue 65).
            judged = until(lambda: hold_status(root).get("held_files"), "not judged again")
            assert [f["verdict"] for f in judged] == ["wait"], judged

            # MOFED is ready: the new agent's gate opens, the held load goes on.
            (root / READY).write_text("")
            out, _ = loader.communicate(timeout=WAIT)
            assert loader.returncode == 0 and out == want
            ended = until(
                lambda: [r for r in recorded(root, "held-open") if r.get("pid") == loader.pid],
                "the new agent did not record the held open's end",
            )
            assert [r["ended"] for r in ended] == ["gate opened"], ended
            assert "agrees with it" in ended[0].get("why", ""), ended  # by its own verdict

            # A stop (the pod deleted): forwarded, the agent stops its adopted responder
            # cleanly, the supervisor ends with it; nothing is left behind.
            sup.send_signal(signal.SIGTERM)
            assert sup.wait(WAIT) == 0, sup.stderr.read() if sup.stderr else b""
            until(lambda: not alive(responder), "the adopted responder outlived the stop")
            assert not sock.exists()
        finally:
            # The agents too, found before the supervisor is killed: after, the one it ran
            # is nobody's child, and left running it marks every driver container started
            # on this machine (and holds their loads, its gate closed).
            agents = [second, *([_agent_pid(procs[0].pid) or 0] if procs else [])]
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                    p.wait(WAIT)
            for pid in (responder, *agents):
                if pid and alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_the_adoption_socket_is_root_only_and_never_reached_through_a_symlink(
    tmp_path: Path,
) -> None:
    from nodeagent.guards.peermem.adopt import bind_adopt_socket
    from nodeagent.guards.peermem.start import adopt

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    sock = bind_adopt_socket(str(state))
    try:
        st = (state / ADOPT_SOCKET).lstat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        # Bound, nobody listening (its responder gone): stale, removed, nothing adopted.
        assert adopt(str(state), budget_s=1.0) is None
        assert not (state / ADOPT_SOCKET).exists()
    finally:
        sock.close()
    assert adopt(str(state), budget_s=1.0) is None  # none at all
    link = tmp_path / "link"
    link.symlink_to(state)
    _refused(link, "")  # the state directory itself a symlink (ELOOP)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # writable by others: someone else could put a socket there
    _refused(open_dir, "not owned by this agent's user alone")
    (state / ADOPT_SOCKET).write_text("not a socket")  # never removed, never connected
    _refused(state, "not a socket")
    assert adopt(str(state), budget_s=1.0) is None
    assert (state / ADOPT_SOCKET).read_text() == "not a socket"


def _refused(state_dir: Path, words: str) -> None:
    from nodeagent.guards.peermem.adopt import bind_adopt_socket

    with pytest.raises(OSError) as refused:
        bind_adopt_socket(str(state_dir)).close()
    assert words in str(refused.value)


def test_a_responder_whose_agent_lives_is_never_adopted_nor_killed(tmp_path: Path) -> None:
    """Under the node's lock a second agent never tries; if one did, the responder answers
    ``busy`` and is left alone. Here the test process is the responder's live agent."""
    from nodeagent.guards.peermem.budget import descriptor_budget
    from nodeagent.guards.peermem.process import ResponderProcess
    from nodeagent.guards.peermem.start import adopt
    from nodeagent.host.fanotify import FanotifyGroup

    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"no fanotify group here: {exc}")
    budget, _ = descriptor_budget()
    process = ResponderProcess(group, budget_s=5.0, descriptors=budget, adopt_dir=str(state))
    process.start()
    try:
        with pytest.raises(OSError, match="busy"):
            adopt(str(state), budget_s=5.0)
        assert process.alive() and (state / ADOPT_SOCKET).exists()
    finally:
        process.stop()
    assert not alive(process.pid or 0) and not (state / ADOPT_SOCKET).exists()
