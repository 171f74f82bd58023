"""The fanotify responder on this machine's own kernel: a real group, a real mark.

A tmpfs is mounted for each test and marked ``FAN_MARK_FILESYSTEM`` +
``FAN_OPEN_PERM``; the openers are real processes (``/bin/cat``, and a copy of
it named ``modprobe``, outside the marked filesystem, so the kernel reports a
module loader by its ``exe`` and ``comm``). Skipped, with the reason, where
this machine cannot mount or its kernel refuses a permission group. The same
code on the real Debian 6.1 kernel with an overlay root is the real-kernel
suite's part (a later slice).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.host.fanotify import (
    FAN_Q_OVERFLOW,
    METADATA,
    METADATA_VERSION,
    FanotifyGroup,
    PermEvent,
    parse_events,
)
from nodeagent.host.hold import Responder, sees_host_pids, start_hold

from .waiting import WAIT, until

CONTENT = b"\x7fELF not really a module\n"


@dataclass
class Marked:
    root: Path  # the marked filesystem's mount point
    target: Path  # .../nvidia-peermem.ko
    other: Path
    modprobe: str  # a copy of cat named modprobe, outside the mark
    gate: threading.Event
    responder: Responder


def _mount_tmpfs(where: Path) -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs to mark"
    p = subprocess.run(["mount", "-t", "tmpfs", "nodeagent-test", str(where)], capture_output=True)
    if p.returncode != 0:
        return f"mount -t tmpfs failed: {p.stderr.decode(errors='replace').strip()}"
    return None


@pytest.fixture
def marked(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Marked]:
    fs = tmp_path / "fs"
    fs.mkdir()
    why = _mount_tmpfs(fs)
    if why:
        pytest.skip(why)
    budget = getattr(request, "param", 60.0)
    responder = None
    try:
        moddir = fs / "lib/modules/6.1.0-test/kernel/drivers/video"
        moddir.mkdir(parents=True)
        target = moddir / "nvidia-peermem.ko"
        target.write_bytes(CONTENT)
        other = moddir / "nvidia.ko"
        other.write_bytes(b"other\n")
        bindir = tmp_path / "bin"
        bindir.mkdir()
        modprobe = bindir / "modprobe"
        shutil.copy("/bin/cat", modprobe)
        try:
            group = FanotifyGroup()
        except OSError as exc:
            pytest.skip(f"fanotify permission group refused here: {exc}")
        group.mark_filesystem(str(fs))
        gate = threading.Event()
        responder = Responder(group, gate_open=gate.is_set, budget_s=budget)
        responder.start()
        yield Marked(fs, target, other, str(modprobe), gate, responder)
    finally:
        if responder is not None:
            responder.stop()  # closes the group: the kernel allows whatever is pending
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def record_answers(responder: Responder) -> list[tuple[int, bool]]:
    """(pid, allow) of every answer the responder gives from now on."""
    answers: list[tuple[int, bool]] = []
    respond = responder.source.respond

    def recording(event: PermEvent, allow: bool) -> None:
        answers.append((event.pid, allow))
        respond(event, allow)

    responder.source.respond = recording  # type: ignore[method-assign]
    return answers


def two_rounds_later(other: Path) -> None:
    """Two opens of a file the hold does not name, one after the other, each answered: the
    responder has gone round its loop (answered what it read, then released what may go)
    at least once since anything it read before."""
    for _ in range(2):
        p = subprocess.run(["cat", str(other)], capture_output=True, timeout=WAIT)
        assert p.returncode == 0, p.stderr


def test_other_files_and_non_loaders_are_allowed_at_once(marked: Marked) -> None:
    # kmod's modinfo: exe says kmod (as for its modprobe), comm says modinfo: not a loader.
    bindir = os.path.dirname(marked.modprobe)
    shutil.copy("/bin/cat", os.path.join(bindir, "kmod"))
    modinfo = os.path.join(bindir, "modinfo")
    os.symlink("kmod", modinfo)
    for argv in (
        ["cat", str(marked.other)],
        ["cat", str(marked.target)],
        [modinfo, str(marked.target)],
    ):
        p = subprocess.run(argv, capture_output=True, timeout=WAIT)
        assert p.returncode == 0, p.stderr
    # (counted just after the answer that let the opener go on)
    until(lambda: marked.responder.counts["allowed"] >= 2, "the opens were not counted allowed")
    assert marked.responder.counts["held"] == 0


def test_a_loader_of_an_inbox_rdma_module_is_held_and_of_mofeds_is_not(marked: Marked) -> None:
    """The dependency a held peermem load would pull in first: the kernel's own ib_core."""
    tree = marked.root / "lib/modules/6.1.0-test"
    inbox = tree / "kernel/drivers/infiniband/core/ib_core.ko"
    mofed = tree / "updates/dkms/ib_core.ko"
    for f in (inbox, mofed):
        f.parent.mkdir(parents=True)
        f.write_bytes(CONTENT)
    p = subprocess.run([marked.modprobe, str(mofed)], capture_output=True, timeout=WAIT)
    assert p.returncode == 0 and marked.responder.counts["held"] == 0  # MOFED's: never held
    proc = subprocess.Popen([marked.modprobe, str(inbox)], stdout=subprocess.PIPE)
    try:
        until(lambda: marked.responder.held(), "the inbox ib_core open was not held")
        ((pid, _opener, path, _secs),) = marked.responder.held()
        assert pid == proc.pid and path.endswith("kernel/drivers/infiniband/core/ib_core.ko")
        marked.gate.set()
        marked.responder.wake()
        out, _ = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == CONTENT


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/lib/modules/6.1.0/kernel/drivers/video/nvidia-peermem.ko", "nvidia-peermem"),
        ("/x/updates/dkms/nvidia_peermem.ko.xz", "nvidia-peermem"),
        (
            "/lib/modules/6.1.0/kernel/drivers/infiniband/core/ib_core.ko.zst",
            "inbox RDMA dependency",
        ),
        (
            "/r/lib/modules/6.1.0/kernel/drivers/net/ethernet/mellanox/mlx5/core/mlx5_core.ko",
            "inbox RDMA dependency",
        ),
        ("/lib/modules/6.1.0/updates/dkms/ib_core.ko", None),
        ("/lib/modules/6.1.0/extra/mlnx-ofa_kernel/drivers/infiniband/core/ib_core.ko", None),
        ("/lib/modules/6.1.0/kernel/drivers/infiniband/core/ib_core.ko.bak", None),
        ("/lib/modules/6.1.0/kernel/drivers/net/dummy.ko", None),
        ("/lib/modules/6.1.0/modules.dep.bin", None),
        ("?", None),
    ],
)
def test_which_opens_the_hold_names(path: str, why: str | None) -> None:
    from nodeagent.core.hold import held_open

    assert held_open(path) == why


