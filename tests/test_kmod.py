"""nodeagent.host.kmod: what can be tested on a kernel without module support.

Real loads and unloads run in the QEMU real-kernel suite; here: validation
happens before any call, the command-line fallback builds the right argv and
maps messages to errno, and libkmod is wired up (its own errors, dry runs, and
whatever errno this kernel gives for a real syscall).
"""

from __future__ import annotations

import ctypes.util
import errno
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import NodeagentError
from nodeagent.host import kmod
from nodeagent.host.kmod import (
    LibKmod,
    ModprobeTools,
    ModuleOpError,
    ModuleOps,
    default_module_ops,
    errno_from_message,
)
from nodeagent.sim.kofile import write_module_file
from tests.kobuild import require_tool

KVER = "6.1.0-test-amd64"

BAD_NAMES = ["", "nvidia peermem", "a;rm -rf /", "../ib_core", "x" * 56, "ib_core\n", "é"]
BAD_PARAMS: list[Sequence[str]] = [
    ["a=b c"],
    ["a=$(reboot)"],
    ["-f"],
    ["a='x'"],
    ["ok=1", "a=`x`"],
    ["a=1;b"],
    "a=1",  # a bare string is not a sequence of parameters
]


def _libkmod() -> LibKmod:
    try:
        return LibKmod()
    except OSError as exc:  # pragma: no cover - depends on the machine
        print(f"skipping libkmod tests: {exc}")
        pytest.skip(f"libkmod.so.2 not loadable: {exc}")


class _NoCalls:
    """Stands in for the libkmod binding: any use is a test failure."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"libkmod.{name} reached with invalid input")


class FakeRun:
    """Replaces subprocess.run: records argv and keyword arguments, answers ``result``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.result: tuple[int, str] = (0, "")

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append({"argv": argv, **kw})
        rc, stderr = self.result
        return subprocess.CompletedProcess(argv, rc, "", stderr)


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> FakeRun:
    fr = FakeRun()
    monkeypatch.setattr(subprocess, "run", fr)
    monkeypatch.setattr(shutil, "which", lambda tool, path=None: f"/usr/sbin/{tool}")
    return fr


# ------------------------------------------------------------ ModuleOpError


def test_module_op_error_text_and_fields() -> None:
    err = ModuleOpError("load", "nvidia_peermem", errno.EINVAL)
    assert str(err) == "load nvidia_peermem: Invalid argument (EINVAL)"
    assert (err.op, err.module, err.errno) == ("load", "nvidia_peermem", errno.EINVAL)
    detailed = ModuleOpError("unload", "ib_core", errno.EBUSY, "in use\nby: ib_uverbs")
    assert str(detailed) == "unload ib_core: Device or resource busy (EBUSY): in use by: ib_uverbs"


# ------------------------------------------------------------ validation first


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_rejected_before_libkmod(name: str) -> None:
    lk = _libkmod()
    lk._lib = _NoCalls()  # type: ignore[assignment]
    with pytest.raises(NodeagentError, match="invalid kernel module name"):
        lk.remove(name)
    with pytest.raises(NodeagentError, match="invalid kernel module name"):
        lk.probe(name, "/lib/modules/x")
    if "/" not in name:  # else the file's base name is a fine module name
        with pytest.raises(NodeagentError):
            lk.insert_file(f"/lib/modules/x/{name}.ko", [])


@pytest.mark.parametrize("params", BAD_PARAMS)
def test_bad_params_rejected_before_libkmod(params: Sequence[str]) -> None:
    lk = _libkmod()
    lk._lib = _NoCalls()  # type: ignore[assignment]
    with pytest.raises(NodeagentError, match="parameter"):
        lk.insert_file("/lib/modules/x/nvidia-peermem.ko", params)
    with pytest.raises(NodeagentError, match="parameter"):
        lk.probe("nvidia_peermem", "/lib/modules/x", params)


