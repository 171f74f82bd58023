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

import collections
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

from nodeagent.guards.peermem.budget import Caps
from nodeagent.guards.peermem.openers import Openers
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.start import sees_host_pids, spawner, start_hold
from nodeagent.host.fanotify import (
    FAN_Q_OVERFLOW,
    METADATA,
    METADATA_VERSION,
    FanotifyGroup,
    PermEvent,
    parse_events,
)
from tests.guards.peermem.fakes import Clock, FakeSource, FedSource, Opens, OverflowingGroup, capped
from tests.guards.peermem.rig import fake_modprobe, mount_tmpfs, records, start_flood
from tests.waiting import WAIT, until

CONTENT = b"\x7fELF not really a module\n"


@dataclass
class Marked:
    root: Path  # the marked filesystem's mount point
    target: Path  # .../nvidia-peermem.ko
    other: Path
    modprobe: str  # a copy of cat named modprobe, outside the mark
    gate: threading.Event
    responder: Responder


def _layout(tmp_path: Path) -> tuple[Path, Path, Path, str, FanotifyGroup]:
    """A tmpfs with a driver tree (nvidia-peermem.ko and another .ko), a ``modprobe`` (a
    copy of cat: a module loader by name) and a fresh group; skips where either is refused."""
    fs = tmp_path / "fs"
    fs.mkdir()
    why = mount_tmpfs(fs)
    if why:
        pytest.skip(why)
    moddir = fs / "lib/modules/6.1.0-test/kernel/drivers/video"
    moddir.mkdir(parents=True)
    target = moddir / "nvidia-peermem.ko"
    target.write_bytes(CONTENT)
    other = moddir / "nvidia.ko"
    other.write_bytes(b"other\n")
    modprobe = fake_modprobe(tmp_path)
    try:
        group = FanotifyGroup()
    except OSError as exc:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)
        pytest.skip(f"fanotify permission group refused here: {exc}")
    return fs, target, other, modprobe, group


@pytest.fixture
def marked(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Marked]:
    fs, target, other, modprobe, group = _layout(tmp_path)
    budget = getattr(request, "param", 60.0)
    responder = None
    try:
        group.mark_filesystem(str(fs))
        gate = threading.Event()
        responder = Responder(group, gate_open=gate.is_set, budget_s=budget)
        responder.start()
        yield Marked(fs, target, other, modprobe, gate, responder)
    finally:
        if responder is not None:
            responder.stop()  # closes the group: the kernel allows whatever is pending
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


@pytest.fixture(params=["process", "thread"])
def marked_flood(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Marked]:
    """As ``marked``, the hold started as the agent starts it (``start_hold``: the
    descriptor limit raised, the caps fitted in it), its responder in a process apart
    (the agent's way) or in a thread of this one. The gate is both ``gate`` (the thread
    reads it) and ``follow`` (the process reads its lease): set both, as ``open_gate``."""
    fs, target, other, modprobe, group = _layout(tmp_path)
    responder = None
    try:
        gate = threading.Event()
        responder, marked, problems = start_hold(
            group,
            group.mark_filesystem,
            [("fs", str(fs))],
            gate_open=gate.is_set,
            budget_s=60.0,
            host_pids=True,
            apart=spawner(group, budget_s=60.0) if request.param == "process" else None,
        )
        assert responder is not None and marked == ["fs"] and problems == []
        yield Marked(fs, target, other, modprobe, gate, responder)
    finally:
        if responder is not None:
            responder.stop()
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def open_gate(m: Marked, is_open: bool) -> None:
    """The gate as the agent tells it: the thread reads ``gate``, the process its lease."""
    if is_open:
        m.gate.set()
    else:
        m.gate.clear()
    m.responder.follow(is_open)


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


