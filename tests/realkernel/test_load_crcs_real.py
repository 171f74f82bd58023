"""The storage load-back's CRC check on the real Debian 6.1 kernel (QEMU), issue 55.

MOFED's stand-in stack is loaded: its build of an RDMA core (``na_rdma_core``, whose
exported ``na_rdma_register`` has MOFED's prototype, so another CRC than the inbox
build's). A storage module (``na_storage``) was built against the inbox build and sits
in the fallback tree, as the host's ``rpcrdma`` does when MOFED's tree has none. The
agent's executor, as the storage guard's load-back runs it (MOFED's tree first, then
the other):

- refuses before any insert, naming the module, the symbol and both CRCs; the kernel
  logs nothing about it and nothing is loaded;
- without the check (the seam: no facts to check with), the kernel's own refusal is
  what comes back ("disagrees about version of symbol");
- with MOFED's own build of the module in MOFED's tree, loads it from there.

The fallback tree is a second driver root (``/tmp/na-crc/host``), not the guest's own
``/lib/modules``: the check is per tree, and the guest's tree stays untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.actions import LoadModule
from nodeagent.host.act import Actuator, kmsg_reader
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModuleOpError
from nodeagent.host.observe import Observer
from tests.realkernel.loaded import observed_names
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel

SYM = "na_rdma_register"
MOFED_ROOT = Path("/run/mellanox/drivers")
OTHER_ROOT = Path("/tmp/na-crc/host")


def _core(build: str, args: str) -> KModule:
    src = (
        "#include <linux/module.h>\n"
        f"int {SYM}({args}) {{ return 0; }}\nEXPORT_SYMBOL({SYM});\n"
        f'MODULE_LICENSE("GPL");\nMODULE_VERSION("{build}");\n'
    )
    return KModule("na_rdma_core", {"na_rdma_core.c": src})


def _storage(build: str, args: str, core: KModule) -> KModule:
    call = ", ".join("(void *)0" for _ in args.split(","))
    src = (
        "#include <linux/module.h>\n"
        f"extern int {SYM}({args});\n"
        f"static int __init m_init(void) {{ return {SYM}({call}); }}\n"
        "static void __exit m_exit(void) {}\nmodule_init(m_init);\nmodule_exit(m_exit);\n"
        f'MODULE_LICENSE("GPL");\nMODULE_VERSION("{build}");\n'
    )
    return KModule("na_storage", {"na_storage.c": src}, uses=(core,))


INBOX_ARGS, MOFED_ARGS = "void *client", "void *client, void *invalidate"
INBOX_CORE = _core("inbox", INBOX_ARGS)
MOFED_CORE = _core("mofed", MOFED_ARGS)
INBOX_STORAGE = _storage("inbox", INBOX_ARGS, INBOX_CORE)
MOFED_STORAGE = _storage("mofed", MOFED_ARGS, MOFED_CORE)
LOAD_BACK = LoadModule(
    "storage", "na_storage", (str(MOFED_ROOT).lstrip("/"), str(OTHER_ROOT).lstrip("/")), "test"
)


def _tree(root: Path, kos: dict[str, Path]) -> None:
    kver = os.uname().release
    updates = root / f"lib/modules/{kver}/updates"
    shutil.rmtree(root / "lib", ignore_errors=True)
    updates.mkdir(parents=True)
    for name, ko in kos.items():
        shutil.copy(ko, updates / f"{name}.ko")
    subprocess.run(["depmod", "-b", str(root), kver], check=True)


def _remove(*names: str) -> None:
    for name in names:
        with contextlib.suppress(ModuleOpError):
            LibKmod().remove(name)


@contextlib.contextmanager
def mofed_stack(built: Callable[[KModule], Path], *, mofed_storage: bool) -> Iterator[None]:
    """MOFED's core loaded from MOFED's tree; the inbox builds in the other tree."""
    assert not {"na_rdma_core", "na_storage"} & observed_names()
    mofed = {"na_rdma_core": built(MOFED_CORE)}
    if mofed_storage:
        mofed["na_storage"] = built(MOFED_STORAGE)
    _tree(MOFED_ROOT, mofed)
    _tree(OTHER_ROOT, {"na_rdma_core": built(INBOX_CORE), "na_storage": built(INBOX_STORAGE)})
    try:
        LibKmod().insert_file(str(built(MOFED_CORE)), [])
        yield
    finally:
        _remove("na_storage", "na_rdma_core")
        shutil.rmtree(MOFED_ROOT / "lib", ignore_errors=True)
        shutil.rmtree(OTHER_ROOT, ignore_errors=True)


def _actuator(*, check: bool) -> Actuator:
    host = HostRoot("/")
    facts = Observer(host, Config()).chain_facts if check else None
    return Actuator(host, LibKmod(config_paths=()), kmsg_reader(), attempts=1, chain_facts=facts)


def _dmesg() -> str:
    return subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout


def test_a_storage_module_built_against_the_other_stack_is_refused_before_any_insert(
    built_modules: Callable[[KModule], Path],
) -> None:
    with mofed_stack(built_modules, mofed_storage=False):
        before = _dmesg().count("na_storage")
        outcome = _actuator(check=True).perform(LOAD_BACK)
        assert not outcome.ok and ("refused", "crcs") in outcome.detail, outcome
        assert outcome.errno == errno.EINVAL
        error = outcome.error or ""
        assert f"na_storage not loaded from /{OTHER_ROOT.relative_to('/')}" in error, error
        assert SYM in error and "the loaded na_rdma_core (run/mellanox/drivers/" in error, error
        assert "na_storage" not in observed_names()
        assert _dmesg().count("na_storage") == before  # the kernel never saw it


def test_without_the_check_the_kernel_refuses_it(
    built_modules: Callable[[KModule], Path],
) -> None:
    with mofed_stack(built_modules, mofed_storage=False):
        outcome = _actuator(check=False).perform(LOAD_BACK)
        assert not outcome.ok and outcome.errno == errno.EINVAL, outcome
        said = " ".join(outcome.kernel_messages) + _dmesg()
        assert f"na_storage: disagrees about version of symbol {SYM}" in said, outcome
        assert "na_storage" not in observed_names()


def test_mofeds_own_build_is_loaded_from_mofeds_tree(
    built_modules: Callable[[KModule], Path],
) -> None:
    with mofed_stack(built_modules, mofed_storage=True):
        outcome = _actuator(check=True).perform(LOAD_BACK)
        assert outcome.ok, outcome
        version = Path("/sys/module/na_storage/version").read_text().strip()
        assert version == "mofed"