@pytest.mark.parametrize("path", ["", "/x/module.txt", "/x/a\0b.ko", "/x/.ko", "/x/bad name.ko"])
def test_bad_module_paths_rejected(path: str, fake_run: FakeRun) -> None:
    lk = _libkmod()
    lk._lib = _NoCalls()  # type: ignore[assignment]
    with pytest.raises(NodeagentError):
        lk.insert_file(path, [])
    with pytest.raises(NodeagentError):
        ModprobeTools().insert_file(path, [])
    assert fake_run.calls == []


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_and_params_never_reach_argv(name: str, fake_run: FakeRun) -> None:
    tools = ModprobeTools()
    with pytest.raises(NodeagentError):
        tools.remove(name)
    with pytest.raises(NodeagentError):
        tools.probe(name, "/lib/modules/x")
    for params in BAD_PARAMS:
        with pytest.raises(NodeagentError):
            tools.probe("ib_core", "/lib/modules/x", params)
        with pytest.raises(NodeagentError):
            tools.insert_file("/x/ib_core.ko", params)
    assert fake_run.calls == []


# ------------------------------------------------------------ ModprobeTools argv


def test_modprobe_tools_argv(fake_run: FakeRun, tmp_path: Path) -> None:
    tools = ModprobeTools()
    rel = Path("rel") / "nvidia-peermem.ko.xz"
    tools.insert_file(str(rel), ["peer=1", "list=a,b"])
    tools.remove("nvidia-peermem")
    tools.probe("nvidia-peermem", "/host/lib/modules/6.1.0-18-amd64", ["x=1"])
    tools.probe("ib_core", "/host/usr/lib/modules/6.1.0-18-amd64")
    assert [c["argv"] for c in fake_run.calls] == [
        ["/usr/sbin/insmod", str(Path.cwd() / rel), "peer=1", "list=a,b"],
        ["/usr/sbin/rmmod", "nvidia_peermem"],
        ["/usr/sbin/modprobe", "-i", "-C", "/dev/null", "-d", "/host", "-S", "6.1.0-18-amd64",
         "nvidia_peermem", "x=1"],
        ["/usr/sbin/modprobe", "-i", "-C", "/dev/null", "-d", "/host/usr", "-S", "6.1.0-18-amd64",
         "ib_core"],
    ]  # fmt: skip
    for call in fake_run.calls:
        assert not call.get("shell", False)
        assert call["env"]["LC_ALL"] == "C"
        assert call["stdin"] == subprocess.DEVNULL


def test_modprobe_tools_config_paths(fake_run: FakeRun) -> None:
    ModprobeTools(config_paths=None).probe("a", "/lib/modules/k")
    ModprobeTools(config_paths=["/host/etc/modprobe.d", "/host/lib/modprobe.d"]).probe(
        "a", "/lib/modules/k"
    )
    assert [c["argv"][1:-5] for c in fake_run.calls] == [
        ["-i"],
        ["-i", "-C", "/host/etc/modprobe.d", "-C", "/host/lib/modprobe.d"],
    ]


@pytest.mark.parametrize("moddir", ["/host/modules", "/lib/modules", "relative/lib/x/6.1"])
def test_modprobe_tools_rejects_unusual_moddir(moddir: str, fake_run: FakeRun) -> None:
    with pytest.raises(NodeagentError, match="lib/modules"):
        ModprobeTools().probe("ib_core", moddir)
    assert fake_run.calls == []


# real kmod messages (kmod 30) -> errno
MESSAGES = [
    ("insmod: ERROR: could not insert module /x/a.ko: File exists", errno.EEXIST),
    ("rmmod: ERROR: Module ib_core is in use by: ib_uverbs rdma_cm", errno.EBUSY),
    ("rmmod: ERROR: Module nosuch is not currently loaded", errno.ENOENT),
    ("rmmod: ERROR: Module ib_core is builtin.", errno.ENOENT),
    ("modprobe: FATAL: Module foo not found in directory /lib/modules/6.1", errno.ENOENT),
    ("modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument", errno.EINVAL),
    ("insmod: ERROR: could not insert module /x/a.ko: Invalid parameters", errno.EINVAL),
    ("insmod: ERROR: could not insert module /x/a.ko: Unknown symbol in module", errno.ENOENT),
    (
        "modprobe: ERROR: could not insert 'a': Unknown symbol in module, or unknown parameter "
        "(see dmesg)",
        errno.ENOENT,
    ),
    ("insmod: ERROR: could not insert module /x/a.ko: Invalid module format", errno.ENOEXEC),
    ("modprobe: ERROR: could not insert 'a': Operation not permitted", errno.EPERM),
    (
        "insmod: ERROR: could not insert module /x/a.ko: Key was rejected by service",
        errno.EKEYREJECTED,
    ),
    ("insmod: ERROR: could not insert module /x/a.ko: Function not implemented", errno.ENOSYS),
    ("something nobody has seen before", errno.EIO),
]