def test_the_agent_holds_a_loader_until_its_gate_opens(tmp_path: Path) -> None:
    """End to end: `nodeagent run` with [peermem] hold_loads = "fanotify", the GPU driver
    root a marked tmpfs; a loader's open is held until MOFED's ready flag makes the gate open."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from nodeagent.core.peermem import PeermemPolicy
    from nodeagent.guards.peermem.side import PeermemHold
    from nodeagent.sim.node import READY
    from tests.healthy import healthy_node

    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    driver = tmp_path / "run/nvidia/driver"
    driver.mkdir(parents=True)
    why = mount_tmpfs(driver)
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
        modprobe = fake_modprobe(tmp_path)
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
        assert getattr(hold, "pid", None) not in (None, os.getpid())  # a process apart
        proc = subprocess.Popen([modprobe, str(ko)], stdout=subprocess.PIPE)
        try:
            until(lambda: proc.pid in [h[0] for h in hold.held()], "the loader was not held")
            two_rounds_later(other)  # answered by the process apart, the loader still held
            assert proc.poll() is None and proc.pid in [h[0] for h in hold.held()]
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
    from nodeagent.guards.peermem.telemetry import HOLD_TELEMETRY
    from nodeagent.metrics import MetricsExporter

    m = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(HOLD_TELEMETRY,))
    for ended in ("gate opened", "budget expired", "gate opened", "something new"):
        m.on_record({"kind": "held-open", "ended": ended})
    text, _ = m.scrape(None)
    assert b'nodeagent_peermem_held_opens_total{ended="gate_opened"} 2.0' in text
    assert b'nodeagent_peermem_held_opens_total{ended="budget_expired"} 1.0' in text
    assert b'nodeagent_peermem_held_opens_total{ended="other"} 1.0' in text


def test_an_overflow_and_an_event_without_fd_are_allowed_and_counted() -> None:
    overflow = PermEvent(-1, 0, FAN_Q_OVERFLOW)
    nofd = PermEvent(-1, 4242, 0x10000)  # the kernel could not open the file: it denied
    source = FakeSource([overflow, nofd])
    responder = Responder(source, gate_open=lambda: False, budget_s=60, openers=Openers(own_pid=1))
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


# -- the unlimited queue, and what an overflow means ----------------------------------


def test_a_burst_of_overflows_is_one_notice_saying_what_it_means_and_the_responder_goes_on() -> (
    None
):
    clock = Clock()
    source = FedSource([])
    responder = Responder(
        source,
        gate_open=lambda: False,
        budget_s=60,
        openers=Openers(own_pid=1),
        caps=Caps(burst_quiet_s=2.0),
        clock=clock,
    )
    responder.start()
    try:
        overflow = PermEvent(-1, 0, FAN_Q_OVERFLOW)
        source.feed(overflow, overflow)
        until(lambda: responder.counts["overflow"] == 2, "the overflows were not counted")
        clock.t += 1.0  # within the burst
        source.feed(overflow)
        until(lambda: responder.counts["overflow"] == 3, "the third was not counted")
        assert not responder.notices, "said before the burst was over"
        clock.t += 2.0  # quiet for the burst's spell: it is over
        responder.wake()
        (notice,) = until(lambda: list(responder.notices), "the burst was not said")
        assert notice["kind"] == "hold-overflow" and notice["count"] == 3
        assert notice["gate_closed"] is True and notice["seconds"] == 1.0
        assert "may have gone through while the gate was closed" in notice["meaning"]
        # The responder goes on: a later open is answered.
        later = PermEvent(-1, 4242, 0x10000)
        source.feed(later)
        until(lambda: responder.counts["no_fd"] == 1, "the responder stopped answering")
        assert responder._thread.is_alive()
    finally:
        responder.stop()
    assert len(responder.notices) == 1


def test_an_overflow_burst_still_open_at_stop_is_said() -> None:
    source = FedSource([PermEvent(-1, 0, FAN_Q_OVERFLOW)])
    gate = threading.Event()
    gate.set()
    responder = Responder(source, gate_open=gate.is_set, budget_s=60, openers=Openers(own_pid=1))
    responder.start()
    until(lambda: responder.counts["overflow"] == 1, "the overflow was not counted")
    responder.stop()
    (notice,) = responder.notices
    assert notice["gate_closed"] is False and "the gate was open" in notice["meaning"]


def test_overflows_are_a_counter_fed_by_their_records() -> None:
    from nodeagent.guards.peermem.telemetry import HOLD_TELEMETRY
    from nodeagent.metrics import MetricsExporter

    m = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(HOLD_TELEMETRY,))
    m.on_record({"kind": "hold-overflow", "count": 3})
    m.on_record({"kind": "hold-overflow", "count": 2})
    text, _ = m.scrape(None)
    assert b"nodeagent_peermem_hold_overflows_total 5.0" in text


def test_the_group_asks_for_an_unlimited_queue_and_says_when_the_kernel_refuses_it() -> None:
    import ctypes
    import errno

    from nodeagent.host.fanotify import FAN_UNLIMITED_QUEUE

    class Libc:
        def __init__(self, refuse: bool) -> None:
            self.refuse = refuse
            self.calls: list[int] = []

        def fanotify_init(self, flags: int, _event_flags: int) -> int:
            self.calls.append(flags)
            if self.refuse and flags & FAN_UNLIMITED_QUEUE:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return os.dup(0)

    libc = Libc(refuse=False)
    group = FanotifyGroup(libc=libc)
    group.close()
    assert libc.calls[0] & FAN_UNLIMITED_QUEUE and group.unlimited_queue
    assert group.queue_problem is None
    libc = Libc(refuse=True)
    group = FanotifyGroup(libc=libc)
    group.close()
    assert len(libc.calls) == 2 and not libc.calls[1] & FAN_UNLIMITED_QUEUE
    assert not group.unlimited_queue and group.queue_problem is not None
    assert "FAN_UNLIMITED_QUEUE" in group.queue_problem and "bounded queue" in group.queue_problem


def test_this_kernel_gives_the_group_an_unlimited_queue() -> None:
    from nodeagent.host.fanotify import FAN_UNLIMITED_QUEUE

    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"fanotify permission group refused here: {exc}")
    try:
        assert group.unlimited_queue and group.queue_problem is None
        info = Path(f"/proc/self/fdinfo/{group.fd}").read_text()
        m = re.search(r"^fanotify flags:([0-9a-f]+) ", info, re.M)
        assert m and int(m.group(1), 16) & FAN_UNLIMITED_QUEUE, info
    finally:
        group.close()


def test_the_agent_records_an_overflow_burst_and_counts_it(tmp_path: Path) -> None:
    """Through the agent: the group's overflow becomes one ``hold-overflow`` record (and a
    bounded queue a state problem), the record feeds the counter, status says the queue."""
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from nodeagent.core.peermem import PeermemPolicy
    from nodeagent.guards.peermem.start import HoldHost
    from nodeagent.guards.peermem.telemetry import HOLD_TELEMETRY
    from nodeagent.metrics import MetricsExporter
    from tests.healthy import healthy_node

    (tmp_path / "run/nvidia/driver").mkdir(parents=True)
    group = OverflowingGroup([])
    recorded: list[dict[str, object]] = []
    metrics = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(HOLD_TELEMETRY,))

    def on_record(rec: dict[str, object]) -> None:
        recorded.append(rec)
        metrics.on_record(rec)

    node = healthy_node(tmp_path, ready=False)
    pol = PeermemPolicy(
        hold_loads="fanotify", hold_roots=("run/nvidia/driver",), hold_containers=()
    )
    cfg = Config(host_root=str(tmp_path), mode="enforce", uevents=False, policies={"peermem": pol})
    host = HoldHost(group=lambda: group, host_pids=lambda: True)
    agent = Agent(
        cfg,
        module_ops=node.kernel,
        kernel_log=lambda m: [],
        guard_ports={"peermem": host},
        on_record=on_record,
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        side = agent.side("peermem")
        until(lambda: side.hold is not None and agent.passes >= 1, "the hold did not start")
        side.hold.burst_quiet_s = 0.0  # each read's overflows are a burst of their own
        group.feed(PermEvent(-1, 0, FAN_Q_OVERFLOW), PermEvent(-1, 0, FAN_Q_OVERFLOW))
        (rec,) = until(
            lambda: [r for r in list(recorded) if r.get("kind") == "hold-overflow"],
            "the overflow was not recorded",
        )
        assert rec["count"] == 2 and rec["gate_closed"] is True and rec["guard"] == "peermem"
        assert "may have gone through while the gate was closed" in str(rec["meaning"])
        text, _ = metrics.scrape(None)
        assert b"nodeagent_peermem_hold_overflows_total 2.0" in text
        assert any(
            r.get("kind") == "state-problem" and "FAN_UNLIMITED_QUEUE" in str(r.get("problem"))
            for r in recorded
        )
        status = until(
            lambda: (side.status() or {}).get("counts", {}).get("overflow") == 2 and side.status(),
            "status does not count the overflows",
        )
        assert status["queue"] == "bounded"
        assert status["responder"] == "answering"
        fds = status["descriptors"]  # the limit raised at start, the reserve, in use now
        assert fds["limit"] >= fds["reserve"] + fds["held_total"] + fds["per_read"]
        assert 0 < fds["in_use"] < fds["limit"] and fds["held_now"] == 0
        assert side.hold._thread.is_alive()
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()


# -- bounds on held opens, the descriptor budget, faults survived ---------------------


def test_the_descriptor_limit_is_raised_and_the_caps_fit_in_it() -> None:
    import resource

    from nodeagent.guards.peermem.budget import (
        FD_RESERVE,
        HELD_PER_CONTAINER,
        HELD_TOTAL,
        descriptor_budget,
    )
    from nodeagent.host.fanotify import READ_EVENTS

    set_to: list[tuple[int, int]] = []
    budget, problems = descriptor_budget(
        getrlimit=lambda _r: (1024, 65536), setrlimit=lambda _r, lim: set_to.append(lim)
    )
    assert set_to == [(65536, 65536)] and problems == []
    assert (budget.limit, budget.hard, budget.reserve) == (65536, 65536, FD_RESERVE)
    assert (budget.held_total, budget.held_per_container) == (HELD_TOTAL, HELD_PER_CONTAINER)
    assert budget.held_total + READ_EVENTS + budget.reserve <= budget.limit

    def refuse(_r: int, _lim: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    budget, problems = descriptor_budget(getrlimit=lambda _r: (512, 512), setrlimit=refuse)
    assert budget.limit == 512 and budget.held_total == 512 - FD_RESERVE - READ_EVENTS
    assert budget.held_total + READ_EVENTS + budget.reserve <= budget.limit
    (line,) = problems
    assert "leaves room for 128 held opens" in line
    budget, problems = descriptor_budget(getrlimit=lambda _r: (100, 200), setrlimit=refuse)
    assert budget.held_total == 0 and budget.held_per_container == 0
    assert len(problems) == 2 and "cannot raise the descriptor limit from 100 to 200" in problems[0]
    assert resource.getrlimit(resource.RLIMIT_NOFILE)  # (the process's own is untouched)


def test_past_a_cap_an_open_goes_on_at_once_and_a_burst_is_one_notice(tmp_path: Path) -> None:
    clock, source, gate = Clock(), Opens(), threading.Event()
    responder = capped(source, clock, gate, tmp_path, Caps(held_per_container=3, held_total=5))
    responder.start()
    try:
        source.feed(*source.opens(100, 5))  # container A: 3 held, 2 past its cap
        until(lambda: responder.counts["over_cap"] == 2, "A's opens past its cap")
        source.feed(*source.opens(300, 3))  # container B: 2 held (5 in all), 1 past the total
        until(lambda: responder.counts["over_cap"] == 3, "B's open past the total")
        assert len(responder.held()) == 5 and responder.counts["held"] == 5
        allowed = [e.pid for e, allow in source.answers if allow]
        assert sorted(allowed) == [100, 100, 300]
        clock.t += 2.0
        responder.wake()
        (notice,) = until(lambda: list(responder.notices), "the burst was not said")
        assert notice["kind"] == "hold-over-cap" and notice["count"] == 3
        assert (notice["past_container_cap"], notice["past_total_cap"]) == (2, 1)
        assert notice["container"] == "mnt:[A]" and notice["opener"] == "modprobe"
        assert "allowed at once" in notice["meaning"]
        gate.set()  # the gate still works: everything held goes
        responder.wake()
        until(lambda: not responder.held(), "the held opens were not let go")
        gate.clear()  # and the caps count afresh
        source.feed(*source.opens(101, 3))
        until(lambda: len(responder.held()) == 3, "A's opens were not held again")
        assert responder.counts["over_cap"] == 3
    finally:
        responder.stop()


class FailingReads(FedSource):
    """read() raises ``errors`` (one per call) before it gives anything."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__([])
        self.errors = errors
        self.reads = 0

    def read(self) -> list[PermEvent]:
        self.reads += 1
        if self.errors:
            with contextlib.suppress(BlockingIOError):
                os.read(self.r, 16)
            os.write(self.w, b"x")  # still readable: the responder must not spin on it
            raise self.errors.pop(0)
        return super().read()


