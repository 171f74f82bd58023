"""Smoke tests: the harness really meets a real kernel with module support."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.realkernel.modbuild import KModule
from tests.realkernel.setup import Kernel

from ..waiting import until

pytestmark = pytest.mark.realkernel

SMOKE_C = r"""
#include <linux/module.h>
static int answer = 42;
module_param(answer, int, 0444);
int nodeagent_smoke_answer(void) { return answer; }
EXPORT_SYMBOL(nodeagent_smoke_answer);
MODULE_LICENSE("GPL");
MODULE_VERSION("1.0");
"""
SMOKE = KModule("nodeagent_smoke", {"nodeagent_smoke.c": SMOKE_C})


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def test_in_guest() -> None:
    assert os.environ.get("NODEAGENT_IN_GUEST") == "1"


def test_proc_modules_exists() -> None:
    assert Path("/proc/modules").is_file()


def test_kernel_is_the_downloaded_one(realkernel_kernel: Kernel) -> None:
    assert os.uname().release == realkernel_kernel.kver
    assert _run("uname", "-r").stdout.strip() == realkernel_kernel.kver
    assert Path(f"/usr/lib/modules/{realkernel_kernel.kver}/modules.dep").is_file()


def test_modprobe_ib_core_live_then_remove() -> None:
    sysmod = Path("/sys/module/ib_core")
    assert not sysmod.exists()
    p = _run("modprobe", "ib_core")
    assert p.returncode == 0, p.stderr
    try:
        assert (sysmod / "initstate").read_text().strip() == "live"
        assert (sysmod / "holders").is_dir()
        assert int((sysmod / "refcnt").read_text()) >= 0
        assert "ib_core " in Path("/proc/modules").read_text()
    finally:
        p = _run("modprobe", "-r", "ib_core")
    assert p.returncode == 0, p.stderr
    # Module removal is synchronous, sysfs teardown nearly so (seconds under TCG at most).
    until(lambda: not sysmod.exists(), f"{sysmod} still there after modprobe -r", 60.0)


def test_out_of_tree_module_loads(built_modules: Callable[[KModule], Path]) -> None:
    ko = built_modules(SMOKE)
    p = _run("insmod", str(ko), "answer=7")
    assert p.returncode == 0, p.stderr
    try:
        sysmod = Path("/sys/module/nodeagent_smoke")
        assert (sysmod / "initstate").read_text().strip() == "live"
        assert (sysmod / "parameters/answer").read_text().strip() == "7"
        assert (sysmod / "version").read_text().strip() == "1.0"
        assert (sysmod / "notes/.note.gnu.build-id").is_file()
    finally:
        assert _run("rmmod", "nodeagent_smoke").returncode == 0


# A provider in two ABI versions and a consumer built against version 1
# (KBUILD_EXTRA_SYMBOLS): the real kernel must refuse it on version 2.
def _provider(version: int, args: str) -> KModule:
    src = f"""
#include <linux/module.h>
struct peer_client {{ int a; }};
int fake_register_peer_client({args}) {{ return 0; }}
EXPORT_SYMBOL(fake_register_peer_client);
MODULE_LICENSE("GPL");
MODULE_VERSION("{version}.0");
"""
    return KModule("fake_ib", {"fake_ib.c": src})


FAKE_IB_V1 = _provider(1, "struct peer_client *c")
FAKE_IB_V2 = _provider(2, "struct peer_client *c, long flags")
FAKE_PEERMEM = KModule(
    "fake_peermem",
    {
        "fake_peermem.c": r"""
#include <linux/module.h>
struct peer_client { int a; };
extern int fake_register_peer_client(struct peer_client *c);
static struct peer_client pc;
static int __init m_init(void) { return fake_register_peer_client(&pc); }
static void __exit m_exit(void) {}
module_init(m_init);
module_exit(m_exit);
MODULE_LICENSE("GPL");
"""
    },
    uses=(FAKE_IB_V1,),
)


def test_symbol_crc_mismatch_is_refused(built_modules: Callable[[KModule], Path]) -> None:
    v1, v2, consumer = (built_modules(m) for m in (FAKE_IB_V1, FAKE_IB_V2, FAKE_PEERMEM))
    assert _run("insmod", str(v2)).returncode == 0
    try:
        p = _run("insmod", str(consumer))
        assert p.returncode != 0
        assert "Invalid" in p.stderr  # EINVAL: "Invalid parameters"
        dmesg = _run("dmesg").stdout
        assert "disagrees about version of symbol fake_register_peer_client" in dmesg
    finally:
        assert _run("rmmod", "fake_ib").returncode == 0
    assert _run("insmod", str(v1)).returncode == 0
    try:
        assert _run("insmod", str(consumer)).returncode == 0
        assert Path("/sys/module/fake_ib/holders/fake_peermem").exists()
        assert _run("rmmod", "fake_ib").returncode != 0  # in use
        assert _run("rmmod", "fake_peermem").returncode == 0
    finally:
        _run("rmmod", "fake_peermem")
        assert _run("rmmod", "fake_ib").returncode == 0
