"""Paths resolve inside the host root, and a verified module is loaded by its descriptor.

On a real kernel: ``openat2(RESOLVE_IN_ROOT)`` is what HostRoot uses (not the
fallback walk); an absolute symlink under the root resolves in the root, one
that climbs out finds only the root. ``finit_module`` on the descriptor the
agent read loads that very file, even once its path names another file or
none; a compressed module goes through the same descriptor.
"""

from __future__ import annotations

import ctypes
import errno
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.actions import LoadModuleFile
from nodeagent.core.needs import DiskNeed, Needs
from nodeagent.host import fs
from nodeagent.host.act import Actuator, kmsg_reader
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModprobeTools, ModuleOpError, insert_module_fd
from nodeagent.host.modfile import read_module_fd
from nodeagent.host.observe import Observer
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel

NA_FD = KModule(
    "na_fd",
    {
        "na_fd.c": r"""
#include <linux/module.h>
static int answer = 42;
module_param(answer, int, 0444);
MODULE_LICENSE("GPL");
MODULE_VERSION("1.0");
"""
    },
)
SYS = Path("/sys/module")


def test_openat2_resolves_absolute_links_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "host"
    (root / "lib/modules/k/extra").mkdir(parents=True)
    (root / "lib/modules/k/extra/m.ko").write_bytes(b"inside")
    (root / "lib/modules/k/weak-updates").mkdir()
    (root / "lib/modules/k/weak-updates/m.ko").symlink_to("/lib/modules/k/extra/m.ko")
    (tmp_path / "secret").write_bytes(b"outside")
    (root / "escape").symlink_to("../../../../../../" + str(tmp_path / "secret").lstrip("/"))
    host = HostRoot(root)
    assert host.read_bytes("lib/modules/k/weak-updates/m.ko", follow=True) == b"inside"
    assert fs._have_openat2 is True, "the real kernel has openat2: the fallback was not used"
    with pytest.raises(FileNotFoundError):
        host.read_bytes("escape", follow=True)  # '..' stops at the root: no <root>/tmp/...
    # A procfs magic link is no way out either (RESOLVE_NO_MAGICLINKS): ELOOP.
    with pytest.raises(OSError) as ei:
        HostRoot("/").read_bytes("proc/self/root/etc/os-release", follow=True)
    assert ei.value.errno == errno.ELOOP


@pytest.mark.parametrize("ops", [LibKmod, ModprobeTools])
def test_finit_module_loads_the_descriptor_not_the_path(
    ops: Callable[[], LibKmod | ModprobeTools],
    built_modules: Callable[[KModule], Path],
    tmp_path: Path,
) -> None:
    ko = tmp_path / "na_fd.ko"
    shutil.copy(built_modules(NA_FD), ko)
    fd = os.open(ko, os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert read_module_fd(fd, str(ko)).name == "na_fd"  # what the gate verifies
        ko.unlink()  # the path names nothing now: only the descriptor can load it
        ko.write_bytes(b"not a module")
        ops().insert_fd(fd, "na_fd", ["answer=5"])
        assert (SYS / "na_fd/initstate").read_text().strip() == "live"
        assert (SYS / "na_fd/parameters/answer").read_text().strip() == "5"
        with pytest.raises(ModuleOpError) as ei:
            ops().insert_fd(fd, "na_fd", [])
        assert ei.value.errno == errno.EEXIST
    finally:
        os.close(fd)
        if (SYS / "na_fd").exists():
            LibKmod().remove("na_fd")
    assert not (SYS / "na_fd").exists()


def test_finit_module_by_descriptor_of_a_compressed_module(
    built_modules: Callable[[KModule], Path], tmp_path: Path
) -> None:
    xz = tmp_path / "na_fd.ko.xz"
    xz.write_bytes(lzma.compress(built_modules(NA_FD).read_bytes(), check=lzma.CHECK_CRC32))
    fd = os.open(xz, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # Debian's 6.1 kernel does not decompress modules itself: it answers the
        # MODULE_INIT_COMPRESSED_FILE flag with EOPNOTSUPP (an older one would say
        # EINVAL). insert_fd then decompresses the same descriptor for init_module.
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(313, fd, b"", 4) == -1
        assert ctypes.get_errno() in (errno.EOPNOTSUPP, errno.EINVAL)
        insert_module_fd(fd, "na_fd", [])
        assert (SYS / "na_fd/initstate").read_text().strip() == "live"
    finally:
        os.close(fd)
        if (SYS / "na_fd").exists():
            LibKmod().remove("na_fd")


def test_the_agent_loads_the_file_its_observer_verified(
    built_modules: Callable[[KModule], Path], tmp_path: Path
) -> None:
    """The observer reads the .ko through modules.dep inside a host root; then the path
    names junk; the actuator loads what was verified, by its descriptor. A file whose
    inode changed since (unlinked: its ctime moves) is refused until checked again."""
    kver = os.uname().release
    root = tmp_path / "host"
    moddir = root / f"run/nvidia/driver/lib/modules/{kver}"
    (moddir / "extra").mkdir(parents=True)
    (moddir / "extra/na_fd.ko").write_bytes(built_modules(NA_FD).read_bytes())
    (moddir / "modules.dep").write_text("extra/na_fd.ko:\n")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text(kver + "\n")
    host = HostRoot(root)
    needs = Needs(disk=(DiskNeed("na_fd", ("run/nvidia/driver",)),))
    observer = Observer(host, Config(host_root=str(root)), needs)
    disk = observer.observe(0.0).disk["na_fd"]
    assert disk.problem is None and disk.path is not None
    # The directory moves away (the verified file itself is untouched) and the
    # path now names junk: a lookup by path would load the junk.
    (moddir / "extra").rename(moddir / "moved")
    (moddir / "extra").mkdir()
    (moddir / "extra/na_fd.ko").write_bytes(b"\x7fELF not what was verified")
    act = Actuator(host, LibKmod(), kmsg_reader(), verified_fd=observer.verified_fd)
    load = LoadModuleFile(
        guard="t", module="na_fd", path=disk.path, params=("answer=9",), reason="t"
    )
    try:
        outcome = act.perform(load)
        assert outcome.ok, outcome.error
        assert (SYS / "na_fd/parameters/answer").read_text().strip() == "9"
        LibKmod().remove("na_fd")
        (moddir / "moved/na_fd.ko").unlink()  # the verified inode changes (its ctime)
        refused = act.perform(load)
        assert not refused.ok and "changed" in (refused.error or "")
        assert not (SYS / "na_fd").exists()
    finally:
        observer.close()
        if (SYS / "na_fd").exists():
            LibKmod().remove("na_fd")
