"""The gate as a lease: no reader sees open longer than the lease after the decision closed
or the agent's last renewal, whatever fails.

A property test drives the agent's side of ``GateFiles`` (publish, renew, withdraw) on a
real host root with a fake boot-time clock, through decisions, write failures, stalls,
wall-clock steps and files tampered with, and reads after every step. Fault tests run the
real agent loop (and the real ``nodeagent wait``) against an immutable gate file, a
read-only state dir, a symlinked state dir and a stopped agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.errors import NodeagentError
from nodeagent.host.fs import HostRoot
from nodeagent.host.gatefile import LEASE_S, LEASE_SLACK_S, GateFiles, lease_clock
from nodeagent.sim.node import Node
from tests.waiting import WAIT, until

GATE = "run/nodeagent/peermem.gate"

# -- the property -------------------------------------------------------------------

Step = tuple[str, float]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("decide-open"), st.just(0.0)),
        st.tuples(st.just("decide-closed"), st.just(0.0)),
        st.tuples(st.just("renew"), st.just(0.0)),
        st.tuples(st.just("time"), st.floats(0.0, 10.0)),  # the loop is stalled this long
        st.tuples(st.just("writes-fail"), st.just(0.0)),
        st.tuples(st.just("writes-work"), st.just(0.0)),
        st.tuples(st.just("wall-step"), st.sampled_from([-3600.0, 3600.0, 1e9])),
        # Absurd numbers written into the file. A plausible lease (now + 3 s) written by
        # someone who can write the state dir is a forgery the reader cannot tell from the
        # agent's: outside what a lease can promise (the dir is root's; docs/reliability.md).
        st.tuples(st.just("tamper"), st.sampled_from([1e308, 86400.0, 60.0, -1.0, float("nan")])),
    ),
    max_size=40,
)


class _Failing:
    """A host root whose writes and removals fail while ``failing`` (immutable file, read-only
    or replaced state dir: the agent cannot change the gate file)."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self.failing = False

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.host, name)
        if name in ("write_atomic", "remove") and self.failing:

            def fail(*a: object, **k: object) -> object:
                raise PermissionError(1, "Operation not permitted")

            return fail
        return attr


@settings(max_examples=150, deadline=None)
@given(steps)
def test_no_reader_sees_open_past_the_lease(
    tmp_path_factory: pytest.TempPathFactory, plan: list[Step]
) -> None:
    root = tmp_path_factory.mktemp("lease")
    now = [1000.0]
    wall = [1.7e9]
    host = _Failing(HostRoot(root))
    gates = GateFiles(host, "run/nodeagent", clock=lambda: now[0], boot=lambda: "boot-a")  # type: ignore[arg-type]
    decision_open = False
    closed_at: float | None = 0.0  # when the decision last went closed
    renewed_at: float | None = None  # the last successful open write
    for kind, x in plan:
        if kind == "decide-open" or (kind == "renew" and decision_open):
            decision_open = True
            closed_at = None
            published, _problems = gates.publish({"peermem": True}, wall[0])
            if published:
                renewed_at = now[0]
        elif kind == "decide-closed":
            if decision_open:
                closed_at = now[0]
            decision_open = False
            gates.withdraw(["peermem"])
        elif kind == "time":
            now[0] += x
        elif kind == "writes-fail":
            host.failing = True
        elif kind == "writes-work":
            host.failing = False
        elif kind == "wall-step":
            wall[0] += x
        elif kind == "tamper" and (root / GATE).exists():  # someone edits the file
            doc = json.loads((root / GATE).read_text())
            doc["lease_until"] = now[0] + x if x == x else x
            with contextlib.suppress(OSError):
                (root / GATE).write_text(json.dumps(doc))
        reading = gates.read("peermem")
        if reading.is_open:
            # Open only within the lease of a real renewal ...
            assert renewed_at is not None and now[0] - renewed_at < LEASE_S + LEASE_SLACK_S
            # ... and never past the lease after the decision closed.
            assert closed_at is None or now[0] - closed_at < LEASE_S + LEASE_SLACK_S


def test_absurd_leases_and_other_boots_read_closed(tmp_path: Path) -> None:
    gates = GateFiles(HostRoot(tmp_path), "run/nodeagent", clock=lambda: 50.0, boot=lambda: "b")
    assert gates.publish({"peermem": True}, 1.0) == (["peermem"], [])
    assert gates.read("peermem").is_open
    assert not gates.read("peermem", now_boot=50.0 + LEASE_S).is_open  # expired
    assert "another boot" in gates.read("peermem", my_boot="other").reason
    doc = json.loads((tmp_path / GATE).read_text())
    for lease_until in (1e308, 50.0 + 3600, float("inf")):
        doc["lease_until"] = lease_until
        (tmp_path / GATE).write_text(json.dumps(doc))
        assert not gates.read("peermem").is_open, lease_until


