"""A load by name is checked before any insert: the storage load-back never meets the
other stack (issue 55).

Real libkmod dry runs on real ``depmod`` indexes, in a built host root with two driver
trees: MOFED's (its ``ib_core`` loaded, exporting its CRCs) and the host's (the inbox
``ib_core`` and a ``rpcrdma`` built against it). Nothing is inserted into this
machine's kernel: the module ops plan with libkmod and only record a ``probe``. The
real kernel's refusal is in ``tests/realkernel/test_load_crcs_real.py``.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.actions import LoadModule
from nodeagent.core.identity import chain_refusals
from nodeagent.core.snapshot import DiskModule, LoadedModule
from nodeagent.host.act import Actuator
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod
from nodeagent.host.observe import Observer
from nodeagent.sim.kofile import write_module_file
from tests.kobuild import require_tool

KVER = "6.1.0-crc-test"
MOFED = "run/mellanox/drivers"
SYM = "ib_register_client"
MOFED_CRC, INBOX_CRC = 0x1111AAAA, 0x2222BBBB


class PlanOnly:
    """libkmod's dry run for plans; a ``probe`` is recorded, never done."""

    def __init__(self) -> None:
        try:
            self.lib = LibKmod(config_paths=())
        except OSError as exc:  # pragma: no cover - depends on the machine
            print(f"skipping: libkmod.so.2 not loadable: {exc}")
            pytest.skip(f"libkmod.so.2 not loadable: {exc}")
        self.probed: list[tuple[str, str]] = []

    def insert_file(self, path: str, params: Sequence[str]) -> None:
        raise AssertionError("no insert by path expected")

    def insert_fd(self, fd: int, name: str, params: Sequence[str]) -> None:
        raise AssertionError("no insert by descriptor expected")

    def remove(self, name: str) -> None:
        raise AssertionError("no removal expected")

    def probe(self, name: str, moddir: str, params: Sequence[str] = ()) -> None:
        self.lib.probe_plan(name, moddir, params)  # ENOENT where the tree lacks it
        self.probed.append((name, moddir))

    def probe_plan(
        self, name: str, moddir: str, params: Sequence[str] = ()
    ) -> tuple[tuple[str, str], ...]:
        return self.lib.probe_plan(name, moddir, params)


def _tree(root: Path, driver_root: str, modules: dict[str, dict[str, object]]) -> None:
    base = root / driver_root if driver_root else root
    kernel = base / "lib/modules" / KVER / "kernel"
    kernel.mkdir(parents=True)
    for name, kw in modules.items():
        write_module_file(kernel / f"{name}.ko", **kw)  # type: ignore[arg-type]
    subprocess.run(["depmod", "-b", str(base), KVER], check=True, capture_output=True)


def node(tmp_path: Path, *, mofed_rpcrdma: bool = False, inbox_rdma_cm: bool = False) -> Path:
    """MOFED's ``ib_core`` loaded; the host's tree built against the inbox one."""
    require_tool("depmod")
    root = tmp_path / "host"
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text(KVER + "\n")
    live = root / "sys/module/ib_core"
    (live / "holders").mkdir(parents=True)
    (live / "initstate").write_text("live\n")
    (live / "refcnt").write_text("1\n")
    (live / "srcversion").write_text("ABCDEF0123456789ABCDEF01\n")
    mofed: dict[str, dict[str, object]] = {
        "ib_core": {"srcversion": "ABCDEF0123456789ABCDEF01", "exported_crcs": {SYM: MOFED_CRC}}
    }
    if mofed_rpcrdma:
        mofed["rpcrdma"] = {"depends": ["ib_core"], "required_crcs": {SYM: MOFED_CRC}}
    _tree(root, MOFED, mofed)
    host: dict[str, dict[str, object]] = {
        "ib_core": {"srcversion": "0123456789ABCDEF01234567", "exported_crcs": {SYM: INBOX_CRC}},
    }
    if inbox_rdma_cm:
        # An unloaded module between them: inserted first, and refused first.
        host["rdma_cm"] = {
            "depends": ["ib_core"],
            "required_crcs": {SYM: INBOX_CRC},
            "exported_crcs": {"rdma_connect": 7},
        }
        host["rpcrdma"] = {"depends": ["rdma_cm"], "required_crcs": {"rdma_connect": 7}}
    else:
        host["rpcrdma"] = {"depends": ["ib_core"], "required_crcs": {SYM: INBOX_CRC}}
    _tree(root, "", host)
    return root