def test_a_loader_is_held_while_the_gate_is_closed_and_released_when_it_opens(
    marked: Marked,
) -> None:
    answers = record_answers(marked.responder)
    proc = subprocess.Popen([marked.modprobe, str(marked.target)], stdout=subprocess.PIPE)
    try:
        until(lambda: marked.responder.held(), "the loader's open was not held")
        ((pid, opener, path, _secs),) = marked.responder.held()
        assert (pid, opener, os.path.basename(path)) == (proc.pid, "modprobe", "nvidia-peermem.ko")
        two_rounds_later(marked.other)
        assert (proc.pid, True) not in answers and proc.poll() is None, "the held opener went on"
        assert len(marked.responder.held()) == 1
        marked.gate.set()
        marked.responder.wake()
        out, _ = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == CONTENT
    until(lambda: marked.responder.reports, "no report")
    (report,) = marked.responder.reports
    assert (report.pid, report.opener, report.ended) == (proc.pid, "modprobe", "gate opened")
    assert (proc.pid, True) in answers


def test_the_agents_own_open_is_never_held(marked: Marked) -> None:
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(marked.target.read_bytes()), daemon=True)
    reader.start()
    reader.join(WAIT)
    assert got == [CONTENT], "the agent's own open waited on its responder"


@pytest.mark.parametrize("marked", [0.3], indirect=True)
def test_the_hold_budget_expires_into_an_allowed_open_and_a_report(marked: Marked) -> None:
    p = subprocess.run([marked.modprobe, str(marked.target)], capture_output=True, timeout=WAIT)
    assert p.returncode == 0 and p.stdout == CONTENT
    until(lambda: marked.responder.reports, "no report")
    (report,) = marked.responder.reports
    assert report.ended == "budget expired" and report.seconds >= 0.3


