"""Driver containers' roots found as they start and marked, on this machine's kernel.

The containers are real: a fresh overlay mounted only in a new mount namespace,
a process ``exec``ing into it whose command line becomes the GPU Operator's
``nvidia-driver init`` (``tests/containerroot.py``). The marks are real
(``FAN_MARK_FILESYSTEM`` through ``/proc/<pid>/root``), read back from the
kernel's own list (``fdinfo``). Module loads from such a root need the
real-kernel suite (``tests/realkernel/test_container_hold_real.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.core.hold import (
    DRIVER_CONTAINER_RULES,
    matching_rule,
    parse_rules,
    split_cmdline,
)
from nodeagent.errors import NodeagentError
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.roots import OVERLAYFS_SUPER_MAGIC, RootScanner
from nodeagent.guards.peermem.start import sees_host_pids
from nodeagent.host.fanotify import FanotifyGroup, OpenedRoot, parse_marked_devices
from nodeagent.host.procevents import ExecEvents
from tests import containerroot
from tests.containerroot import ENTRYPOINT, Container
from tests.guards.peermem.rig import overlay_works
from tests.waiting import WAIT, until

# -- the rule (pure) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (["nvidia-driver", "init"], "nvidia-driver init"),
        (["/bin/bash", "/usr/local/bin/nvidia-driver", "init"], "nvidia-driver init"),
        (["/bin/bash", "-e", "/usr/local/bin/nvidia-driver", "init", "--x"], "nvidia-driver init"),
        (["ocp_dtk_entrypoint", "nv-ctr-run-with-dtk"], "ocp_dtk_entrypoint nv-ctr-run-with-dtk"),
        (["nvidia-driver", "build"], None),
        (["nvidia-driver"], None),
        (["/bin/sh", "-c", "x", "nvidia-driver", "init"], None),  # past argv[2]: not the command
        (["my-nvidia-driver", "init"], None),
        (["ocp_dtk_entrypoint", "dtk-build-driver"], None),  # the toolkit builds, never loads
        ([], None),
    ],
)
def test_the_default_rules_match_the_driver_container_as_shipped(
    argv: list[str], rule: str | None
) -> None:
    assert matching_rule(argv, DRIVER_CONTAINER_RULES) == rule


def test_cmdline_words() -> None:
    assert split_cmdline(b"/bin/sh\0/usr/local/bin/nvidia-driver\0init\0") == [
        "/bin/sh",
        "/usr/local/bin/nvidia-driver",
        "init",
    ]
    assert split_cmdline(b"") == [] and split_cmdline(b"\0") == []
    assert split_cmdline(b"a\xff\0b\0") == ["a\ufffd", "b"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nvidia-driver init", "expected a non-empty list"),
        ([""], "is not a command rule"),
        ([3], "is not a command rule"),
        (["/usr/local/bin/nvidia-driver init"], "without a directory"),
        (["nvidia-driver \x07"], "odd word"),
        (["x"] * 33, "at most 32"),
    ],
)
def test_a_bad_rule_is_named(value: object, message: str) -> None:
    with pytest.raises(NodeagentError, match=message):
        parse_rules("peermem.hold_containers", value)


def test_rules_in_the_config() -> None:
    from nodeagent.config import config_from_mapping

    cfg = config_from_mapping({"peermem": {"hold_containers": ["  my-driver   start  "]}})
    assert cfg.policy("peermem").hold_containers == ("my-driver start",)
    cfg = config_from_mapping({"peermem": {"hold_containers": [], "hold_roots": []}})
    assert cfg.policy("peermem").hold_containers == ()
    with pytest.raises(NodeagentError, match=r"peermem\.hold_scan_seconds"):
        config_from_mapping({"peermem": {"hold_scan_seconds": 0}})


def test_marks_read_back_from_fdinfo() -> None:
    text = (
        "pos:\t0\nflags:\t02\nmnt_id:\t15\nino:\t1057\n"
        "fanotify flags:10 event-flags:8000\n"
        "fanotify sdev:2d mflags:0 mask:10000 ignored_mask:0\n"
        "fanotify sdev:800003 mflags:0 mask:10000 ignored_mask:0\n"
        "fanotify ino:1a sdev:2d mflags:0 mask:8 ignored_mask:0 fhandle-bytes:8\n"
    )
    assert parse_marked_devices(text) == {os.makedev(0, 0x2D), os.makedev(8, 3)}


# -- a gone root's container: alive or not, decided after the marks were read -----


class FakeProc:
    """A ``/proc`` of one matching process whose overlay is device 77: the seam the
    scanner takes (``proc``, ``dev_of``, the group's ``open_root`` and marks)."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "proc"
        self.pid = 4242
        (self.dir / str(self.pid)).mkdir(parents=True)
        (self.dir / str(self.pid) / "cmdline").write_bytes(b"nvidia-driver\0init\0")
        self.started(1000)
        self.marks: set[int] = set()
        self.root_resolves = True  # what the kernel's /proc/<pid>/root does
        self.on_marks_read: Callable[[], None] = lambda: None

    def started(self, ticks: int) -> None:
        """Its ``stat``: a command name with a space and a ``)``, field 22 ``ticks``."""
        head = f"{self.pid} (nvidia) driver) S " + "0 " * 18
        (self.dir / str(self.pid) / "stat").write_text(f"{head}{ticks} 0 0\n")

    def scanner(self) -> RootScanner:
        def dev_of(path: str) -> int | None:
            if path.endswith("/1/root"):
                return 1  # the host's root
            if path.endswith("/self/root"):
                return 2  # the agent's own
            return 77 if self.root_resolves else None

        def marks() -> set[int]:
            seen = set(self.marks)
            self.on_marks_read()
            return seen

        def open_root(path: str) -> OpenedRoot | None:
            if not self.root_resolves:
                return None
            return OpenedRoot(
                dev=77,
                fs_type=0x794C7630,
                mark=lambda: self.marks.add(77),
                unmark=lambda: self.marks.discard(77),
                close=lambda: None,
            )

        return RootScanner(
            open_root,
            marks,
            DRIVER_CONTAINER_RULES,
            proc=str(self.dir),
            dev_of=dev_of,
            may_load=lambda pid: None,
        )


def test_a_zombie_container_is_not_alive_when_its_root_goes(tmp_path: Path) -> None:
    """The race issue 35 found: the pid is still listed (a zombie, not yet reaped) but
    its root no longer resolves; its overlay's mark is gone."""
    fake = FakeProc(tmp_path)
    scanner = fake.scanner()
    scanner.prepare()
    scanner.scan()
    assert [r.dev for r in scanner.roots()] == [77]
    fake.marks.clear()  # the namespace went: the kernel dropped the mark
    fake.root_resolves = False  # exit_fs: a zombie's root link is ENOENT
    scanner.scan()
    (gone,) = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
    assert gone["pid"] == fake.pid and gone["container_alive"] is False


def test_a_container_that_exits_between_listing_and_marks_is_not_alive(
    tmp_path: Path,
) -> None:
    """The other order: listed alive, then it exits while the marks are read."""
    fake = FakeProc(tmp_path)
    scanner = fake.scanner()
    scanner.prepare()
    scanner.scan()

    def exits() -> None:
        shutil.rmtree(fake.dir / str(fake.pid))
        fake.root_resolves = False

    fake.marks.clear()
    fake.on_marks_read = exits
    scanner.scan()
    (gone,) = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
    assert gone["container_alive"] is False


def test_a_root_unmounted_under_a_running_container_says_it_is_alive(tmp_path: Path) -> None:
    fake = FakeProc(tmp_path)
    scanner = fake.scanner()
    scanner.prepare()
    scanner.scan()
    fake.marks.clear()  # e.g. a lazy unmount of its root: the process still runs
    scanner.scan()
    (gone,) = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
    assert gone["container_alive"] is True


def test_a_pid_reused_by_another_process_is_not_the_container_alive(tmp_path: Path) -> None:
    """The container exits and its pid goes to a new process before the scan that sees
    the mark gone: that pid's root resolves, but its start time is not the container's.
    Before: ``container_alive`` true (issue 55)."""
    fake = FakeProc(tmp_path)
    scanner = fake.scanner()
    scanner.prepare()
    scanner.scan()
    assert [r.start_time for r in scanner.roots()] == [1000]
    fake.marks.clear()
    fake.started(2500)  # pid 4242, another process
    scanner.scan()
    (gone,) = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
    assert gone["container_alive"] is False


# -- real containers, real marks ------------------------------------------------


@dataclass
class Rig:
    lower: Path
    top: Path
    group: FanotifyGroup
    responder: Responder
    containers: list[Container]

    def start(self, argv: tuple[str, ...] = (ENTRYPOINT, "init"), **kw: bool) -> Container:
        c = containerroot.start(self.lower, self.top, argv, **kw)
        self.containers.append(c)
        return c


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    (tmp_path / "probe").mkdir()
    why = overlay_works(tmp_path / "probe")
    if why:
        pytest.skip(why)
    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"this kernel refuses a fanotify permission group: {exc}")
    lower = tmp_path / "lower"
    tools = [shutil.which("cat") or "/bin/cat", shutil.which("chroot") or "/usr/sbin/chroot"]
    containerroot.build_lower(lower, tools)
    # Marked containers' opens wait on a responder: one that allows everything.
    responder = Responder(group, gate_open=lambda: True, budget_s=5.0)
    responder.start()
    r = Rig(lower, tmp_path / "starts", group, responder, [])
    r.top.mkdir()
    try:
        yield r
    finally:
        for c in r.containers:
            c.stop()
        responder.stop()


