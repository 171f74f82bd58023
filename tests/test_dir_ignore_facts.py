"""Why the hold silences files one by one, never a whole directory (issue 50): the kernel
facts, checked with a real fanotify group on a tmpfs (this machine's 6.18; the 6.1 guest
through ``python -m tests.realkernel.vm``, ``docs/design.md``).

A directory ignore mark (``FAN_MARK_IGNORE``, 6.0+) with ``FAN_EVENT_ON_CHILD`` would
answer every child's first open in the kernel, so a build's headers would cost nothing.
It is not safe for the hold, whose targets are files *by name* (``nvidia-peermem.ko`` in
any directory, inbox RDMA modules under ``lib/modules/<kver>/kernel/``):

- the kernel takes one on a directory only with ``FAN_MARK_IGNORED_SURV_MODIFY`` (else
  ``EISDIR``): nothing clears it, ever, whatever is created in the directory;
- it covers the directory's direct children (a grandchild's open still reaches the
  group), and *every* child, a file created or renamed there afterwards included: a
  ``nvidia-peermem.ko`` that appears in a silenced directory is opened unseen, so a load
  of it would go through with the gate closed;
- it stays with the directory's inode: a silenced directory renamed elsewhere (under
  ``lib/modules/<kver>/kernel/``) keeps silencing its children;
- what would tell the responder in time that a name appeared cannot: create and rename
  events need a group that reports file ids, and a permission group cannot (``EINVAL``
  at ``fanotify_init``), so a second, notification group hears of a rename only after it
  happened, and the open can come first. No permission event precedes a rename.

So no directory scheme can promise that a target is never opened through a silenced
directory; the hold keeps per-inode ignore marks (``host/fanotify.IgnoreMarks``), which
never silence a file whose bytes could be a module. ``docs/design.md`` ("Why not silence
whole directories").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.host.fanotify import (
    FAN_CLASS_CONTENT,
    FAN_CLOEXEC,
    FAN_MARK_ADD,
    FAN_NONBLOCK,
    FAN_OPEN_PERM,
    FanotifyGroup,
    _libc,
)
from tests.guards.peermem.rig import mount_tmpfs
from tests.waiting import until

FAN_MARK_IGNORE = 0x00000400  # 6.0: an ignore mask, meant for directories and sb marks
FAN_MARK_IGNORED_SURV_MODIFY = 0x00000040
FAN_EVENT_ON_CHILD = 0x08000000
FAN_REPORT_FID = 0x00000200


class Seen:
    """A group marked on a tmpfs, answering every open (allow) and noting its path."""

    def __init__(self, group: FanotifyGroup, root: Path) -> None:
        self.group = group
        self.root = root  # never silenced: markers go here
        self.paths: list[str] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.group.fd, select.POLLIN)
        while not self.stop:
            if not poller.poll(20):
                continue
            for event in self.group.read():
                with contextlib.suppress(OSError):
                    self.paths.append(os.readlink(f"/proc/self/fd/{event.fd}"))
                self.group.respond(event, True)

    def opened(self, path: Path) -> bool:
        """Open ``path``; whether the group saw that open (a marker file opened after it,
        seen for sure, orders the two)."""
        before = len(self.paths)
        os.close(os.open(path, os.O_RDONLY))
        marker = self.root / f"marker-{before}"
        marker.write_bytes(b"")
        until(lambda: str(marker) in self.paths[before:], f"the marker's open after {path}")
        return str(path) in self.paths[before:]

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.group.close()


@pytest.fixture
def seen(tmp_path: Path) -> Iterator[tuple[Seen, Path]]:
    fs = tmp_path / "fs"
    fs.mkdir()
    why = mount_tmpfs(fs)
    if why:
        pytest.skip(why)
    try:
        group = FanotifyGroup()
    except OSError as exc:
        pytest.skip(f"fanotify refused: {exc}")
    group.mark_filesystem(str(fs))
    s = Seen(group, fs)
    try:
        yield s, fs
    finally:
        s.close()
        subprocess.run(["umount", "-l", str(fs)], check=False)


def _ignore_dir(group: FanotifyGroup, path: Path, flags: int) -> int:
    """fanotify_mark(FAN_MARK_IGNORE | flags, OPEN_PERM | EVENT_ON_CHILD) on ``path``;
    0 or the errno."""
    rc = group._libc.fanotify_mark(
        group.fd,
        FAN_MARK_ADD | FAN_MARK_IGNORE | flags,
        FAN_OPEN_PERM | FAN_EVENT_ON_CHILD,
        -100,
        os.fsencode(path),
    )
    return 0 if rc == 0 else ctypes.get_errno()


def _silenced_dir(s: Seen, fs: Path) -> Path:
    d = fs / "usr/include"
    d.mkdir(parents=True)
    (d / "stdio.h").write_bytes(b"/* a header */\n")
    (d / "sub").mkdir()
    (d / "sub/types.h").write_bytes(b"/* a grandchild */\n")
    rc = _ignore_dir(s.group, d, FAN_MARK_IGNORED_SURV_MODIFY)
    if rc == errno.EINVAL:
        pytest.skip("this kernel has no FAN_MARK_IGNORE (6.0+)")
    assert rc == 0, os.strerror(rc)
    return d


def test_a_directory_ignore_mark_needs_surv_modify(seen: tuple[Seen, Path]) -> None:
    s, fs = seen
    d = fs / "dir"
    d.mkdir()
    rc = _ignore_dir(s.group, d, 0)
    if rc == errno.EINVAL:
        pytest.skip("this kernel has no FAN_MARK_IGNORE (6.0+)")
    assert rc == errno.EISDIR


def test_it_silences_direct_children_only(seen: tuple[Seen, Path]) -> None:
    s, fs = seen
    d = _silenced_dir(s, fs)
    assert not s.opened(d / "stdio.h")
    assert s.opened(d / "sub/types.h")


def test_the_trap_a_target_created_in_a_silenced_directory_is_opened_unseen(
    seen: tuple[Seen, Path],
) -> None:
    s, fs = seen
    d = _silenced_dir(s, fs)
    ko = d / "nvidia-peermem.ko"
    ko.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x01\x00")  # created: seen?
    assert not s.opened(ko)  # a load of it would not be held
    other = fs / "elsewhere.ko"
    other.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x01\x00")
    os.rename(other, d / "nvidia-peermem.ko.xz")  # renamed in: unseen too
    assert not s.opened(d / "nvidia-peermem.ko.xz")


def test_the_trap_a_silenced_directory_renamed_keeps_its_mark(seen: tuple[Seen, Path]) -> None:
    s, fs = seen
    d = _silenced_dir(s, fs)
    core = fs / "lib/modules/6.1.0-test/kernel/drivers/infiniband"
    core.mkdir(parents=True)
    (d / "ib_core.ko").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(9) + b"\x01\x00")
    os.rename(d, core / "core")
    assert not s.opened(core / "core/ib_core.ko")  # an inbox RDMA module, unseen


def test_a_permission_group_cannot_report_file_ids() -> None:
    """Create and rename events need FID reporting: never in the group that answers opens."""
    if os.geteuid() != 0:
        pytest.skip("not root: fanotify_init of a permission class")
    libc = _libc()
    fd = libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_FID, 0)
    if fd >= 0:
        os.close(fd)
    assert fd < 0 and ctypes.get_errno() == errno.EINVAL