def actuator(root: Path, ops: PlanOnly, *, check: bool = True) -> Actuator:
    cfg = Config(host_root=str(root))
    host = HostRoot(str(root))
    facts = Observer(host, cfg).chain_facts if check else None
    return Actuator(host, ops, lambda _m: [], attempts=1, chain_facts=facts)  # type: ignore[arg-type]


LOAD_BACK = LoadModule("storage", "rpcrdma", (MOFED, ""), "MOFED is ready")


def test_a_module_built_against_the_other_stack_is_not_inserted(tmp_path: Path) -> None:
    """MOFED ships no ``rpcrdma``: the host's is the fallback, built against the inbox
    ``ib_core`` while MOFED's is loaded. Refused before any insert, naming the module,
    the symbol and both CRCs. Fails before the check: the load was a probe."""
    ops = PlanOnly()
    outcome = actuator(node(tmp_path), ops).perform(LOAD_BACK)
    assert not outcome.ok and ops.probed == []
    assert outcome.errno == errno.EINVAL and ("refused", "crcs") in outcome.detail
    error = outcome.error or ""
    assert "rpcrdma not loaded from the host's tree" in error
    assert SYM in error and f"{INBOX_CRC:#010x}" in error and f"{MOFED_CRC:#010x}" in error
    assert f"the loaded ib_core ({MOFED}/lib/modules/{KVER}/kernel/ib_core.ko)" in error


def test_a_chain_refused_in_its_middle_inserts_nothing(tmp_path: Path) -> None:
    """The host's ``rdma_cm`` (not loaded) would go in first and be refused; the whole
    chain is checked first, so neither it nor ``rpcrdma`` is inserted."""
    ops = PlanOnly()
    outcome = actuator(node(tmp_path, inbox_rdma_cm=True), ops).perform(LOAD_BACK)
    assert not outcome.ok and ops.probed == []
    assert "rdma_cm (lib/modules" in (outcome.error or "")


def test_mofeds_own_module_is_loaded_from_mofeds_tree(tmp_path: Path) -> None:
    ops = PlanOnly()
    root = node(tmp_path, mofed_rpcrdma=True)
    outcome = actuator(root, ops).perform(LOAD_BACK)
    assert outcome.ok, outcome.error
    assert ops.probed == [("rpcrdma", str(root / MOFED / "lib/modules" / KVER))]


def test_without_the_check_the_load_goes_to_the_kernel(tmp_path: Path) -> None:
    """The seam: no facts to check with, the probe is made (the kernel refuses it: the
    real-kernel test shows that)."""
    ops = PlanOnly()
    root = node(tmp_path)
    outcome = actuator(root, ops, check=False).perform(LOAD_BACK)
    assert outcome.ok and ops.probed == [("rpcrdma", str(root / "lib/modules" / KVER))]


def _disk(name: str, **kw: object) -> DiskModule:
    return DiskModule(name=name, path=f"lib/modules/k/{name}.ko", **kw)  # type: ignore[arg-type]


def test_the_rule_trusts_only_a_provider_that_is_its_file() -> None:
    """A loaded provider whose identity is not its file is not compared (the kernel
    decides, as without the check); one planned before it is, by its file."""
    live = LoadedModule("ib_core", "live", 1, "AAA", None)
    consumer = _disk("rpcrdma", depends=("ib_core",), required_crcs={SYM: 1})
    same = _disk("ib_core", srcversion="AAA", exported_crcs={SYM: 2})
    other = _disk("ib_core", srcversion="BBB", exported_crcs={SYM: 2})
    assert chain_refusals([consumer], {"ib_core": (live, same)})
    assert chain_refusals([consumer], {"ib_core": (live, other)}) == []
    assert chain_refusals([same, consumer], {}) != []
    agreeing = _disk("ib_core", exported_crcs={SYM: 1})
    assert chain_refusals([agreeing, consumer], {}) == []
    unread = DiskModule(name="rpcrdma", path=None, problem="not in modules.dep")
    assert chain_refusals([unread], {}) == ["cannot read rpcrdma: not in modules.dep"]