@pytest.fixture(params=["exec events", "poll"])
def scan_mode(request: pytest.FixtureRequest) -> str:
    """Both ways of noticing a start: the kernel's exec events, and the 0.1 s poll (where the
    connector refuses); the same tests pass in both."""
    return str(request.param)


def _started(scanner: RootScanner, mode: str) -> RootScanner:
    scanner.start()
    until(lambda: scanner.mode != "starting", "the scanner did not choose a mode")
    if mode == "exec events" and scanner.mode != "exec events":
        scanner.stop()
        pytest.skip(f"no exec events here: {scanner.mode}")
    assert scanner.mode.startswith("exec events" if mode == "exec events" else "polling /proc")
    return scanner


def _scanner(rig: Rig, mode: str, **kw: object) -> RootScanner:
    kw.setdefault("full_scan_s", 0.5)  # the safety net's scans: retiring gone roots sooner
    scanner = RootScanner(
        rig.group.open_root,
        rig.group.marked_devices,
        DRIVER_CONTAINER_RULES,
        interval_s=0.02,
        exec_events=ExecEvents if mode == "exec events" else None,
        **kw,  # type: ignore[arg-type]
    )
    return _started(scanner, mode)


def test_a_driver_container_is_marked_as_it_starts_and_dropped_when_it_goes(
    rig: Rig, scan_mode: str
) -> None:
    scanner = _scanner(rig, scan_mode)
    try:
        first = rig.start()
        until(lambda: scanner.roots(), "the driver container's root was not marked")
        (root,) = scanner.roots()
        assert root.pid == first.pid and root.rule == "nvidia-driver init"
        assert root.dev == os.stat(f"/proc/{first.pid}/root").st_dev
        assert root.dev != os.stat("/").st_dev
        assert str(first.merged) not in Path("/proc/self/mounts").read_text()  # its own ns only
        assert root.dev in rig.group.marked_devices()  # the kernel's own list
        # Opens inside the container now go through the responder.
        before = rig.responder.counts["allowed"]
        p = subprocess.run(first.enter("/bin/sh", "-c", f"cat {ENTRYPOINT}"), capture_output=True)
        assert p.returncode == 0 and b"read x" in p.stdout
        # Its opens were answered; the count moves just after each answer, in the responder.
        until(lambda: rig.responder.counts["allowed"] > before, "no open was answered")

        # A second start while the first lives: a new overlay, marked too.
        second = rig.start()
        until(lambda: len(scanner.roots()) == 2, "the second start was not marked")
        assert {r.pid for r in scanner.roots()} == {first.pid, second.pid}
        assert len({r.dev for r in scanner.roots()}) == 2

        # The first goes: its overlay goes with its mount namespace, the kernel drops the
        # mark, and so does the scanner; nothing of the agent kept the overlay mounted.
        first.stop()
        until(lambda: len(scanner.roots()) == 1, "a gone container's root is still listed")
        assert root.dev not in rig.group.marked_devices()
        gone = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
        assert [(g["pid"], g["container_alive"]) for g in gone] == [(first.pid, False)]
        marked = [r for r in scanner.reports if r["kind"] == "hold-root-marked"]
        assert [m["pid"] for m in marked] == [first.pid, second.pid]
        assert all(m["command"].endswith("nvidia-driver init") for m in marked)
    finally:
        scanner.stop()