@pytest.mark.parametrize(("message", "expected"), MESSAGES)
def test_errno_from_message(message: str, expected: int) -> None:
    assert errno_from_message(message) == expected


def test_modprobe_tools_raise_mapped_errno(fake_run: FakeRun) -> None:
    tools = ModprobeTools()
    fake_run.result = (1, "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument\n")
    with pytest.raises(ModuleOpError) as ei:
        tools.probe("nvidia_peermem", "/lib/modules/6.1")
    assert (ei.value.op, ei.value.module, ei.value.errno) == (
        "probe",
        "nvidia_peermem",
        errno.EINVAL,
    )
    assert str(ei.value).startswith("probe nvidia_peermem: Invalid argument (EINVAL): modprobe:")
    fake_run.result = (1, "rmmod: ERROR: Module ib_core is in use by: ib_uverbs\n")
    with pytest.raises(ModuleOpError) as ei:
        tools.remove("ib_core")
    assert (ei.value.op, ei.value.errno) == ("unload", errno.EBUSY)
    fake_run.result = (1, "insmod: ERROR: could not insert module /x/ib_core.ko: File exists\n")
    with pytest.raises(ModuleOpError) as ei:
        tools.insert_file("/x/ib_core.ko", [])
    assert (ei.value.op, ei.value.errno) == ("load", errno.EEXIST)
    # already loaded is not an error for probe
    fake_run.result = (1, "modprobe: ERROR: could not insert 'ib_core': File exists\n")
    tools.probe("ib_core", "/lib/modules/6.1")


