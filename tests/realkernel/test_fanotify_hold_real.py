"""The fanotify responder on the real Debian 6.1 kernel, with a driver-container-like root.

The root is an overlay (a small lower tree with kmod, cat and their libraries,
and a module tree holding ``nvidia-peermem.ko``: a test module that needs the
symbols of an ``ib_core``-like provider, which modprobe loads first),
rbind-mounted elsewhere as ``/run/nvidia/driver`` is, and entered by chroot
from another mount namespace (``unshare -m``), as the driver container's
``modprobe`` runs. One ``FAN_MARK_FILESYSTEM`` + ``FAN_OPEN_PERM`` mark on the
overlay. The gate is driven by the test through the responder's decision
seam (``gate_open``, a ``threading.Event``): the agent wiring is a later slice.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.guards.peermem.responder import Responder
from nodeagent.host.fanotify import FanotifyGroup
from tests.realkernel.loaded import is_loaded, unload
from tests.realkernel.modbuild import KModule, symbol_provider, symbol_user

from .. import waiting

pytestmark = pytest.mark.realkernel

WAIT = 60.0  # a hang detector under TCG, where a modprobe takes seconds
SYM = "na_hold_register_peer"
PROV = symbol_provider("na_hold_ib", SYM)
PEER = symbol_user("na_hold_peer", SYM, PROV)


@dataclass
class Root:
    merged: str
    bind: str
    kver: str


def _copy_in(lower: str, path: str) -> None:
    os.makedirs(lower + os.path.dirname(path), exist_ok=True)
    shutil.copy(path, lower + path)


@pytest.fixture
def root(built_modules: Callable[[KModule], Path]) -> Iterator[Root]:
    kver = os.uname().release
    top = "/tmp/na-hold"
    subprocess.run(["umount", "-R", "-l", top], capture_output=True)
    shutil.rmtree(top, ignore_errors=True)
    os.makedirs(top)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", top], check=True)
    lower, upper, work, merged, bind = (f"{top}/{d}" for d in ("l", "u", "w", "m", "b"))
    for d in (lower, upper, work, merged, bind):
        os.makedirs(d)
    mods = f"{lower}/lib/modules/{kver}/kernel/drivers"
    os.makedirs(f"{mods}/video")
    os.makedirs(f"{mods}/infiniband")
    shutil.copy(built_modules(PEER), f"{mods}/video/nvidia-peermem.ko")  # the name the hold reads
    shutil.copy(built_modules(PROV), f"{mods}/infiniband/na_hold_ib.ko")
    kmod = shutil.which("kmod") or "/usr/bin/kmod"
    tools = [kmod, "/usr/bin/cat"]
    for t in tools:
        _copy_in(lower, t)
    libs = subprocess.run(["ldd", *tools], capture_output=True, text=True).stdout.split()
    for lib in (w for w in libs if w.startswith("/") and os.path.exists(w)):
        _copy_in(lower, lib)
    os.makedirs(f"{lower}/usr/sbin", exist_ok=True)
    for n in ("modprobe", "insmod", "modinfo", "depmod"):
        os.symlink(kmod, f"{lower}/usr/sbin/{n}")
    for p in ("lib", "lib64", "bin"):
        if not os.path.exists(f"{lower}/{p}") and os.path.islink(f"/{p}"):
            os.symlink(os.readlink(f"/{p}"), f"{lower}/{p}")
    os.makedirs(f"{lower}/proc")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, merged], check=True)
    subprocess.run(["chroot", merged, "/usr/sbin/depmod", kver], check=True)
    subprocess.run(["mount", "--rbind", merged, bind], check=True)  # like /run/nvidia/driver
    unload(PEER.name, PROV.name)
    try:
        yield Root(merged, bind, kver)
    finally:
        unload(PEER.name, PROV.name)
        subprocess.run(["umount", "-R", "-l", top], capture_output=True)


def in_container(root: Root, *argv: str) -> list[str]:
    """As the driver container runs it: another mount namespace, chrooted into the bind."""
    return ["unshare", "-m", "--propagation", "private", "chroot", root.bind, *argv]


@pytest.fixture
def hold(root: Root) -> Iterator[tuple[Responder, threading.Event]]:
    group = FanotifyGroup()
    group.mark_filesystem(root.merged)
    gate = threading.Event()
    responder = Responder(group, gate_open=gate.is_set, budget_s=60.0)
    responder.start()
    try:
        yield responder, gate
    finally:
        responder.stop()


def until(pred: Callable[[], object], what: str) -> None:
    waiting.until(pred, what, WAIT)  # the guest is emulated (TCG): a longer deadline


def test_modprobe_in_the_container_is_held_until_the_gate_opens(
    root: Root, hold: tuple[Responder, threading.Event]
) -> None:
    responder, gate = hold
    proc = subprocess.Popen(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"))
    try:
        until(responder.held, "modprobe's open of nvidia-peermem.ko was not held")
        ((pid, opener, path, _),) = responder.held()
        assert pid == proc.pid or opener in ("modprobe", "kmod"), (pid, opener)
        assert os.path.basename(path) == "nvidia-peermem.ko"
        # Its dependency went through first; the peermem-like module is not in.
        assert is_loaded(PROV.name) and not is_loaded(PEER.name)
        # Readers of the same file, and depmod, are not held.
        rel = f"/lib/modules/{root.kver}/kernel/drivers/video/nvidia-peermem.ko"
        for argv in (
            ["/usr/bin/cat", rel],
            ["/usr/sbin/modinfo", "nvidia-peermem"],
            ["/usr/sbin/depmod", root.kver],
        ):
            p = subprocess.run(in_container(root, *argv), capture_output=True, timeout=WAIT)
            assert p.returncode == 0, (argv, p.stderr)
        assert proc.poll() is None, "the held modprobe went on"
        gate.set()
        responder.wake()
        assert proc.wait(WAIT) == 0
    finally:
        proc.kill()
    assert is_loaded(PEER.name)
    assert [r.ended for r in responder.reports] == ["gate opened"]


def test_a_held_modprobe_can_be_killed(root: Root, hold: tuple[Responder, threading.Event]) -> None:
    responder, _gate = hold
    proc = subprocess.Popen(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"))
    until(responder.held, "not held")
    proc.send_signal(signal.SIGKILL)
    proc.wait(WAIT)
    responder.wake()
    until(lambda: not responder.held(), "a killed opener is still held")
    assert not is_loaded(PEER.name)


def test_the_budget_expires_into_a_load_and_a_report(root: Root) -> None:
    group = FanotifyGroup()
    group.mark_filesystem(root.merged)
    responder = Responder(group, gate_open=lambda: False, budget_s=1.0)
    responder.start()
    try:
        p = subprocess.run(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"), timeout=WAIT)
        assert p.returncode == 0 and is_loaded(PEER.name)
        until(lambda: responder.reports, "no report")
        (report,) = responder.reports
        assert report.ended == "budget expired" and report.seconds >= 1.0
    finally:
        responder.stop()


AGENT = """
import sys, threading, time
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.guards.peermem.responder import Responder
group = FanotifyGroup()
group.mark_filesystem(sys.argv[1])
Responder(group, gate_open=lambda: False, budget_s=3600).start()
print("marked", flush=True)
time.sleep(3600)
"""


def test_sigkill_of_the_agent_releases_the_held_opener(root: Root) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, root.merged], stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "marked"
        proc = subprocess.Popen(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"))
        # Held: blocked in the kernel on its open, waiting for the agent's answer (not "still
        # running after a second", which a slow guest shows before it even opened the file).
        until(lambda: _blocked_in_open(proc.pid), "modprobe never blocked in its open")
        assert proc.poll() is None, "modprobe was not held by the agent"
        agent.send_signal(signal.SIGKILL)
        assert proc.wait(WAIT) == 0  # the kernel allows what the dead group held
    finally:
        agent.kill()
    assert is_loaded(PEER.name)


OPEN_SYSCALLS = {"2", "257", "437"}  # x86_64: open, openat, openat2


def _blocked_in_open(pid: int) -> str | None:
    """Where ``pid`` sleeps when it is blocked in an open on a fanotify permission event
    (its ``/proc/<pid>/syscall`` an open, its ``wchan`` fanotify's wait for the answer),
    else None. ``unshare`` and ``chroot`` exec into ``modprobe``: the pid stays."""
    try:
        nr = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except (OSError, IndexError):
        return None
    return wchan if nr in OPEN_SYSCALLS and "fanotify" in wchan else None


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts: it answers nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return True


APART_AGENT = """
import sys, time
from nodeagent.host.fanotify import FanotifyGroup
from nodeagent.guards.peermem.start import start_hold
from nodeagent.guards.peermem.start import spawner
group = FanotifyGroup()
responder, marked, problems = start_hold(
    group, group.mark_filesystem, [("root", sys.argv[1])], gate_open=lambda: False,
    budget_s=3600, host_pids=True, apart=spawner(group, budget_s=3600),
)
assert marked == ["root"], problems
print(responder.pid, flush=True)
time.sleep(3600)
"""


def test_the_responder_apart_answers_for_a_stopped_agent_and_goes_with_a_killed_one(
    root: Root,
) -> None:
    """Issue 38: the responder in a process of its own (as the agent runs it). The agent's
    process stopped: a real modprobe in the container is held (the gate, a lease nobody
    renews, reads closed), the container's other opens are answered; the agent killed
    while stopped: its responder exits with it and the modprobe loads."""
    agent = subprocess.Popen(
        [sys.executable, "-c", APART_AGENT, root.merged], stdout=subprocess.PIPE, text=True
    )
    proc = None
    try:
        assert agent.stdout is not None
        responder_pid = int(agent.stdout.readline())
        assert responder_pid != agent.pid and os.path.exists(f"/proc/{responder_pid}")
        agent.send_signal(signal.SIGSTOP)
        proc = subprocess.Popen(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"))
        rel = f"/lib/modules/{root.kver}/kernel/drivers/video/nvidia-peermem.ko"
        for argv in (["/usr/bin/cat", rel], ["/usr/sbin/modinfo", "nvidia-peermem"]):
            p = subprocess.run(in_container(root, *argv), capture_output=True, timeout=WAIT)
            assert p.returncode == 0, (argv, p.stderr)
        until(lambda: is_loaded(PROV.name), "modprobe's dependency did not load first")
        until(lambda: _blocked_in_open(proc.pid), "modprobe never blocked in its open")
        assert proc.poll() is None and not is_loaded(PEER.name), "the load went on, gate closed"
        agent.send_signal(signal.SIGKILL)
        assert proc.wait(WAIT) == 0  # the responder let go as its agent died
        until(lambda: _gone(responder_pid), "the responder outlived its agent")
    finally:
        agent.kill()
        agent.wait(WAIT)
        if proc is not None:
            proc.kill()
    assert is_loaded(PEER.name)


@pytest.mark.parametrize("mode", ["auto", "pinned"])
def test_ignore_marks_on_6_1_never_hide_the_module(
    root: Root, mode: str, built_modules: Callable[[KModule], Path]
) -> None:
    """Issue 39 on the 6.1 guest: the responder apart filters non-target opens in the kernel
    (evictable ignore marks: 5.19+; ``pinned`` forced as on 5.14/5.15), yet a real
    ``modprobe`` of nvidia-peermem is held after the container read its directory, after
    the module was renamed into place from a file read before, and after a new copy
    appeared in a directory read before."""
    from nodeagent.guards.peermem.budget import descriptor_budget
    from nodeagent.guards.peermem.start import spawner, start_hold

    group = FanotifyGroup()
    budget, _ = descriptor_budget()
    responder, marked, problems = start_hold(
        group,
        group.mark_filesystem,
        [("root", root.merged)],
        gate_open=lambda: False,
        budget_s=600.0,
        host_pids=True,
        budget=budget,
        apart=spawner(group, budget_s=600.0, ignore_marks=mode),
    )
    assert responder is not None and marked == ["root"], problems
    video = f"/lib/modules/{root.kver}/kernel/drivers/video"
    try:
        status = waiting.until(responder.ignore_status, "its ignore marks", WAIT)
        assert status["mode"] == ("evictable" if mode == "auto" else "pinned"), status
        for argv in (
            ["/usr/bin/cat", f"/lib/modules/{root.kver}/modules.dep"],
            ["/usr/bin/cat", f"/lib/modules/{root.kver}/modules.dep"],  # again: ignored
            ["/usr/sbin/modinfo", "nvidia-peermem"],
        ):
            p = subprocess.run(in_container(root, *argv), capture_output=True, timeout=WAIT)
            assert p.returncode == 0, (argv, p.stderr)
        until(lambda: (responder.ignore_status() or {}).get("added", 0) >= 1, "no ignore mark")

        def held_load() -> None:
            proc = subprocess.Popen(in_container(root, "/usr/sbin/modprobe", "nvidia-peermem"))
            try:
                until(responder.held, "modprobe's open of nvidia-peermem.ko was not held")
                assert proc.poll() is None and not is_loaded(PEER.name)
                responder.follow(True)  # the gate opens: the held load goes on
                assert proc.wait(WAIT) == 0 and is_loaded(PEER.name)
                responder.follow(False)
            finally:
                proc.kill()
            unload(PEER.name, PROV.name)

        held_load()  # its directory read before
        # Renamed into place from a copy read before (as strip/objcopy leave one).
        merged_video = root.merged + video
        shutil.copy(f"{merged_video}/nvidia-peermem.ko", f"{merged_video}/peermem.tmp")
        cat = in_container(root, "/usr/bin/cat", f"{video}/peermem.tmp")
        assert subprocess.run(cat, capture_output=True, timeout=WAIT).returncode == 0
        os.replace(f"{merged_video}/peermem.tmp", f"{merged_video}/nvidia-peermem.ko")
        held_load()
        # A new copy in a directory whose files were read before.
        os.unlink(f"{merged_video}/nvidia-peermem.ko")
        shutil.copy(built_modules(PEER), f"{merged_video}/nvidia-peermem.ko")
        held_load()
    finally:
        responder.stop()