def test_a_real_zombie_container_is_reported_gone_and_not_alive(rig: Rig, scan_mode: str) -> None:
    """Its entrypoint exits and is not reaped: its pid stays listed in /proc as a zombie
    while the kernel drops its overlay's mark. Every time, no timing involved."""
    scanner = _scanner(rig, scan_mode)
    try:
        c = rig.start()
        until(lambda: scanner.roots(), "the driver container's root was not marked")
        assert c.proc.stdin is not None
        c.proc.stdin.close()  # it ends; nobody waits for it yet
        until(lambda: not scanner.roots(), "the exited container's root is still listed")
        assert _state(c.pid) == "Z"  # still listed: a zombie
        (gone,) = [r for r in scanner.reports if r["kind"] == "hold-root-gone"]
        assert gone["pid"] == c.pid and gone["container_alive"] is False
    finally:
        scanner.stop()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_only_matching_containers_and_only_their_own_overlay(rig: Rig, scan_mode: str) -> None:
    scanner = _scanner(rig, scan_mode, recheck_s=0.5)
    host_proc = None
    try:
        other = rig.start((ENTRYPOINT, "build"))
        # The rule's command line, but its root is the host's: named, never marked.
        host_proc = subprocess.Popen(
            ["/bin/sh", f"{rig.lower}{ENTRYPOINT}", "init"], stdin=subprocess.PIPE
        )
        until(
            lambda: any(r["kind"] == "state-problem" for r in list(scanner.reports)),
            "a matching process on the host's root was not named",
        )
        (problem,) = [r["problem"] for r in scanner.reports if r["kind"] == "state-problem"]
        assert f"(pid {host_proc.pid})" in problem and problem.endswith("; not marked")
        first = scanner.scans
        until(lambda: scanner.scans >= first + 5, "the scanner stopped")
        assert scanner.roots() == []
        assert rig.group.marked_devices() == set()
        assert other.proc.poll() is None
    finally:
        scanner.stop()
        if host_proc is not None:
            host_proc.kill()
            host_proc.wait()