def test_modprobe_tools_missing_tool_and_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool, path=None: None)
    with pytest.raises(ModuleOpError) as ei:
        ModprobeTools().remove("ib_core")
    # ENOSYS, never ENOENT: a missing rmmod must not read as "module not loaded"
    assert ei.value.errno == errno.ENOSYS and "rmmod: command not found" in str(ei.value)

    def slow(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(shutil, "which", lambda tool, path=None: f"/sbin/{tool}")
    monkeypatch.setattr(subprocess, "run", slow)
    with pytest.raises(ModuleOpError) as ei:
        ModprobeTools(timeout=0.5).probe("ib_core", "/lib/modules/6.1")
    assert ei.value.errno == errno.ETIMEDOUT


# ------------------------------------------------------------ real tools, real libkmod


@pytest.fixture(scope="module")
def depmod_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tool("depmod")
    root = tmp_path_factory.mktemp("root")
    moddir = root / "lib" / "modules" / KVER
    (moddir / "kernel").mkdir(parents=True)
    (moddir / "updates").mkdir()
    write_module_file(moddir / "kernel" / "ib-core.ko", exported_crcs={"ib_register_client": 1})
    write_module_file(
        moddir / "kernel" / "ib_uverbs.ko",
        "xz",
        exported_crcs={"ib_uverbs_x": 2},
        required_crcs={"ib_register_client": 1},
    )
    write_module_file(
        moddir / "updates" / "nvidia-peermem.ko",
        "zst",
        required_crcs={"ib_register_client": 1, "ib_uverbs_x": 2},
    )
    subprocess.run(["depmod", "-b", str(root), KVER], check=True, capture_output=True)
    return moddir


def test_libkmod_probe_plan_follows_modules_dep(depmod_tree: Path, tmp_path: Path) -> None:
    lk = _libkmod()
    assert lk.probe_plan("nvidia-peermem", str(depmod_tree), ["peer=1"]) == (
        ("ib_core", ""),
        ("ib_uverbs", ""),
        ("nvidia_peermem", "peer=1"),
    )
    # modprobe.d options are read only from the configured paths
    conf = tmp_path / "modprobe.d"
    conf.mkdir()
    (conf / "x.conf").write_text("options ib_core from_conf=1\n")
    with_conf = LibKmod(config_paths=[str(conf)])
    assert with_conf.probe_plan("ib_uverbs", str(depmod_tree))[0] == ("ib_core", "from_conf=1")
    assert lk.probe_plan("ib_uverbs", str(depmod_tree))[0] == ("ib_core", "")


def test_libkmod_probe_unknown_module_is_enoent(depmod_tree: Path, tmp_path: Path) -> None:
    lk = _libkmod()
    with pytest.raises(ModuleOpError) as ei:
        lk.probe("mlx5_core", str(depmod_tree))
    assert (ei.value.op, ei.value.module, ei.value.errno) == ("probe", "mlx5_core", errno.ENOENT)
    # no modules.dep.bin at all: also ENOENT, never a crash
    with pytest.raises(ModuleOpError) as ei:
        lk.probe("ib_core", str(tmp_path))
    assert ei.value.errno == errno.ENOENT


def test_libkmod_remove_gives_kernel_errno() -> None:
    lk = _libkmod()
    with pytest.raises(ModuleOpError) as ei:
        lk.remove("nodeagent-no-such-module")
    # ENOENT on a kernel with modules, ENOSYS here, EPERM without CAP_SYS_MODULE
    assert ei.value.errno in (errno.ENOENT, errno.ENOSYS, errno.EPERM)
    assert ei.value.op == "unload"
    assert "nodeagent_no_such_module" in str(ei.value)


def test_libkmod_insert_and_probe_reach_the_kernel(depmod_tree: Path) -> None:
    lk = _libkmod()
    path = depmod_tree / "kernel" / "ib-core.ko"
    with pytest.raises(ModuleOpError) as ei:
        lk.insert_file(str(path), ["a=1"])
    assert ei.value.errno != 0 and ei.value.module == "ib_core" and ei.value.op == "load"
    with pytest.raises(ModuleOpError) as ei:
        lk.probe("nvidia_peermem", str(depmod_tree))
    # the first module of the chain is the one the kernel refused
    assert ei.value.errno != 0 and "inserting ib_core" in str(ei.value)


def test_libkmod_insert_missing_file_is_enoent(tmp_path: Path) -> None:
    with pytest.raises(ModuleOpError) as ei:
        _libkmod().insert_file(str(tmp_path / "gone.ko"), [])
    assert (ei.value.op, ei.value.module, ei.value.errno) == ("load", "gone", errno.ENOENT)


def test_real_tools_agree_with_libkmod(depmod_tree: Path) -> None:
    if shutil.which("rmmod") is None or shutil.which("modprobe") is None:
        pytest.skip("kmod tools not installed")
    tools = ModprobeTools()
    with pytest.raises(ModuleOpError) as ei:
        tools.remove("nodeagent_no_such_module")
    assert ei.value.errno == errno.ENOENT  # rmmod checks /sys/module itself
    with pytest.raises(ModuleOpError) as ei:
        tools.probe("mlx5_core", str(depmod_tree))
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(ModuleOpError) as ei:
        tools.probe("nvidia_peermem", str(depmod_tree))
    lib_errno: int | None = None
    try:
        _libkmod().probe("nvidia_peermem", str(depmod_tree))
    except ModuleOpError as exc:
        lib_errno = exc.errno
    assert ei.value.errno == lib_errno


def test_default_module_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = default_module_ops()
    assert isinstance(ops, ModuleOps)
    if ctypes.util.find_library("kmod"):
        assert isinstance(ops, LibKmod)

    def broken(*_a: Any, **_k: Any) -> None:
        raise OSError("libkmod.so.2: cannot open shared object file")

    monkeypatch.setattr(kmod.LibKmod, "__init__", broken)
    fallback = default_module_ops()
    assert isinstance(fallback, ModprobeTools) and isinstance(fallback, ModuleOps)


def test_libkmod_missing_library() -> None:
    with pytest.raises(OSError):
        LibKmod("libkmod-does-not-exist.so.9")