# -- the real agent, faults ------------------------------------------------------------------


@pytest.fixture
def running(tmp_path: Path, ready_node: Node) -> Iterator[tuple[Path, object]]:
    """The real agent loop (enforce, real inotify) on a healthy node whose gate is open."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config

    cfg = Config(host_root=str(tmp_path), mode="enforce", uevents=False, resync_seconds=3600)
    agent = Agent(cfg, module_ops=ready_node.kernel, kernel_log=lambda m: [])
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    gates = GateFiles(HostRoot(tmp_path), "run/nodeagent")
    try:
        until(lambda: gates.read("peermem").is_open, "the gate never opened")
        yield tmp_path, agent
    finally:
        agent.stop()
        thread.join(WAIT)


def _close_decision(root: Path) -> None:
    (root / "run/mellanox/drivers/.driver-ready").unlink()  # MOFED restarting: closed


def _reads_closed_within_the_lease(gates: GateFiles, stuck_at: float, what: str) -> None:
    """Read until a reader sees closed; no read that saw open began ``LEASE_S`` or more after
    ``stuck_at`` (a boot-time moment after which the agent can renew nothing): judged on the
    boot-time clock the lease is on, not on how quickly this test got to read."""
    late: list[float] = []

    def closed() -> bool:
        began = lease_clock()
        if gates.read("peermem").is_open:
            if began >= stuck_at + LEASE_S:
                late.append(began - stuck_at)
            return False
        return True

    until(closed, what)
    assert not late, f"read open {max(late):.2f}s after the last possible renewal"


def _closed_within_the_lease(root: Path, agent: object, stuck_at: float) -> None:
    """After the decision closed with the file stuck (since ``stuck_at``), a reader sees
    closed within the lease, and the agent has said, loudly, that it cannot withdraw it."""
    gates = GateFiles(HostRoot(root), "run/nodeagent")
    _reads_closed_within_the_lease(gates, stuck_at, "a reader still sees open")
    stuck = agent.gates.stuck
    until(lambda: "peermem" in stuck, "the failed withdrawal was not noticed")
    timeline = root / "var/lib/nodeagent/timeline.jsonl"
    recs = [json.loads(line) for line in timeline.open()] if timeline.exists() else []
    assert any(r.get("kind") == "gate-withdrawal" and r.get("ok") is False for r in recs)


def _make_immutable(path: Path) -> None:
    """``chattr +i`` the file at ``path``. The agent renews the gate by renaming a new file
    over it: a renewal that lands between chattr's open and its ioctl leaves the flag on
    the file it replaced, and the one at ``path`` is withdrawn as usual. So: until the file
    at ``path`` is the one chattr flagged (the same inode before and after)."""
    for _ in range(20):
        before = os.stat(path).st_ino
        p = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"this filesystem refuses chattr +i: {p.stderr.strip()}")
        if os.stat(path).st_ino == before:
            return
    raise AssertionError(f"{path} was replaced at each of 20 chattr +i")


def test_an_immutable_gate_file_expires_within_the_lease(running: tuple[Path, object]) -> None:
    root, agent = running
    if shutil.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) is not installed")
    _make_immutable(root / GATE)
    stuck_at = lease_clock()  # no renewal lands after this
    try:
        _close_decision(root)
        _closed_within_the_lease(root, agent, stuck_at)
        assert (root / GATE).exists()  # still there, and read as closed
    finally:
        subprocess.run(["chattr", "-i", str(root / GATE)], capture_output=True)
    stuck = agent.gates.stuck
    until(lambda: "peermem" not in stuck, "the withdrawal was not retried once possible")
    until(lambda: not (root / GATE).exists(), "the file was not withdrawn on retry")


def test_a_read_only_state_dir_expires_within_the_lease(running: tuple[Path, object]) -> None:
    root, agent = running
    state = root / "run/nodeagent"
    if os.geteuid() != 0:
        pytest.skip("not root: cannot bind-mount the state dir read-only")
    p = subprocess.run(["mount", "--bind", str(state), str(state)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {p.stderr.strip()}")
    try:
        for _ in range(50):  # busy while the running agent has a file open for writing there
            p = subprocess.run(
                ["mount", "-o", "remount,bind,ro", str(state)], capture_output=True, text=True
            )
            if p.returncode == 0 or "busy" not in p.stderr:
                break
        if p.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {p.stderr.strip()}")
        stuck_at = lease_clock()  # no renewal lands after this
        _close_decision(root)
        _closed_within_the_lease(root, agent, stuck_at)
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)


def test_a_symlinked_state_dir_is_not_followed_and_its_gate_reads_closed(
    running: tuple[Path, object],
) -> None:
    root, _agent = running
    state = root / "run/nodeagent"
    elsewhere = root / "elsewhere"
    # (the agent's atomic writes come and go as .tmp files while it runs: not copied)
    shutil.copytree(state, elsewhere, ignore=shutil.ignore_patterns(".*.tmp.*"))
    moved = root / "run/nodeagent.real"
    os.rename(state, moved)
    os.symlink(elsewhere, state)  # an open gate file, behind a symlink
    replaced_at = lease_clock()  # the agent's own file is elsewhere now
    gates = GateFiles(HostRoot(root), "run/nodeagent")
    _reads_closed_within_the_lease(gates, replaced_at, "a symlinked state dir read open")
    _close_decision(root)
    until(lambda: not gates.read("peermem").is_open, "open behind a symlink")
    with pytest.raises((OSError, NodeagentError)):
        HostRoot(root).read_bytes(GATE, 4096)  # the reader never follows it


AGENT = """
import sys
from nodeagent.cli import main
sys.exit(main(["run", "--host-root", sys.argv[1], "--mode", "observe", "--metrics-address", "off"]))
"""


def _all_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (state T): none is inside a system call."""
    try:
        stats = [(t / "stat").read_text() for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # a thread came or went while listing: look again
        return False
    return bool(stats) and all(x.rsplit(")", 1)[1].split()[0] == "T" for x in stats)


def test_a_stopped_agent_stops_renewing_and_wait_answers_closed(
    tmp_path: Path, ready_node: Node
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gates = GateFiles(HostRoot(tmp_path), "run/nodeagent")
    try:
        until(lambda: gates.read("peermem").is_open, "the gate never opened")
        opened_at = lease_clock()
        # Open past the first lease: only a renewal keeps it so.
        until(
            lambda: lease_clock() > opened_at + LEASE_S and gates.read("peermem").is_open,
            "the running agent did not renew its lease",
        )
        proc.send_signal(signal.SIGSTOP)  # stuck: alive, renewing nothing
        until(lambda: _all_stopped(proc.pid), "the agent did not stop")
        stopped_at = lease_clock()  # every thread stopped: no write in flight
        _reads_closed_within_the_lease(gates, stopped_at, "open after the agent stopped")
        wait = subprocess.run(
            [
                sys.executable,
                "-m",
                "nodeagent",
                "wait",
                "peermem",
                "--host-root",
                str(tmp_path),
                "--timeout",
                "0",
            ],
            capture_output=True,
            text=True,
        )
        assert wait.returncode == 1 and "the lease expired" in wait.stderr
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


# -- time: a stepped wall clock moves no schedule ------------------------------------------


def test_the_agents_clock_ignores_wall_clock_steps() -> None:
    from nodeagent.agent import SteadyClock

    wall, mono = [1.7e9], [100.0]
    clock = SteadyClock(wall=lambda: wall[0], monotonic=lambda: mono[0])
    assert clock() == 1.7e9
    mono[0] += 5.0
    wall[0] -= 3600.0  # stepped back an hour
    assert clock() == 1.7e9 + 5.0
    wall[0] += 7200.0  # and forward
    mono[0] += 1.0
    assert clock() == 1.7e9 + 6.0


@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_a_wall_clock_step_stops_neither_the_resync_nor_the_lease(
    tmp_path: Path, ready_node: Node, step: float
) -> None:
    from nodeagent.agent import Agent, SteadyClock
    from nodeagent.config import Config

    offset = [0.0]
    cfg = Config(host_root=str(tmp_path), mode="observe", uevents=False, resync_seconds=0.3)
    agent = Agent(
        cfg,
        module_ops=ready_node.kernel,
        kernel_log=lambda m: [],
        clock=SteadyClock(wall=lambda: time.time() + offset[0]),
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    gates = GateFiles(HostRoot(tmp_path), "run/nodeagent")
    try:
        until(lambda: agent.passes >= 3 and gates.read("peermem").is_open, "no passes")
        offset[0] = step  # the node's clock is stepped under the running agent
        before = agent.passes
        stepped_at = lease_clock()
        until(lambda: agent.passes >= before + 4, "the resync stopped after the clock step")
        # Open once every lease written before the step has run out: renewed after it.
        until(
            lambda: lease_clock() > stepped_at + LEASE_S and gates.read("peermem").is_open,
            "the lease was not renewed after the step",
        )
    finally:
        agent.stop()
        thread.join(WAIT)