def test_stopping_the_responder_releases_a_held_opener(marked: Marked) -> None:
    proc = subprocess.Popen([marked.modprobe, str(marked.target)], stdout=subprocess.PIPE)
    try:
        until(lambda: marked.responder.held(), "the loader's open was not held")
        marked.responder.stop(timeout=WAIT)
        out, _ = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == CONTENT
    assert [r.ended for r in marked.responder.reports] == ["responder stopped"]


def test_a_held_opener_can_be_killed_and_is_forgotten(marked: Marked) -> None:
    proc = subprocess.Popen([marked.modprobe, str(marked.target)], stdout=subprocess.PIPE)
    try:
        until(lambda: marked.responder.held(), "the loader's open was not held")
    finally:
        proc.kill()
    proc.wait(WAIT)  # the wait in the kernel is killable
    marked.responder.wake()
    # (the report is added just after the open leaves the held list)
    until(lambda: marked.responder.reports, "a dead opener is still held")
    assert marked.responder.held() == []
    assert [r.ended for r in marked.responder.reports] == ["opener gone"]
    # The responder still answers: the next open goes through.
    p = subprocess.run(["cat", str(marked.other)], capture_output=True, timeout=WAIT)
    assert p.returncode == 0


def record(event_len: int, vers: int = METADATA_VERSION, fd: int = -1, pid: int = 7) -> bytes:
    return METADATA.pack(event_len, vers, 0, METADATA.size, 0x10000, fd, pid)


def test_events_are_walked_by_event_len_and_bad_records_named() -> None:
    buf = record(METADATA.size, pid=1) + record(METADATA.size + 8, pid=2) + b"\0" * 8
    events, problems = parse_events(buf)
    assert [e.pid for e in events] == [1, 2] and problems == []
    events, problems = parse_events(record(METADATA.size, vers=2))
    assert events == [] and problems == ["fanotify metadata version 2, expected 3"]
    events, problems = parse_events(record(4 * METADATA.size))
    assert events == [] and "malformed" in problems[0]


