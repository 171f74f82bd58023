"""Non-target opens filtered in the kernel (issue 39): ignore marks that never hide a target.

The responder (apart, as the agent runs it) adds an inode ignore mark on the
first open of a regular file the hold does not name and whose bytes could not
be a module, before it allows that open; a write clears the mark. On this
machine's kernel, with a real fanotify group on a tmpfs, in each mode the
kernel may give (``evictable`` where it has ``FAN_MARK_EVICTABLE``, ``pinned``
forced through the responder's seam as on 5.14/5.15):

- a file opened again never reaches the responder;
- a ``nvidia-peermem.ko`` created later in a directory whose files were opened
  is held;
- a module file opened, then renamed to the target's name, or hard-linked as
  it, is held; an empty file opened, then written with a module and renamed,
  is held;
- a module tree that appears by rename or by bind mount, and an inbox RDMA
  module whose directory was read, are held;
- the residual, as documented: a file whose bytes are not a module, opened,
  then renamed to the target's name, is not held (the kernel would refuse to
  load it: it is not a module).

The same on the 6.1 guest: ``tests/realkernel/test_fanotify_hold_real.py``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.core.hold import could_be_module
from nodeagent.guards.peermem.budget import descriptor_budget
from nodeagent.guards.peermem.process import ResponderProcess
from nodeagent.guards.peermem.start import sees_host_pids, spawner, start_hold
from nodeagent.host.fanotify import FanotifyGroup, IgnoreMarks
from tests.guards.peermem.rig import fake_modprobe, mount_tmpfs
from tests.waiting import WAIT, until

KVER = "6.1.0-test"
# An ELF64 little-endian relocatable object's first bytes, as every .ko starts.
MODULE = b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x01\x00\x3e\x00" + b"not really a module\n"
TEXT = b"#define NOT_A_MODULE 1\n"


def test_what_could_be_a_module_by_its_first_bytes() -> None:
    assert could_be_module(MODULE)
    assert could_be_module(b"\x7fELF\x02\x02\x01" + bytes(9) + b"\x00\x01")  # big-endian REL
    assert not could_be_module(b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x03\x00")  # a .so
    assert not could_be_module(b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x02\x00")  # a program
    assert could_be_module(b"\x7fELF\x02")  # cut short: not ruled out
    for magic in (b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd", b"\x1f\x8b"):  # .ko.xz/.zst/.gz
        assert could_be_module(magic + b"...")
    assert not could_be_module(TEXT) and not could_be_module(b"")


@dataclass
class Hold:
    fs: Path
    modprobe: str
    responder: ResponderProcess
    mode: str

    def allowed(self) -> int:
        return self.responder.counts["allowed"]


@pytest.fixture(params=["auto", "pinned"])
def hold(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Hold]:
    if not sees_host_pids():
        pytest.skip("this test process does not see host PIDs (the hold refuses to start)")
    fs = tmp_path / "fs"
    fs.mkdir()
    why = mount_tmpfs(fs)
    if why:
        pytest.skip(why)
    modprobe = fake_modprobe(tmp_path)
    responder = None
    try:
        group = FanotifyGroup()
        budget, _ = descriptor_budget()
        responder, marked, problems = start_hold(
            group,
            group.mark_filesystem,
            [("fs", str(fs))],
            gate_open=lambda: False,
            budget_s=60.0,
            host_pids=True,
            budget=budget,
            apart=spawner(group, budget_s=60.0, ignore_marks=request.param),
        )
        assert isinstance(responder, ResponderProcess) and marked == ["fs"], problems
        status = until(responder.ignore_status, "the responder's ignore marks")
        if request.param == "auto" and status["mode"] != "evictable":
            pytest.skip(f"this kernel's ignore marks: {status}")
        yield Hold(fs, modprobe, responder, status["mode"])
    finally:
        if responder is not None:
            responder.stop()
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def _cat(path: Path) -> None:
    p = subprocess.run(["cat", str(path)], capture_output=True, timeout=WAIT)
    assert p.returncode == 0, p.stderr


def _held(h: Hold, target: Path) -> None:
    """A loader's open of ``target`` is held; then let go (the gate is the lease: open it)."""
    loader = subprocess.Popen([h.modprobe, str(target)], stdout=subprocess.PIPE)
    try:
        until(
            lambda: loader.pid in [p for p, *_ in h.responder.held()],
            f"a loader's open of {target.name} was not held",
        )
        assert loader.poll() is None
    finally:
        loader.kill()
        loader.wait(WAIT)