def test_the_agent_lists_marked_roots_and_records_them(rig: Rig, tmp_path: Path) -> None:
    from nodeagent.agent import Agent
    from nodeagent.config import Config
    from nodeagent.core.peermem import PeermemPolicy
    from nodeagent.guards.peermem.side import PeermemHold
    from tests.healthy import healthy_node

    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    rig.responder.stop()  # the agent's own group answers from here on
    host = tmp_path / "host"
    host.mkdir()
    node = healthy_node(host, ready=False)
    pol = PeermemPolicy(hold_loads="fanotify", hold_roots=(), hold_scan_s=0.02)
    cfg = Config(host_root=str(host), mode="enforce", uevents=False, policies={"peermem": pol})
    agent = Agent(cfg, module_ops=node.kernel, kernel_log=lambda m: [])
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    status_file = host / "run/nodeagent/status.json"
    try:
        side = agent.side("peermem")
        assert isinstance(side, PeermemHold)
        until(lambda: side.containers is not None, "the container scanner did not start")
        c = rig.start()

        def listed() -> list[dict[str, object]]:
            try:
                return list(json.loads(status_file.read_text())["hold"]["container_roots"])
            except (OSError, ValueError, KeyError, TypeError):
                return []

        until(listed, "status.json does not list the root")
        # The scanner looks at once, before its subscription is answered (up to a second
        # under load): the root may be listed while its mode still says "starting".
        scan = until(
            lambda: (
                (s := json.loads(status_file.read_text())["hold"]["container_scan"])["mode"]
                != "starting"
                and s
            ),
            "the scanner never chose a mode",
        )
        assert scan["mode"] == "exec events" or scan["mode"].startswith("polling /proc every")
        (entry,) = listed()
        dev = os.stat(f"/proc/{c.pid}/root").st_dev
        assert entry["pid"] == c.pid and entry["dev"] == f"{os.major(dev)}:{os.minor(dev)}"
        timeline = host / "var/lib/nodeagent/timeline.jsonl"

        def kinds() -> list[str]:
            return [json.loads(line).get("kind") for line in timeline.open()]

        # The status may list the root a pass before that pass records it (the scanner
        # is a thread of its own): the record follows on the next pass.
        until(lambda: "hold-root-marked" in kinds(), "the marked root was not recorded")
        c.stop()
        until(lambda: "hold-root-gone" in kinds(), "the gone root was not recorded")
    finally:
        agent.stop()
        thread.join(WAIT)
        node.kernel.uevent_source.close()


