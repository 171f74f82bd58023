"""Prepare a stock Debian kernel for the real-kernel tests (idempotent, cached).

    python -m tests.realkernel.setup        # from the repository root

Downloads (does not install) the kernel that ``linux-image-amd64`` currently
points at, plus its headers, extracts them into the cache directory, runs
``depmod -b``, decompresses the bzImage payload into a ``vmlinux`` that QEMU
boots through the PVH entry (the in-kernel decompressor is slow under TCG) and
builds a busybox initramfs that mounts the host root read-only over 9p with a
tmpfs overlay on top.

Cache: ``$NODEAGENT_REALKERNEL_CACHE``, else
``${XDG_CACHE_HOME:-~/.cache}/nodeagent-realkernel``.  Anything that cannot be
done (not root, no apt, a refused download) raises :class:`SetupError` with a
one-line reason, which the pytest plugin uses as the skip reason.

Standard library only: this file also runs outside the project's venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import io
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when anything below changes what ends up in k/<kver>/ (init script,
# module list, extraction): the next run rebuilds from the cached .debs.
RECIPE = 3

BASE_PACKAGES = ("qemu-system-x86", "busybox-static", "kmod")
# QEMU >= 8 has ``-device igb`` (an 82576 SR-IOV PF whose VFs get igbvf netdevs, for
# the VF guard's tests); Debian bookworm has 7.2, bookworm-backports a newer one.
QEMU_MIN_IGB = (8, 0)
BACKPORTS_SOURCES = Path("/etc/apt/sources.list.d/nodeagent-backports.sources")
BUSYBOX = Path("/bin/busybox")
# Modules the initramfs needs to reach the 9p root; dependencies come from modules.dep.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
APT_LOCK = ("-o", "DPkg::Lock::Timeout=300")

GUEST_SHARED = "/mnt/shared"  # where the read-write shared 9p dir appears in the guest
INIT_CMDLINE_KEY = "nodeagent.init"

INITRAMFS_INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
die() {{ echo "nodeagent-initramfs: $*"; echo o > /proc/sysrq-trigger; while :; do :; done; }}
for m in $(cat /mods/order); do insmod "/mods/$m.ko" || die "insmod $m failed"; done
KVER=$(uname -r)
P9="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o "$P9,ro,cache=loose" hostroot /lower || die "9p host root mount failed"
mount -t tmpfs -o size=512m tmpfs /upper || die "tmpfs failed"
mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot \\
  || die "overlay mount failed"
mkdir -p "/newroot/usr/lib/modules/$KVER" /newroot{GUEST_SHARED}
mount -t 9p -o "$P9,ro,cache=loose" modules "/newroot/usr/lib/modules/$KVER" \\
  || die "9p modules mount failed"
mount -t 9p -o "$P9" shared /newroot{GUEST_SHARED} || die "9p shared mount failed"
GINIT=
for a in $(cat /proc/cmdline); do
  case "$a" in {INIT_CMDLINE_KEY}=*) GINIT="${{a#{INIT_CMDLINE_KEY}=}}";; esac
done
[ -n "$GINIT" ] || die "no {INIT_CMDLINE_KEY}= on the kernel command line"
for d in proc sys dev; do mount --move "/$d" "/newroot/$d"; done
exec switch_root /newroot "$GINIT"
"""


class SetupError(RuntimeError):
    """Setup cannot be done here; ``str(err)`` is a one-line reason."""


class _AptMiss(SetupError):
    """apt could not find or fetch a package: the package lists may be stale."""


@dataclass(frozen=True)
class Kernel:
    """A prepared kernel in the cache (all paths absolute)."""

    kver: str
    root: Path  # cache/k/<kver>
    image: Path  # vmlinux (PVH entry) or, as a fallback, the bzImage
    pvh: bool
    moddir: Path  # extracted /lib/modules/<kver>, depmod'ed
    headers: Path  # extracted linux-headers-<kver> (make -C here M=...)
    initramfs: Path
    compiler: str  # Debian package of the compiler the kernel was built with, e.g. gcc-12
    note: str = ""  # e.g. why there is no PVH vmlinux

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Kernel:
        paths = {"root", "image", "moddir", "headers", "initramfs"}
        return cls(**{k: Path(str(v)) if k in paths else v for k, v in d.items()})  # type: ignore[arg-type]