def test_emfile_while_reading_is_survived_reported_and_answering_goes_on() -> None:
    import errno

    from nodeagent.guards.peermem.telemetry import HOLD_TELEMETRY
    from nodeagent.metrics import MetricsExporter

    clock = Clock()
    emfile = OSError(errno.EMFILE, "Too many open files")
    source = FailingReads([emfile, emfile, OSError(errno.ENFILE, "Too many open files in system")])
    responder = Responder(
        source, gate_open=lambda: False, budget_s=60, openers=Openers(own_pid=1), clock=clock
    )
    responder.start()
    try:
        source.feed(PermEvent(-1, 4242, 0x10000))
        until(lambda: responder.counts["no_fd"] == 1, "the responder did not read again")
        assert responder._thread.is_alive() and responder.counts["faults"] == 3
        assert source.reads <= 8, "the responder spun on the failing read"
        clock.t += 2.0
        responder.wake()
        notices = until(lambda: len(responder.notices) == 2 and list(responder.notices), "said")
    finally:
        responder.stop()
    by_fault = {n["fault"]: n for n in notices}
    assert by_fault["EMFILE"]["kind"] == "hold-fault" and by_fault["EMFILE"]["count"] == 2
    assert by_fault["ENFILE"]["count"] == 1
    assert "out of descriptors" in by_fault["EMFILE"]["meaning"]
    m = MetricsExporter({}, mode="enforce", liveness_seconds=60, parts=(HOLD_TELEMETRY,))
    for n in notices:
        m.on_record(n)
    m.on_record({"kind": "hold-fault", "fault": "ValueError", "count": 1})
    text, _ = m.scrape(None)
    assert b'nodeagent_peermem_hold_faults_total{fault="EMFILE"} 2.0' in text
    assert b'nodeagent_peermem_hold_faults_total{fault="ENFILE"} 1.0' in text
    assert b'nodeagent_peermem_hold_faults_total{fault="other"} 1.0' in text


