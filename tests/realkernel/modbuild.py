"""Out-of-tree kernel modules for real-kernel tests, built on the host.

Declare a module as a module-level global of a test file in tests/realkernel/::

    from tests.realkernel.modbuild import KModule

    FAKE_IB = KModule("fake_ib", {"fake_ib.c": FAKE_IB_C})
    PEERMEM = KModule("fake_peermem", {"fake_peermem.c": SRC}, uses=(FAKE_IB,))

    @pytest.mark.realkernel
    def test_load(built_modules):
        ko = built_modules(PEERMEM)        # Path to fake_peermem.ko

Before the VM boots, the host builds every KModule global of the test files
that have selected realkernel tests (``make -C <headers> M=<dir> modules``,
~12 s each, then cached under ``<cache>/modules/<kver>/<name>-<hash>/`` keyed
by the content hash of the sources, the kernel version, the make variables, the
providers and the compiler's own ``--version`` line: a compiler upgraded under
the cache builds afresh).  The test command's summary says how many builds
were reused.
The guest finds the results through the manifest named by
``$NODEAGENT_REALKERNEL_MODULES``; the cache dir is visible to the guest
through the read-only 9p root.  ``uses`` links against the providers'
Module.symvers (KBUILD_EXTRA_SYMBOLS) and builds them first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.realkernel import setup as rksetup

BUILD_RECIPE = 1
STAMP = ".nodeagent-built"
CC_VERSION_BYTES = 4096


class BuildError(RuntimeError):
    """The module did not compile; the message holds the build log's tail."""


