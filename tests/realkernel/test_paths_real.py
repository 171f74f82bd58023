"""Paths resolve inside the host root, and a verified module is loaded by its descriptor.

On a real kernel: ``openat2(RESOLVE_IN_ROOT)`` is what HostRoot uses (not the
fallback walk); an absolute symlink under the root resolves in the root, one
that climbs out finds only the root. ``finit_module`` on the descriptor the
agent read loads that very file, even once its path names another file or
none; a compressed module goes through the same descriptor.
"""

from __future__ import annotations

import errno
import lzma
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.host import fs
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModprobeTools, ModuleOpError
from nodeagent.host.modfile import read_module_fd

from .modbuild import KModule

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
        LibKmod().insert_fd(fd, "na_fd", [])
        assert (SYS / "na_fd/initstate").read_text().strip() == "live"
    finally:
        os.close(fd)
        if (SYS / "na_fd").exists():
            LibKmod().remove("na_fd")