def test_an_error_while_answering_allows_that_open_and_the_responder_goes_on(
    tmp_path: Path,
) -> None:
    (tmp_path / "77").mkdir()
    source = Opens()
    calls: list[int] = []

    def loader_of(pid: int) -> tuple[bool, str]:
        calls.append(pid)
        if pid == 66:
            raise RuntimeError("cannot tell")
        return True, "modprobe"

    responder = Responder(
        source,
        gate_open=lambda: False,
        budget_s=600,
        openers=Openers(
            proc=str(tmp_path),
            path_of=lambda e: "/x/kernel/drivers/video/nvidia-peermem.ko",
            own_pid=1,
            loader_of=loader_of,
            container_of=lambda pid: "mnt:[A]",
        ),
    )
    responder.start()
    try:
        (bad,) = source.opens(66, 1)
        (good,) = source.opens(77, 1)
        source.feed(bad, good)
        until(lambda: responder.held(), "the next open was not held")
        assert [(e.pid, allow) for e, allow in source.answers] == [(66, True)]
        assert responder.counts["faults"] == 1 and responder._thread.is_alive()
    finally:
        responder.stop()
    (notice,) = [n for n in responder.notices if n["kind"] == "hold-fault"]
    assert notice["fault"] == "RuntimeError" and "was allowed" in notice["meaning"]