@dataclass(frozen=True, eq=False)
class KModule:
    """An out-of-tree module: name (``<name>.ko``), sources (file name -> text).

    Without a ``Kbuild`` or ``Makefile`` in the sources, one is generated:
    ``obj-m := <name>.o`` (plus ``<name>-y`` listing the .c files when there
    is no ``<name>.c``).  ``make_vars`` are passed to make (e.g. CONFIG_X=m).
    """

    name: str
    sources: Mapping[str, str]
    uses: Sequence[KModule] = ()
    make_vars: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for fname in self.sources:
            if "/" in fname or fname.startswith("."):
                raise ValueError(f"source file name must be a plain name: {fname!r}")

    def key(self, kver: str) -> str:
        blob = json.dumps(
            {
                "recipe": BUILD_RECIPE,
                "kver": kver,
                "name": self.name,
                "sources": sorted(self.sources.items()),
                "make_vars": sorted(self.make_vars.items()),
                "uses": [u.key(kver) for u in self.uses],
            }
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def files(self) -> dict[str, str]:
        files = dict(self.sources)
        if "Kbuild" not in files and "Makefile" not in files:
            lines = [f"obj-m := {self.name}.o"]
            if f"{self.name}.c" not in files:
                objs = " ".join(f[:-2] + ".o" for f in sorted(files) if f.endswith(".c"))
                lines.append(f"{self.name}-y := {objs}")
            files["Kbuild"] = "\n".join(lines) + "\n"
        return files


@dataclass(frozen=True)
class Built:
    dir: Path
    ko: Path
    symvers: Path
    reused: bool = False  # found in the cache, not compiled now


@functools.cache
def compiler_version(compiler: str) -> str:
    """The first line of ``<compiler> --version`` (the kernel's compiler, e.g. ``gcc-12``):
    part of the cache key, so a compiler upgraded under the cache builds afresh."""
    path = shutil.which(compiler)
    if path is None:
        raise rksetup.SetupError(f"the kernel's compiler {compiler} is not installed")
    p = subprocess.run([path, "--version"], capture_output=True, text=True, check=False, timeout=60)
    first = (p.stdout or p.stderr)[:CC_VERSION_BYTES].splitlines()
    if p.returncode != 0 or not first:
        raise rksetup.SetupError(f"{compiler} --version failed (rc={p.returncode})")
    return first[0].strip()


def closure(specs: Iterable[KModule]) -> list[KModule]:
    """The specs and their providers, providers first, without duplicates."""
    out: list[KModule] = []
    seen: set[int] = set()

    def visit(s: KModule) -> None:
        if id(s) in seen:
            return
        seen.add(id(s))
        for u in s.uses:
            visit(u)
        out.append(s)

    for s in specs:
        visit(s)
    return out


def build_dir(spec: KModule, kver: str, compiler: str) -> Path:
    """Where ``spec`` is built: its key (what the guest looks it up by) and the compiler."""
    key = hashlib.sha256(f"{spec.key(kver)}\0{compiler}".encode()).hexdigest()[:16]
    return rksetup.cache_dir() / "modules" / kver / f"{spec.name}-{key}"


def build(spec: KModule, kernel: rksetup.Kernel, *, jobs: int = 2) -> Built:
    """Build (or find cached) one module and its providers; BuildError on failure."""
    providers = [build(u, kernel, jobs=jobs) for u in spec.uses]
    if shutil.which(kernel.compiler) is None or shutil.which("make") is None:
        rksetup.ensure_build_tools(kernel)
    d = build_dir(spec, kernel.kver, compiler_version(kernel.compiler))
    done = Built(dir=d, ko=d / f"{spec.name}.ko", symvers=d / "Module.symvers")
    cached = replace(done, reused=True)
    if (d / STAMP).exists() and done.ko.exists():
        return cached
    with rksetup._locked(d.parent / f".{d.name}.lock"):
        if (d / STAMP).exists() and done.ko.exists():
            return cached
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for fname, text in spec.files().items():
            (d / fname).write_text(text)
        argv = ["make", f"-j{jobs}", "-C", str(kernel.headers), f"M={d}"]
        if providers:
            argv.append("KBUILD_EXTRA_SYMBOLS=" + " ".join(str(p.symvers) for p in providers))
        argv += [f"{k}={v}" for k, v in spec.make_vars.items()]
        argv.append("modules")
        p = subprocess.run(
            argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL, timeout=600
        )
        log = f"$ {' '.join(argv)}\n{p.stdout}{p.stderr}"
        (d / "build.log").write_text(log)
        if p.returncode != 0 or not done.ko.exists():
            tail = "\n".join(log.splitlines()[-40:])
            raise BuildError(f"building {spec.name}.ko failed (rc={p.returncode}):\n{tail}")
        (d / STAMP).write_text("")
    return done


def build_all(specs: Iterable[KModule], kernel: rksetup.Kernel) -> dict[str, dict[str, str]]:
    """Build every spec (and providers); return the guest manifest {key: entry}.

    An entry is {"name", "ko", "dir", "reused"} ("1": found in the cache) or
    {"name", "error"}; a failed build does not stop the others.
    """
    manifest: dict[str, dict[str, str]] = {}
    for spec in closure(specs):
        key = spec.key(kernel.kver)
        try:
            b = build(spec, kernel)
        except (BuildError, rksetup.SetupError, OSError, subprocess.SubprocessError) as e:
            manifest[key] = {"name": spec.name, "error": str(e)}
        else:
            manifest[key] = {
                "name": spec.name,
                "ko": str(b.ko),
                "dir": str(b.dir),
                "reused": "1" if b.reused else "0",
            }
    return manifest


def lookup(manifest: Mapping[str, Mapping[str, str]], spec: KModule, kver: str) -> Path:
    """The .ko of a spec from a manifest; BuildError if it failed or is absent."""
    entry = manifest.get(spec.key(kver))
    if entry is None:
        raise BuildError(
            f"KModule {spec.name!r} was not built on the host before the boot: declare it as a "
            "module-level global of the test file (tests/realkernel/test_*.py)"
        )
    if "error" in entry:
        raise BuildError(entry["error"])
    return Path(entry["ko"])


def load_manifest(path: str | os.PathLike[str] | None) -> dict[str, dict[str, str]]:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        data: dict[str, dict[str, str]] = json.load(f)
    return data


def symbol_provider(name: str, sym: str, version: str = "") -> KModule:
    """A module exporting ``int sym(void)`` (an ``ib_core``-like provider), with a
    ``MODULE_VERSION`` when given (two builds of one module told apart in /sys)."""
    tail = f'MODULE_VERSION("{version}");\n' if version else ""
    src = (
        "#include <linux/module.h>\n"
        f"int {sym}(void) {{ return 0; }}\n"
        f"EXPORT_SYMBOL({sym});\n"
        'MODULE_LICENSE("GPL");\n'
    )
    return KModule(name, {f"{name}.c": src + tail})


def symbol_user(name: str, sym: str, provider: KModule) -> KModule:
    """A module whose init calls ``sym`` (a peermem-like consumer): modprobe loads
    ``provider`` first."""
    src = (
        "#include <linux/module.h>\n"
        f"extern int {sym}(void);\n"
        f"static int __init m_init(void) {{ return {sym}(); }}\n"
        "static void __exit m_exit(void) {}\n"
        "module_init(m_init);\n"
        "module_exit(m_exit);\n"
        'MODULE_LICENSE("GPL");\n'
    )
    return KModule(name, {f"{name}.c": src}, uses=(provider,))
