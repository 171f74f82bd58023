"""The ABI preflight against a real kernel: predict the seed-001 EINVAL before the kernel does.

A provider in two versions whose exported symbol differs in its prototype
(so in its CRC), and a consumer built against version 1 (KBUILD_EXTRA_SYMBOLS),
as nvidia_peermem is built against one ib_core and meets another. The
preflight reads the .ko files and the loaded provider; the kernel then has
the last word, through the Actuator, with its own log line.

Debian 6.1 only produces the ``__kcrctab`` layout (``__crc_<sym>`` is an
offset into that section); the older absolute-symbol layout cannot be built
against this kernel, so it is covered by the host tests of modfile only.
"""

from __future__ import annotations

import contextlib
import errno
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeagent.core.actions import LoadModuleFile
from nodeagent.core.identity import abi_mismatches
from nodeagent.host.act import Actuator, kmsg_reader
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModprobeTools, ModuleOpError
from nodeagent.host.modfile import read_module_file
from nodeagent.host.observe import disk_module
from tests.realkernel.loaded import observed
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel

SYM = "na_register_peer_client"
PROVIDER, CONSUMER = "na_abi_prov", "na_abi_cons"


def _provider(version: int, args: str) -> KModule:
    src = f"""
#include <linux/module.h>
struct peer_client {{ int a; }};
int {SYM}({args}) {{ return 0; }}
EXPORT_SYMBOL({SYM});
MODULE_LICENSE("GPL");
MODULE_VERSION("{version}.0");
"""
    return KModule(PROVIDER, {f"{PROVIDER}.c": src})


PROV_V1 = _provider(1, "struct peer_client *c")
PROV_V2 = _provider(2, "struct peer_client *c, long flags")
CONS = KModule(
    CONSUMER,
    {
        f"{CONSUMER}.c": f"""
#include <linux/module.h>
struct peer_client {{ int a; }};
extern int {SYM}(struct peer_client *c);
static struct peer_client pc;
static int __init m_init(void) {{ return {SYM}(&pc); }}
static void __exit m_exit(void) {{}}
module_init(m_init);
module_exit(m_exit);
MODULE_LICENSE("GPL");
"""
    },
    uses=(PROV_V1,),
)


def _symvers_crc(ko: Path) -> int:
    """The CRC modpost wrote for SYM next to the provider's .ko."""
    for line in (ko.parent / "Module.symvers").read_text().splitlines():
        crc, name, *_ = line.split("\t")
        if name == SYM:
            return int(crc, 16)
    raise AssertionError(f"{SYM} not in {ko.parent}/Module.symvers")


def _crc_symbol_section(ko: Path) -> str:
    """Section of ``__crc_<SYM>`` per readelf: ``ABS`` (old layout) or a section name."""
    syms = subprocess.run(["readelf", "-sW", str(ko)], capture_output=True, text=True, check=True)
    ndx = next(f[6] for f in map(str.split, syms.stdout.splitlines()) if f[-1:] == [f"__crc_{SYM}"])
    if ndx == "ABS":
        return ndx
    secs = subprocess.run(["readelf", "-SW", str(ko)], capture_output=True, text=True, check=True)
    found = dict(re.findall(r"\[\s*(\d+)\]\s+(\S+)", secs.stdout))
    return found[ndx]


def test_abi_preflight_predicts_the_kernels_refusal(
    built_modules: Callable[[KModule], Path],
) -> None:
    v1_ko, v2_ko, cons_ko = (built_modules(m) for m in (PROV_V1, PROV_V2, CONS))
    v1, v2, cons = (read_module_file(p) for p in (v1_ko, v2_ko, cons_ko))
    crc1, crc2 = _symvers_crc(v1_ko), _symvers_crc(v2_ko)
    assert crc1 != crc2
    # read offline, the CRCs are modpost's: exported by each provider, needed by the consumer
    assert (v1.exported_crcs[SYM], v2.exported_crcs[SYM], cons.required_crcs[SYM]) == (
        crc1,
        crc2,
        crc1,
    )
    # 6.1 writes the __kcrctab layout, not an absolute __crc_ symbol (binutils come with gcc)
    assert _crc_symbol_section(v1_ko) == _crc_symbol_section(v2_ko) == "__kcrctab"

    lk = LibKmod()
    act = Actuator(HostRoot("/"), lk, kmsg_reader())
    load = LoadModuleFile(
        guard="peermem", module=CONSUMER, path=str(cons_ko), params=(), reason="test"
    )
    assert kmsg_reader()(CONSUMER) == []  # nothing about the consumer yet

    lk.insert_file(str(v2_ko), [])
    try:
        loaded = observed(PROVIDER)
        reasons, evidence = abi_mismatches(disk_module(cons), {PROVIDER: (loaded, disk_module(v2))})
        assert reasons == [
            f"{CONSUMER} needs {SYM} CRC {crc1:#010x} "
            f"but the loaded {PROVIDER} exports {crc2:#010x}"
        ]
        assert evidence == {"checked": [SYM], "unverifiable": [], "mismatched": [SYM]}
        # The CRCs of a file are only trusted when the loaded module is that file.
        reasons, evidence = abi_mismatches(disk_module(cons), {PROVIDER: (loaded, disk_module(v1))})
        assert reasons == [] and evidence["checked"] == []
        assert evidence["unverifiable"] == [
            f"{PROVIDER}: loaded module is not {v1.path.lstrip('/')}, its CRCs are unknown"
        ]

        out = act.perform(load)
        assert (out.ok, out.errno) == (False, errno.EINVAL), out
        assert f"{CONSUMER}: disagrees about version of symbol {SYM}" in out.kernel_messages
        assert f"{CONSUMER}: Unknown symbol {SYM} (err -22)" in out.kernel_messages
        with pytest.raises(ModuleOpError) as ei:  # the fallback reads the same errno
            ModprobeTools().insert_file(str(cons_ko), [])
        assert ei.value.errno == errno.EINVAL, ei.value
        assert not Path("/sys/module", CONSUMER).exists()
    finally:
        lk.remove(PROVIDER)

    lk.insert_file(str(v1_ko), [])
    try:
        loaded = observed(PROVIDER)
        reasons, evidence = abi_mismatches(disk_module(cons), {PROVIDER: (loaded, disk_module(v1))})
        assert (reasons, evidence) == (
            [],
            {"checked": [SYM], "unverifiable": [], "mismatched": []},
        )
        out = act.perform(load)
        assert (out.ok, out.errno, out.kernel_messages) == (True, None, ()), out
        assert observed(PROVIDER).holders == (CONSUMER,)
        lk.remove(CONSUMER)
    finally:
        with contextlib.suppress(ModuleOpError):
            lk.remove(CONSUMER)
        lk.remove(PROVIDER)