def test_a_flood_of_held_class_opens_from_one_container_is_bounded(marked_flood: Marked) -> None:
    """2000 concurrent loader opens of nvidia-peermem.ko from one "container" (4 processes
    of 500 threads in a mount namespace of their own), gate closed: 64 are held (its cap),
    the rest go on at once and are said in one notice; the responder lives, other opens
    and another container's load are answered, the gate still works, descriptors stay
    within the budget."""
    from nodeagent.guards.peermem.budget import HELD_PER_CONTAINER, HELD_TOTAL
    from nodeagent.host.fanotify import READ_EVENTS

    m, responder = marked_flood, marked_flood.responder
    tmp = Path(m.modprobe).parent
    procs, threads = 4, 500
    total = procs * threads
    flood = start_flood(tmp, m.target, procs, threads)
    other_loader = None
    try:
        over = total - HELD_PER_CONTAINER
        until(lambda: responder.counts["over_cap"] == over, "the opens past the cap")
        until(lambda: len(responder.held()) == HELD_PER_CONTAINER, "the cap's worth held")
        assert responder.alive()
        # Another opener's open of a file the hold does not name: answered.
        p = subprocess.run(["cat", str(m.other)], capture_output=True, timeout=WAIT)
        assert p.returncode == 0
        # Another container's load: held, under its own cap.
        other_loader = subprocess.Popen(
            ["unshare", "-m", m.modprobe, str(m.target)], stdout=subprocess.PIPE
        )
        until(
            lambda: any(pid == other_loader.pid for pid, *_ in responder.held()),
            "another container's load was not held",
        )
        # One notice for the burst, with its count.
        (notice,) = until(
            lambda: [n for n in list(responder.notices) if n["kind"] == "hold-over-cap"],
            "the opens past the cap were not said",
        )
        assert notice["count"] == over and notice["past_container_cap"] == over
        assert responder.counts["over_cap"] == over, "more opens past the cap than the flood's"
        # Descriptors: held opens and one read's events at most, well inside the limit.
        assert responder.peak_descriptors <= HELD_TOTAL + READ_EVENTS
        budget = responder.descriptors
        assert budget is not None and budget.held_total == HELD_TOTAL
        assert len(os.listdir("/proc/self/fd")) < budget.limit - budget.reserve
        # The gate still works: open, every held open goes on; closed again, a load waits.
        open_gate(m, True)
        assert flood.wait(WAIT) == 0, "a flood open failed"
        out, _ = other_loader.communicate(timeout=WAIT)
        assert other_loader.returncode == 0 and out == CONTENT
        open_gate(m, False)
        late = subprocess.Popen([m.modprobe, str(m.target)], stdout=subprocess.PIPE)
        try:
            until(lambda: late.pid in [h[0] for h in responder.held()], "a late load not held")
            open_gate(m, True)
            out, _ = late.communicate(timeout=WAIT)
        finally:
            late.kill()
        assert late.returncode == 0 and out == CONTENT
        assert responder.alive() and responder.counts["faults"] == 0
        ended = until(
            lambda: (
                (c := collections.Counter(r.ended for r in list(responder.reports))).total()
                == HELD_PER_CONTAINER + 2
                and c
            ),
            "every held open's report",
        )
        assert ended == {"gate opened": HELD_PER_CONTAINER + 2}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(flood.pid, 9)
        flood.wait(WAIT)
        if other_loader is not None:
            other_loader.kill()
            other_loader.wait(WAIT)