def test_a_wrapper_matches_before_its_chroot_and_is_marked_after_it(tmp_path: Path) -> None:
    """``chroot DIR nvidia-driver init`` matches the rule while its root is still the host's;
    the scanner must look again, not give up on the pid (a fake /proc, a fake clock)."""
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    os.symlink("/proc", proc / "1/root")  # "the host's root": another device than tmp_path
    # Each root on a device of its own, as real roots are: the host's, sysfs, the "overlay".
    host_like, other, overlay = Path("/proc"), Path("/sys"), tmp_path / "ctr"
    overlay.mkdir()
    overlays = {str(overlay)}

    def pid_dir(pid: int, argv: list[str], root: Path) -> None:
        d = proc / str(pid)
        d.mkdir(exist_ok=True)
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        if os.path.lexists(d / "root"):
            os.unlink(d / "root")
        os.symlink(root, d / "root")

    now = [0.0]
    marked: list[str] = []

    def open_root(path: str) -> OpenedRoot:
        kind = OVERLAYFS_SUPER_MAGIC if os.path.realpath(path) in overlays else 0
        return OpenedRoot(
            os.stat(path).st_dev, kind, lambda: marked.append(path), lambda: None, lambda: None
        )

    scanner = RootScanner(
        open_root,
        lambda: {os.stat(p).st_dev for p in marked},
        DRIVER_CONTAINER_RULES,
        proc=str(proc),
        recheck_s=5.0,
        clock=lambda: now[0],
        may_load=lambda pid: None,
    )
    scanner._host_dev = os.stat(proc / "1/root").st_dev  # what start() does
    pid_dir(100, ["chroot", str(overlay), ENTRYPOINT, "init"], host_like)
    pid_dir(200, [ENTRYPOINT, "init"], other)  # matches, never an overlay
    scanner.scan()
    assert marked == [] and list(scanner.reports) == []  # not yet: no verdict, no noise
    now[0] = 1.0
    pid_dir(100, ["/bin/sh", ENTRYPOINT, "init"], overlay)  # after the chroot and the exec
    scanner.scan()
    assert marked == [str(proc / "100/root")]
    assert [r.pid for r in scanner.roots()] == [100]
    now[0] = 6.0  # pid 200's window ends: named once, then left alone
    scanner.scan()
    scanner.scan()
    problems = [r["problem"] for r in scanner.reports if r["kind"] == "state-problem"]
    assert len(problems) == 1 and "(pid 200)" in problems[0] and "not an overlay" in problems[0]


# -- who may be marked, and what (issue 38) ----------------------------------------


def _refusals(scanner: RootScanner, pid: int) -> list[str]:
    return [
        str(r["problem"])
        for r in list(scanner.reports)
        if r["kind"] == "state-problem" and f"(pid {pid})" in str(r["problem"])
    ]


def test_a_matching_container_that_can_never_load_a_module_is_not_marked(
    rig: Rig, scan_mode: str
) -> None:
    """Anyone can call a process ``nvidia-driver init``; one without CAP_SYS_MODULE in its
    bounding set (every unprivileged pod), or root only inside a user namespace of its own,
    can never load a module: its root is not marked, and the agent says why. A privileged
    one started beside them is."""
    scanner = _scanner(rig, scan_mode, recheck_s=0.5)
    try:
        unprivileged = rig.start(drop_sys_module=True)
        in_userns = rig.start(user_namespace=True)
        privileged = rig.start()
        until(lambda: scanner.roots(), "the privileged container's root was not marked")
        until(lambda: _refusals(scanner, unprivileged.pid), "the unprivileged one was not named")
        until(lambda: _refusals(scanner, in_userns.pid), "the user-namespaced one was not named")
        assert [r.pid for r in scanner.roots()] == [privileged.pid]
        marked = rig.group.marked_devices()
        for c in (unprivileged, in_userns):
            assert os.stat(f"/proc/{c.pid}/root").st_dev not in marked
        (why,) = _refusals(scanner, unprivileged.pid)
        assert "no CAP_SYS_MODULE in its bounding set" in why and "not marked" in why
        (why,) = _refusals(scanner, in_userns.pid)
        assert "not in the host's user namespace" in why
        # What status lists as not marked (the hold's part: "not_marked").
        assert {pid for pid, _cmd, _why in scanner.refused} == {unprivileged.pid, in_userns.pid}
    finally:
        scanner.stop()


