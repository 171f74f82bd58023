"""The real-kernel suite's module build cache: keyed by the compiler too, and counted.

A fake compiler (a script on PATH printing its ``--version``) and fake kernel
headers (a Makefile that "builds" each ``.c`` into a ``.ko``) stand in for gcc and
the Debian headers: what is under test is the cache, not kbuild.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.realkernel import modbuild
from tests.realkernel import setup as rksetup

MAKEFILE = """modules:
\tcd $(M) && for f in *.c; do cp $$f $${f%.c}.ko; done && touch Module.symvers && \\
\t  echo x >> $(M)/../compiled
"""


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[rksetup.Kernel, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cc = f"fakecc-{uuid.uuid4().hex[:8]}"  # a name of its own: compiler_version is cached
    (bin_dir / cc).write_text('#!/bin/sh\ncat "$(dirname "$0")/version"\n')
    (bin_dir / cc).chmod(0o755)
    (bin_dir / "version").write_text("fakecc (Test) 1.0\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("NODEAGENT_REALKERNEL_CACHE", str(tmp_path / "cache"))
    headers = tmp_path / "headers"
    headers.mkdir()
    (headers / "Makefile").write_text(MAKEFILE)
    k = tmp_path / "k"
    kernel = rksetup.Kernel("6.1.0-test", k, k / "vmlinux", True, k, headers, k, cc)
    return kernel, bin_dir


def test_builds_are_reused_until_the_compiler_changes(
    world: tuple[rksetup.Kernel, Path],
) -> None:
    kernel, bin_dir = world
    prov = modbuild.symbol_provider("na_cache_prov", "na_sym")
    user = modbuild.symbol_user("na_cache_user", "na_sym", prov)

    compiled = modbuild.rksetup.cache_dir() / "modules" / kernel.kver / "compiled"

    def compiles() -> int:
        return len(compiled.read_text().splitlines()) if compiled.exists() else 0

    first = modbuild.build_all([user], kernel)
    assert sorted(e["reused"] for e in first.values()) == ["0", "0"] and compiles() == 2
    again = modbuild.build_all([user], kernel)
    assert sorted(e["reused"] for e in again.values()) == ["1", "1"] and compiles() == 2
    assert {k: e["ko"] for k, e in again.items()} == {k: e["ko"] for k, e in first.items()}

    # The compiler is upgraded under the cache: every module is built afresh, and the
    # guest still finds each by the same key (the spec's, not the cache dir's).
    (bin_dir / "version").write_text("fakecc (Test) 2.0\n")
    modbuild.compiler_version.cache_clear()
    upgraded = modbuild.build_all([user], kernel)
    assert upgraded.keys() == first.keys()
    assert sorted(e["reused"] for e in upgraded.values()) == ["0", "0"] and compiles() == 4
    assert all(upgraded[k]["dir"] != first[k]["dir"] for k in first)
    assert modbuild.lookup(upgraded, user, kernel.kver).name == "na_cache_user.ko"


def test_the_compiler_version_is_its_first_line(world: tuple[rksetup.Kernel, Path]) -> None:
    kernel, _ = world
    assert modbuild.compiler_version(kernel.compiler) == "fakecc (Test) 1.0"
    with pytest.raises(rksetup.SetupError, match="not installed"):
        modbuild.compiler_version(f"no-such-cc-{uuid.uuid4().hex[:8]}")
