"""nodeagent.host.moddep: modules.dep from real depmod runs and from hand-written files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nodeagent.host import moddep
from nodeagent.host.moddep import find_module, module_dependencies
from nodeagent.host.modfile import read_module_file
from nodeagent.sim.kofile import write_module_file
from tests.kobuild import require_tool

KVER = "6.1.0-test-amd64"


@pytest.fixture(scope="module")
def depmod_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A <root>/lib/modules/<kver> tree indexed by the real depmod."""
    require_tool("depmod")
    root = tmp_path_factory.mktemp("root")
    moddir = root / "lib" / "modules" / KVER
    core = moddir / "kernel" / "drivers" / "infiniband" / "core"
    core.mkdir(parents=True)
    (moddir / "updates" / "dkms").mkdir(parents=True)
    write_module_file(core / "ib-core.ko", exported_crcs={"ib_register_client": 0x11})
    write_module_file(
        core / "ib_uverbs.ko",
        "xz",
        exported_crcs={"ib_uverbs_get_ucontext": 0x22},
        required_crcs={"ib_register_client": 0x11},
    )
    write_module_file(
        moddir / "updates" / "dkms" / "nvidia-peermem.ko",
        "zst",
        required_crcs={"ib_register_client": 0x11, "ib_uverbs_get_ucontext": 0x22},
    )
    res = subprocess.run(
        ["depmod", "-b", str(root), KVER], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr
    return moddir


def test_depmod_wrote_what_we_parse(depmod_tree: Path) -> None:
    lines = (depmod_tree / "modules.dep").read_text().splitlines()
    assert "updates/dkms/nvidia-peermem.ko.zst: kernel/drivers/infiniband/core/ib_uverbs.ko.xz " \
        "kernel/drivers/infiniband/core/ib-core.ko" in lines  # fmt: skip


@pytest.mark.parametrize("spelling", ["nvidia_peermem", "nvidia-peermem"])
def test_find_module_dash_and_underscore(depmod_tree: Path, spelling: str) -> None:
    path = find_module(depmod_tree, spelling)
    assert path == depmod_tree / "updates" / "dkms" / "nvidia-peermem.ko.zst"
    assert read_module_file(path).name == "nvidia_peermem"


def test_find_module_file_named_with_dash(depmod_tree: Path) -> None:
    expected = depmod_tree / "kernel" / "drivers" / "infiniband" / "core" / "ib-core.ko"
    assert find_module(depmod_tree, "ib_core") == expected
    assert find_module(str(depmod_tree), "ib-core") == expected
    assert find_module(depmod_tree, "ib_uverbs") == expected.with_name("ib_uverbs.ko.xz")


def test_dependencies_from_depmod(depmod_tree: Path) -> None:
    assert module_dependencies(depmod_tree, "nvidia-peermem") == ("ib_uverbs", "ib_core")
    assert module_dependencies(depmod_tree, "ib_uverbs") == ("ib_core",)
    assert module_dependencies(depmod_tree, "ib_core") == ()


def test_unknown_module(depmod_tree: Path) -> None:
    assert find_module(depmod_tree, "mlx5_core") is None
    assert module_dependencies(depmod_tree, "mlx5_core") == ()


def test_agrees_with_modprobe_dry_run(depmod_tree: Path) -> None:
    if shutil.which("modprobe") is None:
        pytest.skip("modprobe not installed")
    root = depmod_tree.parents[2]
    res = subprocess.run(
        ["modprobe", "-n", "-v", "-i", "-C", "/dev/null", "-d", str(root), "-S", KVER,
         "nvidia-peermem"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    loaded = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("insmod ")]
    assert loaded[-1] == str(find_module(depmod_tree, "nvidia_peermem"))
    deps = module_dependencies(depmod_tree, "nvidia_peermem")
    assert loaded[:-1] == [str(find_module(depmod_tree, d)) for d in reversed(deps)]


# ------------------------------------------------------------ hand-written modules.dep


@pytest.fixture
def host_moddir(tmp_path: Path) -> Path:
    moddir = tmp_path / "host" / "lib" / "modules" / KVER
    moddir.mkdir(parents=True)
    (moddir / "modules.dep").write_text(
        "\n".join(
            [
                "# a comment",
                "",
                "kernel/fs/good.ko.gz: kernel/a.ko kernel/b-b.ko.xz",
                "not a module line",
                "kernel/dup.ko:",
                "other/dup.ko:",
                "../../../../etc/evil.ko:",
                "kernel/../../../sneaky.ko:",
                "/opt/outside/outside.ko:",
                f"/lib/modules/{KVER}/extra/host-abs.ko: kernel/fs/good.ko.gz",
                f"{moddir}/extra/inside-abs.ko:",
                f"/usr/lib/modules/{KVER}/extra/usrmerge.ko:",
                "/lib/modules/other-kver/x/wrong-kver.ko:",
                "  kernel/spaced.ko  :  kernel/a.ko  ",
            ]
        )
        + "\n"
    )
    return moddir


def test_compressed_suffixes_and_deps(host_moddir: Path) -> None:
    assert find_module(host_moddir, "good") == host_moddir / "kernel/fs/good.ko.gz"
    assert module_dependencies(host_moddir, "good") == ("a", "b_b")
    assert find_module(host_moddir, "spaced") == host_moddir / "kernel/spaced.ko"
    assert module_dependencies(host_moddir, "spaced") == ("a",)


def test_first_line_wins(host_moddir: Path) -> None:
    assert find_module(host_moddir, "dup") == host_moddir / "kernel/dup.ko"


@pytest.mark.parametrize("name", ["evil", "sneaky", "outside", "wrong_kver"])
def test_escaping_paths_are_not_followed(host_moddir: Path, name: str) -> None:
    assert find_module(host_moddir, name) is None


def test_absolute_paths_inside_moddir(host_moddir: Path) -> None:
    assert find_module(host_moddir, "inside_abs") == host_moddir / "extra/inside-abs.ko"
    # written as the host sees it, read through a host-root mount
    assert find_module(host_moddir, "host-abs") == host_moddir / "extra/host-abs.ko"
    assert module_dependencies(host_moddir, "host_abs") == ("good",)
    assert find_module(host_moddir, "usrmerge") == host_moddir / "extra/usrmerge.ko"


def test_missing_or_unusable_modules_dep(tmp_path: Path) -> None:
    assert find_module(tmp_path / "nope", "x") is None
    assert module_dependencies(tmp_path / "nope", "x") == ()
    (tmp_path / "modules.dep").mkdir()
    assert find_module(tmp_path, "x") is None
    # no fallback scan: a .ko lying there is not found without modules.dep
    write_module_file(tmp_path / "x.ko")
    assert find_module(tmp_path, "x") is None


def test_cache_is_keyed_by_mtime_and_size(
    host_moddir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real_parse = moddep._parse

    def counting(text: str) -> dict[str, moddep._Entry]:
        calls.append(1)
        return real_parse(text)

    monkeypatch.setattr(moddep, "_parse", counting)
    moddep._cache.clear()
    assert find_module(host_moddir, "good") is not None
    assert module_dependencies(host_moddir, "good") == ("a", "b_b")
    assert len(calls) == 1
    depfile = host_moddir / "modules.dep"
    st = depfile.stat()
    # same size, new mtime: re-read
    depfile.write_text(depfile.read_text().replace("good.ko.gz", "gold.ko.gz"))
    os.utime(depfile, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert find_module(host_moddir, "good") is None
    assert find_module(host_moddir, "gold") == host_moddir / "kernel/fs/gold.ko.gz"
    assert len(calls) == 2
    # the cache stays small
    for i in range(20):
        d = host_moddir.parent / f"k{i}"
        d.mkdir()
        (d / "modules.dep").write_text(f"m{i}.ko:\n")
        assert find_module(d, f"m{i}") == d / f"m{i}.ko"
    assert len(moddep._cache) <= 8