def test_a_root_flipped_between_check_and_mark_never_gets_its_new_root_marked(
    rig: Rig, scan_mode: str
) -> None:
    """The process flips its root (chroot into a tmpfs) right after the scanner resolved
    it: the scanner checks and marks that one resolution, the overlay; the tmpfs is never
    marked, and nothing is left marked once the container goes."""
    flipped: dict[str, int] = {}

    def open_then_flip(path: str) -> OpenedRoot | None:
        opened = rig.group.open_root(path)
        # Flipped once the resolution is the container's overlay (the one to be checked and
        # marked): not a wrapper's root before its chroot (exec events read the wrapper
        # too), nor another matching process's (a shared machine may run one).
        if (
            opened is not None
            and not flipped
            and path == f"/proc/{c.pid}/root"
            and opened.fs_type == OVERLAYFS_SUPER_MAGIC
        ):
            pid = int(path.split("/")[2])
            before = os.stat(path).st_dev
            assert c.proc.stdin is not None
            c.proc.stdin.write(b"flip\n")
            c.proc.stdin.flush()
            until(lambda: os.stat(path).st_dev != before, "the root did not flip")
            flipped.update(pid=pid, overlay=before, tmpfs=os.stat(path).st_dev)
        return opened

    scanner = RootScanner(
        open_then_flip,
        rig.group.marked_devices,
        DRIVER_CONTAINER_RULES,
        interval_s=0.02,
        full_scan_s=0.5,
        exec_events=ExecEvents if scan_mode == "exec events" else None,
    )
    c = rig.start(flip_to_tmpfs=True)
    _started(scanner, scan_mode)
    try:
        until(lambda: scanner.roots(), "the container's root was not marked")
        (root,) = scanner.roots()
        marked = rig.group.marked_devices()
        assert flipped["pid"] == c.pid and flipped["tmpfs"] != flipped["overlay"]
        assert root.dev == flipped["overlay"] and flipped["overlay"] in marked
        assert flipped["tmpfs"] not in marked  # the flipped-to filesystem: never marked
        c.stop()
        until(lambda: not scanner.roots(), "the gone container's root is still listed")
        assert not {flipped["overlay"], flipped["tmpfs"]} & rig.group.marked_devices()
    finally:
        scanner.stop()


def _problems(scanner: RootScanner) -> list[str]:
    return [str(r["problem"]) for r in list(scanner.reports) if r["kind"] == "state-problem"]


def test_a_marked_container_that_chroots_into_a_new_overlay_gets_it_marked(rig: Rig) -> None:
    """Exec events: the driver container's process ``exec chroot``s into a second overlay
    (same pid, same mount namespace). Its command line matches no rule; it is the marked
    container's process in a root nobody marked, so that root is checked and marked like
    the first, and opens there go through the responder. (Polling reads a settled pid
    never again: it cannot see this, and says it polls.)"""
    scanner = _scanner(rig, "exec events")
    try:
        c = rig.start(flip_to_overlay=True)
        until(lambda: scanner.roots(), "the driver container's root was not marked")
        (first,) = scanner.roots()
        c.send("flip")
        until(lambda: len(scanner.roots()) == 2, "the container's new overlay was not marked")
        new = os.stat(f"/proc/{c.pid}/root").st_dev
        assert new != first.dev and {first.dev, new} <= rig.group.marked_devices()
        second = next(r for r in scanner.roots() if r.dev == new)
        assert second.pid == c.pid
        assert second.rule == f"nvidia-driver init (a new root in its container, pid {c.pid})"
        before = rig.responder.counts["allowed"]
        p = subprocess.run(c.enter("/bin/sh", "-c", "cat /flip/etc/hostname"), capture_output=True)
        assert p.returncode in (0, 1)  # the file need not exist: the open is what counts
        until(lambda: rig.responder.counts["allowed"] > before, "no open was answered")
    finally:
        scanner.stop()


