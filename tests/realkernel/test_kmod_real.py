"""LibKmod and its ModprobeTools fallback against a real kernel: parameters, errno, Actuator.

Each refusal the agent must tell apart (EBUSY, ENOENT, EEXIST, EINVAL) is
provoked for real, through both ModuleOps implementations, and through the
Actuator into ActionOutcome.errno. The two must agree: the fallback's
message->errno mapping is proven here against the real kmod tools.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.config import Config
from nodeagent.core.actions import LoadModuleFile, UnloadModule
from nodeagent.core.modgraph import removal_order
from nodeagent.host.act import Actuator, kmsg_reader
from nodeagent.host.fs import HostRoot
from nodeagent.host.kmod import LibKmod, ModprobeTools, ModuleOpError, ModuleOps
from nodeagent.host.moddep import find_module
from nodeagent.host.observe import Observer
from tests.realkernel.loaded import moddir, observed_names
from tests.realkernel.modbuild import KModule

pytestmark = pytest.mark.realkernel

NA_PARAM = KModule(
    "na_param",
    {
        "na_param.c": r"""
#include <linux/module.h>
static int answer = 42;
module_param(answer, int, 0444);
static char *label = "none";
module_param(label, charp, 0444);
MODULE_LICENSE("GPL");
MODULE_VERSION("1.0");
"""
    },
)
SYS = Path("/sys/module")


def _unload_since(before: set[str]) -> list[str]:
    """Remove what was loaded since ``before``, holders first; the order used."""
    mods, _ = Observer(HostRoot("/"), Config()).read_loaded_modules()
    order = removal_order(mods, set(mods) - before)
    for name in order:
        LibKmod().remove(name)
    return order


@pytest.fixture
def restore() -> Iterator[set[str]]:
    """The loaded set before the test; afterwards, whatever the test loaded is gone."""
    before = observed_names()
    yield before
    with contextlib.suppress(ModuleOpError):
        _unload_since(before)
    assert observed_names() == before


def _errno_of(op: Callable[[ModuleOps], None], ops: ModuleOps) -> int | None:
    try:
        op(ops)
    except ModuleOpError as exc:
        return exc.errno
    return None


def _builtin_module() -> str | None:
    """A module built into this kernel that has a /sys/module directory (no initstate)."""
    for line in Path(moddir(), "modules.builtin").read_text().split():
        name = line.rsplit("/", 1)[-1].removesuffix(".ko").replace("-", "_")
        d = SYS / name
        if d.is_dir() and not (d / "initstate").exists():
            return name
    return None


def _kmsg_count(line: str) -> int:
    return kmsg_reader(keep=10_000)("na_param").count(line)


OPS: dict[str, Callable[[], ModuleOps]] = {"libkmod": LibKmod, "tools": ModprobeTools}


@pytest.mark.parametrize("which", sorted(OPS))
def test_load_with_parameters_then_remove(
    which: str, built_modules: Callable[[KModule], Path], restore: set[str]
) -> None:
    ops = OPS[which]()
    ko = str(built_modules(NA_PARAM))
    ops.insert_file(ko, ["answer=7", "label=rdma"])
    params = SYS / "na_param/parameters"
    assert (SYS / "na_param/initstate").read_text().strip() == "live"
    assert (params / "answer").read_text().strip() == "7"
    assert (params / "label").read_text().strip() == "rdma"
    ops.remove("na_param")
    assert not (SYS / "na_param").exists()
    # A value the parameter cannot take is refused (EINVAL), and the kernel says why;
    # an unknown parameter is not an error: the kernel loads the module and warns.
    invalid = "na_param: `notanumber' invalid for parameter `answer'"
    ignored = "na_param: unknown parameter 'na_bogus_param' ignored"
    seen = _kmsg_count(invalid), _kmsg_count(ignored)
    with pytest.raises(ModuleOpError) as ei:
        ops.insert_file(ko, ["answer=notanumber"])
    assert (ei.value.op, ei.value.module, ei.value.errno) == ("load", "na_param", errno.EINVAL)
    assert not (SYS / "na_param").exists()
    ops.insert_file(ko, ["na_bogus_param=1"])
    assert (params / "answer").read_text().strip() == "42"
    ops.remove("na_param")
    assert (_kmsg_count(invalid), _kmsg_count(ignored)) == (seen[0] + 1, seen[1] + 1)


def test_errno_libkmod_and_tools_agree(
    built_modules: Callable[[KModule], Path], restore: set[str]
) -> None:
    ko = str(built_modules(NA_PARAM))
    directory = moddir()
    lk, tools = LibKmod(), ModprobeTools()
    assert find_module(directory, "xprtrdma") is None  # 6.1: only an alias of rpcrdma
    # modprobe resolves the alias; LibKmod must too (it did not: ENOENT).
    assert "rpcrdma" not in restore
    tools.probe("xprtrdma", directory)
    assert (SYS / "rpcrdma/initstate").read_text().strip() == "live"
    _unload_since(restore)
    lk.probe("xprtrdma", directory)
    assert (SYS / "rpcrdma/initstate").read_text().strip() == "live"
    assert (SYS / "rdma_cm/holders/rpcrdma").exists()

    builtin = _builtin_module()
    assert builtin is not None
    cases: list[tuple[str, Callable[[ModuleOps], None], int | None]] = [
        ("probe an alias again (loaded)", lambda o: o.probe("xprtrdma", directory), None),
        ("probe a loaded module", lambda o: o.probe("rdma_cm", directory), None),
        ("remove rdma_cm held by rpcrdma", lambda o: o.remove("rdma_cm"), errno.EBUSY),
        ("remove ib_core (held)", lambda o: o.remove("ib_core"), errno.EBUSY),
        ("remove an unknown module", lambda o: o.remove("na_no_such_mod"), errno.ENOENT),
        (f"remove builtin {builtin}", lambda o: o.remove(builtin), errno.ENOENT),
        ("probe an unknown module", lambda o: o.probe("na_no_such_mod", directory), errno.ENOENT),
        ("insert a missing file", lambda o: o.insert_file("/na/none.ko", []), errno.ENOENT),
        ("insert a bad value", lambda o: o.insert_file(ko, ["answer=x"]), errno.EINVAL),
    ]
    got = {label: (_errno_of(op, lk), _errno_of(op, tools)) for label, op, _ in cases}
    want = {label: (err, err) for label, _, err in cases}
    lk.insert_file(ko, [])
    again: Callable[[ModuleOps], None] = lambda o: o.insert_file(ko, [])  # noqa: E731
    got["insert a loaded module"] = (_errno_of(again, lk), _errno_of(again, tools))
    want["insert a loaded module"] = (errno.EEXIST, errno.EEXIST)
    assert got == want
    assert (SYS / "rdma_cm/initstate").read_text().strip() == "live"  # refusals changed nothing


def _outcome(act: Actuator, action: LoadModuleFile | UnloadModule) -> tuple[bool, int | None]:
    out = act.perform(action)
    assert out.ok == (out.errno is None), out
    return out.ok, out.errno


@pytest.mark.parametrize("which", sorted(OPS))
def test_actuator_keeps_errno(
    which: str, built_modules: Callable[[KModule], Path], restore: set[str]
) -> None:
    ko = str(built_modules(NA_PARAM))
    LibKmod().probe("rpcrdma", moddir())
    act = Actuator(HostRoot("/"), OPS[which](), kmsg_reader(), first_wait_s=0.01)
    load = LoadModuleFile(guard="t", module="na_param", path=ko, params=("answer=3",), reason="t")
    unload = UnloadModule(guard="t", module="na_param", reason="t")
    assert _outcome(act, UnloadModule(guard="t", module="rdma_cm", reason="t")) == (
        False,
        errno.EBUSY,
    )
    assert _outcome(act, load) == (True, None)
    assert (SYS / "na_param/parameters/answer").read_text().strip() == "3"
    assert _outcome(act, load) == (False, errno.EEXIST)
    assert _outcome(act, unload) == (True, None)
    # Gone already: the kernel's ENOENT, through either backend, is an unload done (a
    # removal resumed after a crash goes on past what the last call took away).
    gone = act.perform(unload)
    assert gone.ok and gone.errno is None and gone.detail == (("module", "already unloaded"),)