def _tree(h: Hold) -> Path:
    d = h.fs / f"lib/modules/{KVER}/kernel/drivers/video"
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_a_file_opened_again_never_reaches_the_responder(hold: Hold) -> None:
    f = hold.fs / "usr/include/linux/types.h"
    f.parent.mkdir(parents=True)
    f.write_bytes(TEXT)  # (this process's own opens are the agent's: allowed, not ignored)
    witness = hold.fs / "usr/include/witness.h"  # opened last: answered, so the state moves
    witness.write_bytes(TEXT)
    _cat(f)
    first = until(lambda: hold.responder.ignore_status()["added"] >= 1 and hold.allowed(), "1st")
    for _ in range(20):
        _cat(f)
    _cat(witness)
    until(lambda: hold.allowed() >= first + 1, "the witness's open")
    assert hold.allowed() == first + 1, "a second open of an ignored file reached it"
    status = hold.responder.ignore_status()
    assert status is not None and status["mode"] == hold.mode and status["added"] == 2


def test_a_target_created_later_in_a_directory_read_before_is_held(hold: Hold) -> None:
    d = _tree(hold)
    for i in range(5):
        (d / f"other{i}.txt").write_bytes(TEXT)
        _cat(d / f"other{i}.txt")
    until(lambda: hold.responder.ignore_status()["added"] >= 5, "the ignore marks")
    target = d / "nvidia-peermem.ko"
    target.write_bytes(MODULE)
    _held(hold, target)


def test_a_module_renamed_or_linked_to_the_targets_name_is_held(hold: Hold) -> None:
    d = _tree(hold)
    built = d / "nvidia-peermem.ko.tmp"  # strip/objcopy write a temporary, then rename
    built.write_bytes(MODULE)
    _cat(built)  # read before: a module by its bytes, never ignored
    until(lambda: hold.responder.ignore_status()["modules_seen"] >= 1, "the module seen")
    target = d / "nvidia-peermem.ko"
    built.rename(target)
    _held(hold, target)
    linked = hold.fs / "elsewhere.bin"
    os.link(target, linked)
    target.unlink()
    os.link(linked, target)
    _held(hold, target)


def test_an_empty_file_ignored_then_written_with_a_module_and_renamed_is_held(
    hold: Hold,
) -> None:
    d = _tree(hold)
    tmp = d / ".tmp-objcopy"
    tmp.write_bytes(b"")
    _cat(tmp)  # empty: ignored
    until(lambda: hold.responder.ignore_status()["added"] >= 1, "the ignore mark")
    with open(tmp, "ab") as f:  # a write clears the mark
        f.write(MODULE)
    target = d / "nvidia-peermem.ko"
    tmp.rename(target)
    _held(hold, target)