def test_a_marked_containers_process_in_a_root_that_cannot_be_marked_is_named_once(
    rig: Rig,
) -> None:
    """The same move into a tmpfs: not an overlay, never marked; said once, with the
    container it belongs to, and not again for the next process there."""
    scanner = _scanner(rig, "exec events")
    try:
        c = rig.start(flip_to_tmpfs=True)
        until(lambda: scanner.roots(), "the driver container's root was not marked")
        c.send("flip")

        def named() -> list[str]:
            return [p for p in _problems(scanner) if f"driver container pid {c.pid}" in p]

        until(named, "the process in the tmpfs was not named")
        (said,) = named()
        assert "not an overlay: its loads from there are not held" in said
        tmpfs = os.stat(f"/proc/{c.pid}/root").st_dev
        assert tmpfs not in rig.group.marked_devices() and len(scanner.roots()) == 1
        execs = scanner.status()["exec_events"]
        subprocess.run(c.enter("/bin/sh", "-c", ":"), check=True)  # another, in the tmpfs
        until(lambda: scanner.status()["exec_events"] > execs, "the exec was not read")
        assert len(named()) == 1
    finally:
        scanner.stop()


def test_a_process_settled_long_ago_that_execs_the_entrypoint_is_marked(rig: Rig) -> None:
    """A late exec: the container's pid runs a shell first, read and settled (its young
    window, 0.2 s here, long past: no scan reads it again), then ``exec``s
    ``nvidia-driver init``. The exec event is the look."""
    scanner = _scanner(rig, "exec events", recheck_s=0.2)
    try:
        c = rig.start(("/bin/sh", "-c", f"read x; exec {ENTRYPOINT} init"))
        scans = scanner.scans
        until(
            lambda: c.pid in scanner._settled and scanner.scans >= scans + 2,
            "the shell was not read and settled",
        )
        assert Path(f"/proc/{c.pid}/cmdline").read_bytes().startswith(b"/bin/sh\0-c\0read x")
        assert not scanner.roots()
        c.send("go")
        until(lambda: scanner.roots(), "the late entrypoint was not marked")
        assert [r.pid for r in scanner.roots()] == [c.pid]
    finally:
        scanner.stop()


def test_a_container_that_takes_a_settled_pid_is_marked(rig: Rig) -> None:
    """Pid reuse, for real: a process is read and settled, dies, and a driver container
    starts with its pid (``ns_last_pid`` set just before the start; retried while another
    fork on the machine takes it first). Its exec is read like any other."""
    scanner = _scanner(rig, "exec events", recheck_s=0.0, full_scan_s=3600.0)
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    try:
        for _ in range(20):
            old = subprocess.Popen(["sleep", "1000"])
            until(lambda old=old: old.pid in scanner._settled, "the process was not settled")
            old.kill()
            old.wait()
            try:
                last_pid.write_text(str(old.pid - 1))
            except OSError as exc:
                print(f"cannot choose the next pid here: {exc}")
                pytest.skip(f"cannot choose the next pid here: {exc}")
            c = rig.start()
            if c.pid == old.pid:
                break
            c.stop()
        else:
            print("another fork took the pid 20 times in a row")
            pytest.skip("another fork took the pid 20 times in a row")
        assert old.pid in scanner._settled  # no full scan let it go: an hour's period
        until(lambda: scanner.roots(), "the container on a reused pid was not marked")
        assert [r.pid for r in scanner.roots()] == [old.pid]
    finally:
        scanner.stop()


def test_start_time_reads_this_kernels_stat(tmp_path: Path) -> None:
    """Field 22 on this kernel: a child started after this process has a later one, and
    a process whose name holds ``) `` is still read (counted from the last ``)``)."""
    from nodeagent.guards.peermem.procfs import start_time

    own = start_time("/proc", os.getpid())
    odd = tmp_path / "a) b ) c"  # its command name, the file it was exec'd from
    odd.symlink_to(shutil.which("sleep") or "/bin/sleep")
    child = subprocess.Popen([str(odd), "30"])
    try:
        assert ") b )" in Path(f"/proc/{child.pid}/stat").read_text()
        theirs = start_time("/proc", child.pid)
        assert own is not None and theirs is not None and theirs >= own
    finally:
        child.kill()
        child.wait()
    assert start_time("/proc", child.pid) is None
