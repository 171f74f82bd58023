"""Driver containers marked as they start, on the real Debian 6.1 kernel (QEMU).

Each "container start" is what a runtime does (``tests/containerroot.py``): a
fresh overlay mounted only in a new mount namespace, a process ``exec``ing
into it whose command line becomes ``/bin/sh /usr/local/bin/nvidia-driver
init``. Its entrypoint waits a second (the real one builds or installs the
driver first) and runs ``modprobe nvidia-peermem`` itself, as the GPU
Operator's does. The agent side is the shipped code: ``RootScanner`` polling
``/proc`` with the default rules, marking through ``/proc/<pid>/root``, and
the ``Responder`` answering the group's events; the gate is a
``threading.Event`` the test opens (the agent wiring has its own tests).

The module tree in the container root is the driver container's: an
``ib_core``-like provider in the kernel's own tree
(``kernel/drivers/infiniband/core/ib_core.ko``, built as ``na_ctr_ib`` version
"inbox") and ``nvidia-peermem.ko`` needing its symbol. "MOFED" is another
build of the same module (version "mofed"), inserted from outside while the
container's load is held, as MOFED's ``openibd`` would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.core.hold import DRIVER_CONTAINER_RULES
from nodeagent.guards.peermem.responder import Responder
from nodeagent.guards.peermem.roots import RootScanner
from nodeagent.host.fanotify import FanotifyGroup
from tests.realkernel.loaded import is_loaded, unload, version
from tests.realkernel.modbuild import KModule, symbol_provider, symbol_user

from .. import containerroot, waiting
from ..containerroot import Container

pytestmark = pytest.mark.realkernel

WAIT = 60.0  # a hang detector under TCG, where a modprobe takes seconds
SYM = "na_ctr_register_peer"


INBOX = symbol_provider("na_ctr_ib", SYM, "inbox")
MOFED = symbol_provider("na_ctr_ib", SYM, "mofed")
PEER = symbol_user("na_ctr_peer", SYM, INBOX)
# The entrypoint: its "driver install" lasts until the test says go (a line on stdin;
# stdin closed first: it ends without loading), then the operator's own load. How soon
# after a start the mark lands is a figure for bench/container_mark.py, not a race here.
ENTRY = """#!/bin/sh
read go || exit 0
/usr/sbin/modprobe nvidia-peermem
echo $? > /tmp/modprobe-rc
read x
"""


def until(pred: Callable[[], object], what: str) -> None:
    waiting.until(pred, what, WAIT)  # the guest is emulated (TCG): a longer deadline


@dataclass
class Rig:
    lower: Path
    top: Path
    kver: str
    gate: threading.Event
    group: FanotifyGroup
    responder: Responder
    scanner: RootScanner
    mofed_ko: Path
    containers: list[Container]

    def start(self) -> Container:
        c = containerroot.start(self.lower, self.top)
        self.containers.append(c)
        return c


@pytest.fixture
def rig(built_modules: Callable[[KModule], Path], tmp_path: Path) -> Iterator[Rig]:
    kver = os.uname().release
    top = Path("/tmp/na-ctr")
    subprocess.run(["umount", "-R", "-l", str(top)], capture_output=True)
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(top)], check=True)
    lower = top / "lower"
    containerroot.driver_image(
        lower,
        ENTRY,
        kver,
        {
            "kernel/drivers/video/nvidia-peermem.ko": built_modules(PEER),
            "kernel/drivers/infiniband/core/ib_core.ko": built_modules(INBOX),
        },
    )
    mofed_ko = tmp_path / "mofed-ib_core.ko"
    shutil.copy(built_modules(MOFED), mofed_ko)
    unload(PEER.name, INBOX.name)
    group = FanotifyGroup()
    gate = threading.Event()
    responder = Responder(group, gate_open=gate.is_set, budget_s=60.0)
    responder.start()
    scanner = RootScanner(
        group.open_root, group.marked_devices, DRIVER_CONTAINER_RULES, interval_s=0.1
    )
    scanner.start()
    r = Rig(lower, top / "starts", kver, gate, group, responder, scanner, mofed_ko, [])
    r.top.mkdir()
    try:
        yield r
    finally:
        scanner.stop()
        responder.stop()
        for c in r.containers:
            c.stop()
        unload(PEER.name, INBOX.name)
        subprocess.run(["umount", "-R", "-l", str(top)], capture_output=True)


def _rc(c: Container) -> str | None:
    """The entrypoint's modprobe exit code, once written (None before)."""
    try:
        return Path(f"/proc/{c.pid}/root/tmp/modprobe-rc").read_text().strip() or None
    except OSError:
        return None