def records(timeline: Path) -> list[dict[str, object]]:
    """The timeline's complete lines (the agent may be appending the next one)."""
    text = timeline.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def test_the_agent_holds_a_loader_until_its_gate_opens(tmp_path: Path) -> None:
    """End to end: `nodeagent run` with [peermem] hold_loads = "fanotify", the GPU driver
    root a marked tmpfs; a loader's open is held until MOFED's ready flag makes the gate open."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from nodeagent.core.peermem import PeermemPolicy
    from nodeagent.guards.peermem_hold import PeermemHold
    from nodeagent.sim.node import READY

    from .healthy import healthy_node

    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    driver = tmp_path / "run/nvidia/driver"
    driver.mkdir(parents=True)
    why = _mount_tmpfs(driver)
    if why:
        pytest.skip(why)
    agent = None
    thread = None
    node = None
    try:
        node = healthy_node(tmp_path, ready=False)
        (ko,) = driver.rglob("nvidia-peermem.ko*")
        other = driver / "not-a-module"
        other.write_bytes(b"other\n")
        modprobe = tmp_path / "modprobe"
        shutil.copy("/bin/cat", modprobe)
        pol = PeermemPolicy(hold_loads="fanotify", hold_roots=("run/nvidia/driver",))
        cfg = Config(
            host_root=str(tmp_path), mode="enforce", uevents=False, policies={"peermem": pol}
        )
        agent = Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [])
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)  # the peermem guard's host side
        until(lambda: side.hold is not None and agent.passes >= 1, "the hold did not start")
        hold = side.hold
        assert hold is not None and side.marked == ["run/nvidia/driver"]
        answers = record_answers(hold)
        proc = subprocess.Popen([str(modprobe), str(ko)], stdout=subprocess.PIPE)
        try:
            until(lambda: hold.held(), "the loader was not held")
            two_rounds_later(other)
            assert (proc.pid, True) not in answers and proc.poll() is None
            node.write(READY)  # MOFED: ready; the gate opens, the held open goes on
            out, _ = proc.communicate(timeout=WAIT)
        finally:
            proc.kill()
        assert proc.returncode == 0 and out == ko.read_bytes()
        status = json.loads((tmp_path / "run/nodeagent/status.json").read_text())
        assert status["hold"]["marked"] == ["run/nvidia/driver"]
        timeline = tmp_path / "var/lib/nodeagent/timeline.jsonl"
        until(
            lambda: any(r.get("kind") == "held-open" for r in records(timeline)),
            "the held open was not recorded",
        )
    finally:
        if agent is not None:
            agent.stop()
        if thread is not None:
            thread.join(WAIT)
        if node is not None:
            node.kernel.uevent_source.close()
        subprocess.run(["umount", "-l", str(driver)], capture_output=True)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"hold_loads": "yes"}, "peermem.hold_loads"),
        ({"hold_budget_seconds": 0}, "peermem.hold_budget_seconds: 0 is outside"),
        ({"hold_budget_seconds": 1e9}, "peermem.hold_budget_seconds"),
        ({"hold_budget_seconds": "600"}, "expected a number"),
        ({"hold_roots": "lib/modules"}, "peermem.hold_roots: expected a list of paths"),
        ({"hold_roots": ["/lib/modules"]}, "must be relative to the host root"),
        ({"hold_roots": ["lib/../../etc"]}, "without '..'"),
    ],
)
def test_bad_hold_settings_are_one_clear_line(table: dict[str, object], message: str) -> None:
    from nodeagent.config import config_from_mapping
    from nodeagent.errors import NodeagentError

    with pytest.raises(NodeagentError, match=re.escape(message)):
        config_from_mapping({"peermem": table})


def test_host_pids_are_told_by_nspid(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nNSpid:\t4242\n")
    assert sees_host_pids(str(status))
    status.write_text("Name:\tpython\nNSpid:\t4242\t7\n")  # in a pod without hostPID
    assert not sees_host_pids(str(status))


def test_the_hold_refuses_to_start_without_host_pids_in_one_line() -> None:
    closed: list[bool] = []

    class Source:
        def close(self) -> None:
            closed.append(True)

    responder, marked, problems = start_hold(
        Source(),  # type: ignore[arg-type]
        lambda _p: None,
        [("lib/modules", "/")],
        gate_open=lambda: False,
        budget_s=60,
        host_pids=False,
    )
    assert responder is None and marked == [] and closed == [True]
    (line,) = problems
    assert "does not see host PIDs" in line and "hostPID: true" in line


def test_held_opens_are_counted_by_how_they_ended() -> None:
    from nodeagent.host.hold_telemetry import HOLD_TELEMETRY
    from nodeagent.metrics import MetricsExporter

    m = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(HOLD_TELEMETRY,))
    for ended in ("gate opened", "budget expired", "gate opened", "something new"):
        m.on_record({"kind": "held-open", "ended": ended})
    text, _ = m.scrape(None)
    assert b'nodeagent_peermem_held_opens_total{ended="gate_opened"} 2.0' in text
    assert b'nodeagent_peermem_held_opens_total{ended="budget_expired"} 1.0' in text
    assert b'nodeagent_peermem_held_opens_total{ended="other"} 1.0' in text


class FakeSource:
    """An EventSource fed by the test (the interface the simulator will use)."""

    def __init__(self, events: list[PermEvent]) -> None:
        self.r, self.w = os.pipe()
        self.events = events
        self.answers: list[tuple[PermEvent, bool]] = []
        os.write(self.w, b"x")

    def fileno(self) -> int:
        return self.r

    def read(self) -> list[PermEvent]:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 16)
        out, self.events = self.events, []
        return out

    def respond(self, event: PermEvent, allow: bool) -> None:
        self.answers.append((event, allow))

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


def test_an_overflow_and_an_event_without_fd_are_allowed_and_counted() -> None:
    overflow = PermEvent(-1, 0, FAN_Q_OVERFLOW)
    nofd = PermEvent(-1, 4242, 0x10000)  # the kernel could not open the file: it denied
    source = FakeSource([overflow, nofd])
    responder = Responder(source, gate_open=lambda: False, budget_s=60, own_pid=1)
    responder.start()
    try:
        until(lambda: responder.counts["no_fd"] == 1, "both seen")
    finally:
        responder.stop()
    assert [allow for _e, allow in source.answers] == [True]  # the overflow; no_fd: nothing
    assert responder.counts["overflow"] == 1 and responder.counts["no_fd"] == 1
    assert responder.counts["held"] == 0


def test_a_marked_root_that_disappears_leaves_the_responder_answering(marked: Marked) -> None:
    subprocess.run(["umount", "-l", str(marked.root)], check=True)  # the mark goes with it
    p = subprocess.run([marked.modprobe, "/etc/hostname"], capture_output=True, timeout=WAIT)
    assert p.returncode == 0
    assert marked.responder._thread.is_alive() and marked.responder.held() == []