def test_a_module_tree_appearing_by_rename_or_bind_mount_is_held(hold: Hold) -> None:
    staged = hold.fs / "staging/lib/modules"
    video = staged / f"{KVER}/kernel/drivers/video"
    video.mkdir(parents=True)
    (video / "nvidia-peermem.ko").write_bytes(MODULE)
    (video / "README").write_bytes(TEXT)
    _cat(video / "nvidia-peermem.ko")
    _cat(video / "README")
    (hold.fs / "lib").mkdir()
    staged.rename(hold.fs / "lib/modules")
    _held(hold, hold.fs / f"lib/modules/{KVER}/kernel/drivers/video/nvidia-peermem.ko")
    bound = hold.fs / "run/nvidia/driver"
    bound.mkdir(parents=True)
    p = subprocess.run(["mount", "--bind", str(hold.fs / "lib"), str(bound)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"mount --bind refused: {p.stderr.decode(errors='replace').strip()}")
    try:
        _held(hold, bound / f"modules/{KVER}/kernel/drivers/video/nvidia-peermem.ko")
    finally:
        subprocess.run(["umount", "-l", str(bound)], capture_output=True)


def test_an_inbox_rdma_module_whose_directory_was_read_is_held(hold: Hold) -> None:
    core = hold.fs / f"lib/modules/{KVER}/kernel/drivers/infiniband/core"
    core.mkdir(parents=True)
    ib_core = core / "ib_core.ko"
    ib_core.write_bytes(MODULE)
    for name in ("Makefile", "modules.order"):
        (core / name).write_bytes(TEXT)
        _cat(core / name)
    _cat(ib_core)  # by cat: not a loader, allowed; a module by its bytes, never ignored
    _held(hold, ib_core)


def test_the_residual_a_non_module_renamed_to_the_targets_name_is_not_held(
    hold: Hold,
) -> None:
    """As docs/operations.md says: an ignore mark goes with its inode, and a file that
    is not a module by its bytes is ignored whatever it is later called. A loader's open
    of it goes on (and the kernel would refuse it: it is not a module)."""
    d = _tree(hold)
    text = d / "notes.txt"
    text.write_bytes(TEXT)
    _cat(text)
    until(lambda: hold.responder.ignore_status()["added"] >= 1, "the ignore mark")
    target = d / "nvidia-peermem.ko"
    text.rename(target)
    p = subprocess.run([hold.modprobe, str(target)], capture_output=True, timeout=WAIT)
    assert p.returncode == 0 and p.stdout == TEXT
    assert not hold.responder.held()


def test_the_group_can_be_made_to_fall_back_and_says_so(hold: Hold) -> None:
    status = hold.responder.ignore_status()
    assert status is not None and status["mode"] in ("evictable", "pinned")
    if status["mode"] == "pinned":
        assert status["pinned_max"] > 0


def test_an_unknown_ignore_mode_is_refused_in_one_line() -> None:
    """A mode the responder does not know is a programming or configuration error, said
    at construction (before, it was taken as a mode and its marks failed one by one)."""

    class NoGroup:  # never reached: the mode is checked first
        pass

    with pytest.raises(ValueError, match=r"mode 'evictible' is not one of auto, evictable"):
        IgnoreMarks(NoGroup(), mode="evictible")  # type: ignore[arg-type]


def test_a_mark_the_kernel_did_not_take_never_uses_up_the_pinned_budget(tmp_path: Path) -> None:
    """The kernel answers 0 to an ignore mark on a file someone has open for writing and
    takes none (issue 51: it was counted, and phantom marks could use up the pinned
    budget). At the budget, the group's fdinfo is counted: the real files still get theirs."""
    from nodeagent.host.fanotify import FanotifyGroup, IgnoreMarks

    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"no fanotify group here: {exc}")
    writers = []
    try:
        marks = IgnoreMarks(group, mode="pinned", pinned_max=2)
        fds = []
        for name in ("busy1", "busy2", "real1", "real2"):
            f = tmp_path / name
            f.write_text("not a module\n")
            if name.startswith("busy"):
                writers.append(open(f, "a"))  # noqa: SIM115 (held open for writing)
            fds.append(os.open(f, os.O_RDONLY))
        for fd in fds:
            marks.add(fd)
        assert marks.kernel_marks() == 2  # the two real files: the busy ones got none
        assert marks.counted == 0  # at the budget the kernel held none of the two asked
        assert marks.status()["added"] == 2
        for fd in fds:
            os.close(fd)
    finally:
        for w in writers:
            w.close()
        group.close()