def _one_start(rig: Rig, n: int) -> None:
    rig.gate.clear()
    rig.responder.wake()
    c = rig.start()
    until(
        lambda: any(r.pid == c.pid for r in rig.scanner.roots()),
        f"start {n} not marked: {list(rig.scanner.reports)}, scans {rig.scanner.scans}, "
        f"cmdline {Path(f'/proc/{c.pid}/cmdline').read_bytes()!r}",
    )
    (root,) = [r for r in rig.scanner.roots() if r.pid == c.pid]
    assert root.dev == os.stat(f"/proc/{c.pid}/root").st_dev
    # Its own modprobe, once its install is done, waits: on the inbox ib_core first,
    # the dependency modprobe inserts before it opens nvidia-peermem.
    c.send("go")  # the install is done: on to its modprobe
    until(rig.responder.held, f"start {n}: the container's modprobe was not held")
    ((_pid, opener, path, _),) = rig.responder.held()
    assert opener == "modprobe" and path.endswith("kernel/drivers/infiniband/core/ib_core.ko")
    # Still held a few scans later (not a sleep: the scanner's own rounds).
    scans = rig.scanner.scans
    until(lambda: rig.scanner.scans >= scans + 3, f"start {n}: the scanner stopped")
    assert rig.responder.held()
    assert not is_loaded(INBOX.name) and not is_loaded(PEER.name) and _rc(c) is None
    # MOFED comes up with its own build of the module, then the gate opens.
    subprocess.run(["insmod", str(rig.mofed_ko)], check=True)
    rig.gate.set()
    rig.responder.wake()
    until(lambda: _rc(c) is not None, f"start {n}: the held modprobe never finished")
    assert _rc(c) == "0"
    assert is_loaded(PEER.name)
    assert version(INBOX.name) == "mofed", "the inbox dependency was inserted"
    assert all(r.ended == "gate opened" for r in rig.responder.reports)
    c.stop()
    until(lambda: not rig.scanner.roots(), f"start {n}: its root is still listed")
    assert root.dev not in rig.group.marked_devices()
    unload(PEER.name, INBOX.name)


def test_each_start_is_marked_before_its_own_modprobe_which_waits_for_the_gate(rig: Rig) -> None:
    _one_start(rig, 1)
    _one_start(rig, 2)  # a second start: a new overlay, marked before its load too
    marked = [r for r in rig.scanner.reports if r["kind"] == "hold-root-marked"]
    assert [m["pid"] for m in marked] == [c.pid for c in rig.containers]


def test_without_the_dependency_hold_the_inbox_module_goes_in_first(rig: Rig) -> None:
    """The control: the same container start, its root not marked (the scanner stopped), puts
    the inbox provider in at once — what the mark and the dependency hold prevent above."""
    rig.scanner.stop()
    c = rig.start()
    c.send("go")  # the install is done: on to its modprobe
    until(lambda: _rc(c) is not None, "the unmarked container's modprobe did not finish")
    assert _rc(c) == "0" and version(INBOX.name) == "inbox"
    assert rig.responder.counts["held"] == 0


ONE_SCAN = """
import json
from nodeagent.core.hold import DRIVER_CONTAINER_RULES
from nodeagent.guards.peermem.roots import RootScanner
from nodeagent.host.fanotify import FanotifyGroup
group = FanotifyGroup()
scanner = RootScanner(group.open_root, group.marked_devices, DRIVER_CONTAINER_RULES,
                      recheck_s=0.0)
scanner._host_dev = scanner._dev("/proc/1/root")
scanner.scan()
print(json.dumps(list(scanner.reports)))
"""


@pytest.mark.parametrize(
    ("caps", "marked"), [("+sys_admin", False), ("+sys_admin,+sys_ptrace", True)]
)
def test_marking_a_privileged_containers_root_needs_sys_ptrace(
    rig: Rig, caps: str, marked: bool
) -> None:
    """The component's capabilities, checked: the driver container is privileged (all
    capabilities), and ``/proc/<pid>/root`` of a process whose capabilities are not a subset
    of the caller's needs ``CAP_SYS_PTRACE`` (commoncap's ptrace access check)."""
    import json
    import sys

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed in the guest")
    rig.scanner.stop()
    c = rig.start()
    until(lambda: b"nvidia-driver" in Path(f"/proc/{c.pid}/cmdline").read_bytes(), "no start")
    p = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-all",
            f"--bounding-set=-all,{caps}",
            sys.executable,
            "-c",
            ONE_SCAN,
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert p.returncode == 0, p.stderr
    kinds = {r["kind"]: r for r in json.loads(p.stdout)}
    if marked:
        assert kinds["hold-root-marked"]["pid"] == c.pid
    else:
        assert "hold-root-marked" not in kinds
        # Without CAP_SYS_PTRACE the agent cannot read its user namespace (the same ptrace
        # access check as its root): refused before its root is ever opened.
        problem = kinds["state-problem"]["problem"]
        assert f"(pid {c.pid}): cannot read its user namespace; not marked" in problem