def cache_dir() -> Path:
    env = os.environ.get("NODEAGENT_REALKERNEL_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base).absolute() / "nodeagent-realkernel"


def _run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = None if env is None else {**os.environ, **env}
    try:
        return subprocess.run(
            [os.fspath(a) for a in argv],
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as e:
        raise SetupError(f"{argv[0]} not found") from e
    except subprocess.TimeoutExpired as e:
        raise SetupError(f"{argv[0]} timed out after {timeout:.0f}s") from e


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("W:")]
    return lines[-1] if lines else "(no output)"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def log(msg: str) -> None:
    print(f"[realkernel] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- apt


class _Apt:
    def __init__(self) -> None:
        self.updated = False

    def update_once(self) -> bool:
        """apt-get update, at most once per setup; False if it already ran."""
        if self.updated:
            return False
        self.updated = True
        log("apt-get update")
        p = _run(["apt-get", *APT_LOCK, "update"], env=APT_ENV)
        if p.returncode != 0:
            raise SetupError(f"apt-get update failed: {_last_line(p.stderr + p.stdout)}")
        return True

    @staticmethod
    def installed(pkg: str) -> bool:
        p = _run(["dpkg-query", "-W", "-f=${db:Status-Status}", pkg])
        return p.returncode == 0 and p.stdout.strip() == "installed"

    def install(self, pkgs: Sequence[str]) -> None:
        missing = [p for p in pkgs if not self.installed(p)]
        if not missing:
            return
        log(f"apt-get install {' '.join(missing)}")
        argv = ["apt-get", *APT_LOCK, "install", "-y", "--no-install-recommends", *missing]
        p = _run(argv, env=APT_ENV)
        if p.returncode != 0 and self.update_once():
            p = _run(argv, env=APT_ENV)
        if p.returncode != 0:
            raise SetupError(
                f"apt-get install {' '.join(missing)} failed: {_last_line(p.stderr + p.stdout)}"
            )

    def depends(self, pkg: str) -> list[str]:
        p = _run(["apt-cache", "depends", pkg])
        if p.returncode != 0:
            return []
        return re.findall(r"^\s*\|?Depends:\s*(\S+)\s*$", p.stdout, re.M)

    def deb_names(self, pkgs: Sequence[str]) -> dict[str, str]:
        """The exact .deb file names apt would download now (no network)."""
        p = _run(["apt-get", "download", "--print-uris", *pkgs], env=APT_ENV)
        names = {}
        for line in p.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                pkg = parts[1].split("_", 1)[0]
                names[pkg] = parts[1]
        if p.returncode != 0 or set(names) != set(pkgs):
            missing = sorted(set(pkgs) - set(names))
            raise _AptMiss(
                f"apt knows no download for {' '.join(missing) or pkgs}: {_last_line(p.stderr)}"
            )
        return names

    def download(self, pkgs: Sequence[str], dest: Path) -> None:
        """apt-get download into dest (through a temp dir: no partial .debs in the cache)."""
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest, prefix=".dl-") as tmp:
            os.chmod(tmp, 0o755)  # apt's _apt sandbox user writes here
            log(f"apt-get download {' '.join(pkgs)}")
            p = _run(["apt-get", "download", *pkgs], cwd=Path(tmp), env=APT_ENV)
            if p.returncode != 0:
                raise _AptMiss(f"apt-get download failed: {_last_line(p.stderr + p.stdout)}")
            for f in Path(tmp).glob("*.deb"):
                os.replace(f, dest / f.name)


# ---------------------------------------------------------------- kernel image


def _elf_has_pvh_note(data: bytes) -> bool:
    """True if an ELF64 image has the Xen PVH entry note QEMU needs to boot it."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type != 4:  # PT_NOTE
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            name = data[off + 12 : off + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == 18:  # XEN_ELFNOTE_PHYS32_ENTRY
                return True
            off += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


def decompress_bzimage(bz: bytes) -> bytes:
    """Return the uncompressed ELF kernel inside an x86 bzImage (header >= 2.08).

    Raises ValueError when the format or the compression is not handled.
    """
    if bz[0x202:0x206] != b"HdrS":
        raise ValueError("not a bzImage (no HdrS)")
    (version,) = struct.unpack_from("<H", bz, 0x206)
    if version < 0x208:
        raise ValueError(f"boot protocol {version:#x} < 2.08 has no payload fields")
    setup_sects = bz[0x1F1] or 4
    payload_offset, payload_length = struct.unpack_from("<II", bz, 0x248)
    start = (setup_sects + 1) * 512 + payload_offset
    payload = bz[start : start + payload_length]
    if payload.startswith(b"\xfd7zXZ\x00"):
        out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        try:
            import zstandard  # type: ignore[import-not-found,unused-ignore]
        except ImportError as e:
            raise ValueError("zstd payload and no python zstandard module") from e
        out = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
    elif payload.startswith(b"\x1f\x8b"):
        out = zlib.decompressobj(wbits=31).decompress(payload)
    elif payload.startswith(b"\x5d\x00\x00"):
        out = lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(payload)
    else:
        raise ValueError(f"unhandled payload compression (magic {payload[:4].hex()})")
    if not out.startswith(b"\x7fELF"):
        raise ValueError("payload is not an ELF file")
    return out


# ---------------------------------------------------------------- initramfs


def _newc(entries: Sequence[tuple[str, int, bytes]]) -> bytes:
    """A cpio 'newc' archive of (name, mode, data) entries."""
    buf = io.BytesIO()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        nb = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0)
        buf.write(b"070701" + b"".join(b"%08x" % f for f in fields) + nb)
        buf.write(b"\0" * (-(110 + len(nb)) % 4))
        buf.write(data)
        buf.write(b"\0" * (-len(data) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return buf.getvalue()


def _modname(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    return re.sub(r"\.ko(\.(xz|zst|gz))?$", "", base).replace("-", "_")


def module_load_order(moddir: Path, wanted: Sequence[str]) -> list[Path]:
    """Files of `wanted` and their dependencies, dependencies first (built-ins skipped)."""
    deps: dict[str, list[str]] = {}
    files: dict[str, str] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        mod, rest = line.split(":", 1)
        files[_modname(mod)] = mod
        deps[_modname(mod)] = [_modname(d) for d in rest.split()]
    builtin_file = moddir / "modules.builtin"
    builtin = (
        {_modname(ln) for ln in builtin_file.read_text().split()}
        if builtin_file.exists()
        else set()
    )
    order: list[str] = []

    def visit(m: str) -> None:
        if m in order or m in builtin:
            return
        if m not in deps:
            raise SetupError(f"module {m} is neither in modules.dep nor built in")
        for d in deps[m]:
            visit(d)
        order.append(m)

    for m in wanted:
        visit(m.replace("-", "_"))
    return [moddir / files[m] for m in order]


def _read_module(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    if path.name.endswith(".zst"):
        import zstandard  # type: ignore[import-not-found,unused-ignore]

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


def build_initramfs(moddir: Path, out: Path) -> None:
    if not BUSYBOX.is_file():
        raise SetupError(f"{BUSYBOX} missing (busybox-static)")
    mods = module_load_order(moddir, INITRAMFS_MODULES)
    entries: list[tuple[str, int, bytes]] = [
        (d, 0o40755, b"")
        for d in ("bin", "dev", "proc", "sys", "mods", "lower", "upper", "newroot")
    ]
    entries += [
        ("bin/busybox", 0o100755, BUSYBOX.read_bytes()),
        ("init", 0o100755, INITRAMFS_INIT.encode()),
    ]
    names = [_modname(m.name) for m in mods]
    entries += [
        (f"mods/{n}.ko", 0o100644, _read_module(m)) for n, m in zip(names, mods, strict=True)
    ]
    entries.append(("mods/order", 0o100644, ("\n".join(names) + "\n").encode()))
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(_newc(entries), compresslevel=1))
    os.replace(tmp, out)


# ---------------------------------------------------------------- setup


def _resolve_kver(apt: _Apt) -> str:
    pinned = os.environ.get("NODEAGENT_REALKERNEL_KVER")
    if pinned:
        return pinned
    for attempt in range(2):
        for dep in apt.depends("linux-image-amd64"):
            m = re.fullmatch(r"linux-image-(\d\S*?-amd64)(-unsigned)?", dep)
            if m:
                return m.group(1)
        if attempt == 0 and not apt.update_once():
            break
    raise _AptMiss(
        "apt-cache depends linux-image-amd64 names no kernel package "
        "(not a Debian amd64 system, or no package lists)"
    )


def _extract(kver: str, debs: dict[str, Path], compiler: str, dest: Path, final: Path) -> Kernel:
    """Extract the downloaded packages into dest (a fresh directory that becomes `final`)."""
    kroot, hroot = dest / "kernel", dest / "hdr"
    kroot.mkdir(parents=True)
    hroot.mkdir()
    log(f"extracting {kver}")
    for pkg, deb in debs.items():
        target = kroot if pkg.startswith("linux-image-") else hroot
        p = _run(["dpkg", "-x", deb, target])
        if p.returncode != 0:
            raise SetupError(f"dpkg -x {deb.name} failed: {_last_line(p.stderr)}")
    # depmod -b looks under lib/modules (kmod <= 31) or usr/lib/modules (newer builds)
    if (kroot / "usr/lib/modules").is_dir() and not (kroot / "lib").exists():
        (kroot / "lib").symlink_to("usr/lib")
    elif (kroot / "lib/modules").is_dir() and not (kroot / "usr/lib/modules").exists():
        (kroot / "usr/lib").mkdir(parents=True, exist_ok=True)
        (kroot / "usr/lib/modules").symlink_to("../../lib/modules")
    moddir = kroot / "lib/modules" / kver
    p = _run(["depmod", "-b", kroot, kver])
    if p.returncode != 0 or not (moddir / "modules.dep").is_file():
        why = _last_line(p.stderr) if p.returncode else "no modules.dep"
        raise SetupError(f"depmod -b failed: {why}")

    headers = hroot / "usr/src" / f"linux-headers-{kver}"
    mk = headers / "Makefile"
    if not mk.is_file():
        raise SetupError(f"no {mk.relative_to(dest)} in linux-headers-{kver}")
    text = mk.read_text()
    mk.write_text(re.sub(r"(?m)^(\s*include\s+)/usr/src/", rf"\g<1>{final}/hdr/usr/src/", text))

    note = ""
    bz = kroot / "boot" / f"vmlinuz-{kver}"
    image, pvh = bz, False
    try:
        elf = decompress_bzimage(bz.read_bytes())
        if _elf_has_pvh_note(elf):
            image, pvh = dest / "vmlinux", True
            image.write_bytes(elf)
        else:
            note = "vmlinux has no PVH note; booting the bzImage (slower under TCG)"
    except (OSError, ValueError, lzma.LZMAError, zlib.error) as e:
        note = f"no vmlinux ({e}); booting the bzImage (slower under TCG)"
    if note:
        log(note)
    initramfs = dest / "initramfs.cpio.gz"
    build_initramfs(moddir, initramfs)

    def at_final(p: Path) -> Path:
        return final / p.relative_to(dest)

    return Kernel(
        kver=kver,
        root=final,
        image=at_final(image),
        pvh=pvh,
        moddir=at_final(moddir),
        headers=at_final(headers),
        initramfs=at_final(initramfs),
        compiler=compiler,
        note=note,
    )


def _load_ready(kdir: Path) -> Kernel | None:
    try:
        d = json.loads((kdir / "ready.json").read_text())
        if d.pop("recipe", None) != RECIPE:
            return None
        k = Kernel.from_json(d)
    except (OSError, ValueError, TypeError):
        return None
    if all(p.exists() for p in (k.image, k.moddir / "modules.dep", k.headers, k.initramfs)):
        return k
    return None


def _prepare(apt: _Apt, cache: Path) -> Kernel:
    kver = _resolve_kver(apt)
    kdir = cache / "k" / kver
    ready = _load_ready(kdir)
    if ready:
        return ready
    abi = kver.removesuffix("-amd64")
    hdeps = apt.depends(f"linux-headers-{kver}")
    common = next((d for d in hdeps if d == f"linux-headers-{abi}-common"), None)
    kbuild = next((d for d in hdeps if d.startswith("linux-kbuild-")), None)
    compiler_dep = next((d for d in hdeps if d.startswith("linux-compiler-")), "")
    m = re.match(r"linux-compiler-(gcc-\d+)-", compiler_dep)
    compiler = m.group(1) if m else "gcc"
    if not common or not kbuild:
        raise _AptMiss(
            f"cannot resolve the header packages of {kver} "
            f"(apt-cache depends linux-headers-{kver}: {hdeps})"
        )
    pkgs = [f"linux-image-{kver}", f"linux-headers-{kver}", common, kbuild]
    debs = cache / "debs"
    names = apt.deb_names(pkgs)
    missing = [p for p in pkgs if not (debs / names[p]).is_file()]
    if missing:
        apt.download(missing, debs)
    found = {p: debs / names[p] for p in pkgs}
    absent = [f.name for f in found.values() if not f.is_file()]
    if absent:
        raise _AptMiss(f"apt-get download did not produce {' '.join(absent)}")
    tmp = Path(tempfile.mkdtemp(dir=kdir.parent, prefix=f".{kver}-"))
    try:
        k = _extract(kver, found, compiler, tmp, kdir)
        (tmp / "ready.json").write_text(json.dumps({**k.to_json(), "recipe": RECIPE}, indent=1))
        tmp.chmod(0o755)
        if kdir.exists():
            shutil.rmtree(kdir)
        # modules built against an earlier extraction (maybe another point release)
        shutil.rmtree(cache / "modules" / kver, ignore_errors=True)
        os.replace(tmp, kdir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache, kver, set(found.values()))
    return k


def _prune(cache: Path, kver: str, keep_debs: set[Path]) -> None:
    """Drop what belongs to older kernels (~0.6 GB each) and killed extractions."""
    for d in [*(cache / "k").iterdir(), *(cache / "modules").glob("*")]:
        if d.name != kver:
            log(f"pruning {d}")
            shutil.rmtree(d, ignore_errors=True)
    for f in (cache / "debs").glob("*.deb"):
        if f not in keep_debs:
            f.unlink(missing_ok=True)


def ensure() -> Kernel:
    """Prepare (or find cached) everything needed to boot; raise SetupError with a reason."""
    machine = os.uname().machine if hasattr(os, "uname") else "?"
    if sys.platform != "linux" or machine != "x86_64":
        raise SetupError(f"needs an x86_64 Linux host (this is {sys.platform}/{machine})")
    if os.geteuid() != 0:
        raise SetupError("not root: the real-kernel harness needs root (apt-get, QEMU 9p export)")
    for tool in ("apt-get", "apt-cache", "dpkg", "dpkg-query"):
        if shutil.which(tool) is None:
            raise SetupError(f"no {tool}: the real-kernel harness needs a Debian host with apt")
    cache = cache_dir()
    (cache / "k").mkdir(parents=True, exist_ok=True)
    apt = _Apt()
    with _locked(cache / ".setup.lock"):
        apt.install(BASE_PACKAGES)
        ensure_qemu_igb(apt)
        try:
            try:
                return _prepare(apt, cache)
            except _AptMiss:
                # stale package lists: the kernel moved on or the pool dropped a file
                if not apt.update_once():
                    raise
                return _prepare(apt, cache)
        except SetupError as e:
            cached = _newest_ready(cache)
            if cached is None:
                raise
            log(f"{e}; using the cached kernel {cached.kver}")
            return cached


def qemu_version() -> tuple[int, int] | None:
    p = _run(["qemu-system-x86_64", "--version"])
    m = re.search(r"version (\d+)\.(\d+)", p.stdout) if p.returncode == 0 else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _os_codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=(\w+)$", text, re.M)
    return m.group(1) if m else None


def ensure_qemu_igb(apt: _Apt) -> None:
    """QEMU >= 8 from <codename>-backports when the system's is older (idempotent).

    Best effort: without it the real-kernel suite runs as before and the igb
    tests skip, saying why.
    """
    have = qemu_version()
    if have is not None and have >= QEMU_MIN_IGB:
        return
    codename = _os_codename()
    if codename is None:
        log("no VERSION_CODENAME in /etc/os-release: keeping QEMU as it is (igb tests skip)")
        return
    suite = f"{codename}-backports"
    if not BACKPORTS_SOURCES.exists():
        BACKPORTS_SOURCES.write_text(
            "Types: deb\n"
            "URIs: http://deb.debian.org/debian\n"
            f"Suites: {suite}\n"
            "Components: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        )
        apt.updated = False  # the new suite's lists are needed
    apt.update_once()
    log(f"apt-get install -t {suite} qemu-system-x86 (QEMU >= 8 for -device igb)")
    argv = ["apt-get", *APT_LOCK, "install", "-y", "--no-install-recommends", "-t", suite]
    p = _run([*argv, "qemu-system-x86"], env=APT_ENV)
    if p.returncode != 0:
        log(f"QEMU from {suite} not installed ({_last_line(p.stderr + p.stdout)}); igb tests skip")


def _newest_ready(cache: Path) -> Kernel | None:
    ready = [k for d in (cache / "k").iterdir() if (k := _load_ready(d)) is not None]
    return max(ready, key=lambda k: (k.root / "ready.json").stat().st_mtime, default=None)


def ensure_build_tools(kernel: Kernel) -> None:
    """Install make and the kernel's compiler (e.g. gcc-12) when missing."""
    apt = _Apt()
    with _locked(cache_dir() / ".setup.lock"):
        apt.install(["make", kernel.compiler])


def main() -> int:
    t = time.monotonic()
    try:
        k = ensure()
    except SetupError as e:
        print(f"realkernel setup: {e}", file=sys.stderr)
        return 1
    print(json.dumps(k.to_json(), indent=1))
    print(f"realkernel setup: {k.kver} ready in {time.monotonic() - t:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
