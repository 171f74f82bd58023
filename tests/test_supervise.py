"""``nodeagent supervise`` (issue 52): the container's first process, so an agent crash is
not a pod death. Real processes: the supervisor runs a stand-in agent (``tests/sup_agent.py``)
that writes its pid, its child's pid and each signal it gets to files in a directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from nodeagent.supervise import children
from tests.waiting import WAIT, until

REPO = Path(__file__).resolve().parent.parent


def _supervisor(where: Path, *agent_args: str) -> subprocess.Popen[bytes]:
    """The supervisor, with the stand-in as its agent (``Supervisor``'s argv)."""
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
            "tests.sup_agent",
            str(where),
            *list(agent_args),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _agents(where: Path) -> list[int]:
    return [int(p.name.split(".")[1]) for p in where.glob("agent.*") if p.name.count(".") == 1]


def _ppid(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rfind(b")") + 2 :].split()[1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_bytes().split(b") ")[1][:1] == b"Z"


def _kill_all(sup: subprocess.Popen[bytes], where: Path) -> None:
    for pid in [*_agents(where), *(int(p.read_text()) for p in where.glob("*.child"))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if sup.poll() is None:
        sup.kill()
    sup.wait(WAIT)


def test_an_agent_killed_alone_is_started_again_and_what_it_left_is_reaped_here(
    tmp_path: Path,
) -> None:
    sup = _supervisor(tmp_path)
    try:
        (first,) = until(lambda: _agents(tmp_path), "the agent did not start")
        left = int(until(lambda: (tmp_path / f"agent.{first}.child").read_text(), "no child"))
        assert _ppid(first) == sup.pid
        os.kill(first, signal.SIGKILL)  # an OOM kill of the agent alone
        second = until(
            lambda: [p for p in _agents(tmp_path) if p != first], "the agent was not restarted"
        )[0]
        assert sup.poll() is None and _ppid(second) == sup.pid
        # What the dead agent left (its responder, in the pod) is the supervisor's now, not
        # the host's init's: still alive, reaped here when it ends.
        assert _ppid(left) == sup.pid and not _gone(left)
        os.kill(left, signal.SIGKILL)
        until(lambda: not Path(f"/proc/{left}").exists(), "the orphan was not reaped")
    finally:
        _kill_all(sup, tmp_path)


def test_sigterm_is_forwarded_and_the_supervisor_ends_with_the_agent(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "--exit-on-term", "7")
    try:
        (agent,) = until(lambda: _agents(tmp_path), "the agent did not start")
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(WAIT) == 7  # the agent's own code: it drained and stopped
        assert (tmp_path / f"agent.{agent}.signals").read_text().split() == ["SIGTERM"]
        assert _agents(tmp_path) == [agent]  # never started again
    finally:
        _kill_all(sup, tmp_path)


def test_a_stop_lets_what_is_left_under_it_go(tmp_path: Path) -> None:
    """An agent that died leaves its responder; a stop before any agent adopted it ends
    it (SIGTERM: a stop lets held loads go), and the supervisor leaves nothing behind."""
    sup = _supervisor(tmp_path)
    try:
        (first,) = until(lambda: _agents(tmp_path), "the agent did not start")
        left = int(until(lambda: (tmp_path / f"agent.{first}.child").read_text(), "no child"))
        os.kill(first, signal.SIGKILL)
        second = until(
            lambda: [p for p in _agents(tmp_path) if p != first], "the agent was not restarted"
        )[0]
        its = int(until(lambda: (tmp_path / f"agent.{second}.child").read_text(), "no child"))
        assert sorted(children(sup.pid)) == sorted([left, second])
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(WAIT) == 0
        for pid in (left, its):  # ended and reaped: nothing left behind
            assert not Path(f"/proc/{pid}").exists()
    finally:
        _kill_all(sup, tmp_path)


def test_an_agent_that_stops_by_itself_or_cannot_start_is_not_started_again(
    tmp_path: Path,
) -> None:
    for code in (0, 2):
        where = tmp_path / str(code)
        where.mkdir()
        sup = _supervisor(where, "--exit-now", str(code))
        try:
            assert sup.wait(WAIT) == code
            assert len(_agents(where)) == 1
        finally:
            _kill_all(sup, where)


def test_the_cli_runs_the_supervisor() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "supervise", "--version"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert p.returncode == 0 and p.stdout.startswith("nodeagent "), p


def test_no_command_is_a_usage_error() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "nodeagent", "supervise"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert p.returncode == 2 and p.stderr.startswith("usage: nodeagent supervise") and not p.stdout
