"""Module identity against a real kernel: is the loaded module the file on disk?

srcversion where the module has one (MODULE_VERSION), the GNU build-id note
otherwise: Debian 6.1's in-tree modules have no srcversion. What the Observer
reads under /sys/module/<m> must equal what read_module_file reads from the
.ko modprobe used, and identity_mismatch must tell a rebuilt module apart.
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.identity import identity_mismatch
from nodeagent.core.modgraph import removal_order
from nodeagent.core.needs import HOST_TREE
from nodeagent.core.peermem import PeermemPolicy
from nodeagent.core.snapshot import LoadedModule
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModuleOpError
from nodeagent.host.moddep import find_module
from nodeagent.host.modfile import parse_build_id_note, read_module_file
from nodeagent.host.observe import Observer, disk_module
from tests.realkernel.loaded import observed
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel


def _ident_src(gen: int, version: bool) -> str:
    return f"""
#include <linux/module.h>
int na_ident_generation(void) {{ return {gen}; }}
EXPORT_SYMBOL(na_ident_generation);
MODULE_LICENSE("GPL");
{'MODULE_VERSION("1.0");' if version else ""}
"""


# The same module name and version string, rebuilt from another source.
NA_IDENT = {g: KModule("na_ident", {"na_ident.c": _ident_src(g, True)}) for g in (1, 2)}
# No MODULE_VERSION: no srcversion, like Debian's in-tree modules.
NA_NOVER = {g: KModule("na_nover", {"na_nover.c": _ident_src(g, False)}) for g in (1, 2)}

OBSERVER = Observer(HostRoot("/"), Config(policies={"peermem": PeermemPolicy(mofed="host")}))


def _loaded(name: str) -> LoadedModule:
    return observed(name, OBSERVER, clean=True)


def test_in_tree_modules_are_identified_by_build_id() -> None:
    kver = os.uname().release
    moddir = f"/usr/lib/modules/{kver}"
    lk = LibKmod()
    before, _ = OBSERVER.read_loaded_modules()
    assert "ib_core" not in before and "mlx5_core" not in before
    try:
        for name in ("ib_core", "mlx5_core"):
            lk.probe(name, moddir)
        for name in ("ib_core", "mlx5_core"):
            loaded = _loaded(name)
            path = find_module(moddir, name)
            assert path is not None
            used = subprocess.run(
                ["modinfo", "-k", kver, "-n", name], capture_output=True, text=True, check=True
            ).stdout.strip()
            assert path.resolve() == Path(used).resolve()  # the file modprobe uses
            mf = read_module_file(path)
            # Debian 6.1 sets no srcversion on in-tree modules: neither side has one.
            assert loaded.srcversion is None and mf.srcversion is None
            raw = Path(f"/sys/module/{name}/notes/.note.gnu.build-id").read_bytes()
            namesz, descsz, ntype = struct.unpack_from("<III", raw)
            assert (namesz, descsz, ntype, raw[12:16]) == (4, 20, 3, b"GNU\0")
            assert loaded.build_id == parse_build_id_note(raw, name) == raw[16:36].hex()
            assert loaded.build_id == mf.build_id
            # The Observer's own disk lookup (lib/modules/<kver>/modules.dep) agrees.
            disk = OBSERVER.read_disk_module(name, kver, (HOST_TREE,))
            assert disk.problem is None and disk.build_id == mf.build_id
            assert identity_mismatch(loaded, disk) is None
        # Another module's file is told apart, by build-id, naming both.
        ib_core, mlx5 = (
            _loaded("ib_core"),
            OBSERVER.read_disk_module("mlx5_core", kver, (HOST_TREE,)),
        )
        reason = identity_mismatch(ib_core, mlx5)
        assert reason is not None
        assert f"build-id {ib_core.build_id}" in reason and f"build-id {mlx5.build_id}" in reason
    finally:
        after, _ = OBSERVER.read_loaded_modules()
        for name in removal_order(after, set(after) - set(before)):
            with contextlib.suppress(ModuleOpError):
                lk.remove(name)
    assert set(OBSERVER.read_loaded_modules()[0]) == set(before)


@pytest.mark.parametrize(
    ("specs", "kind"),
    [(NA_IDENT, "srcversion"), (NA_NOVER, "build-id")],
    ids=["srcversion", "build-id"],
)
def test_out_of_tree_module_identity(
    specs: dict[int, KModule], kind: str, built_modules: Callable[[KModule], Path]
) -> None:
    v1, v2 = (read_module_file(built_modules(specs[g])) for g in (1, 2))
    name = v1.name
    assert v1.build_id and v2.build_id and v1.build_id != v2.build_id
    if kind == "srcversion":
        assert v1.srcversion and v2.srcversion and v1.srcversion != v2.srcversion
    else:
        assert v1.srcversion is None and v2.srcversion is None
    lk = LibKmod()
    lk.insert_file(v1.path, [])
    try:
        loaded = _loaded(name)
        assert loaded.srcversion == v1.srcversion  # as the kernel spells it, no case folding
        assert loaded.build_id == v1.build_id
        assert identity_mismatch(loaded, disk_module(v1)) is None
        reason = identity_mismatch(loaded, disk_module(v2))
        assert reason is not None
        have, want = (
            (v1.srcversion, v2.srcversion) if kind == "srcversion" else (v1.build_id, v2.build_id)
        )
        assert f"({kind} {have})" in reason and f"({kind} {want})" in reason, reason
        assert v2.path.lstrip("/") in reason
    finally:
        lk.remove(name)
    assert OBSERVER.read_loaded_module(name) is None
