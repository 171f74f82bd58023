"""Boot the prepared Debian kernel under QEMU and run one command in it.

    python -m tests.realkernel.vm uname -r          # from the repository root
    rc, out = run_in_guest(["modprobe", "ib_core"], timeout=60)
    rc, out = run_in_guest("modprobe ib_core && cat /proc/modules", timeout=60)

The guest's root is the host's ``/`` (9p, read-only) under a tmpfs overlay, so
it sees the same Python, venv and checkout; the kernel's own modules are at
``/usr/lib/modules/$(uname -r)``; a read-write directory shared with the host
is at ``/mnt/shared``.  The command runs as root, as a child of PID 1; when it
ends the guest writes its output and exit code to the shared dir and powers
off.  QEMU never outlives the call: a timeout (or any exception) kills it, and
it gets SIGKILL if this process dies.

KVM is used only where the CPU has vmx/svm and /dev/kvm is not the
paravirtual PVM flavour (which boots only PVM guests); otherwise TCG.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.realkernel import setup as rksetup
from tests.realkernel.setup import GUEST_SHARED, INIT_CMDLINE_KEY, Kernel

QBOOT = Path("/usr/share/qemu/qboot.rom")  # minimal firmware: faster than SeaBIOS
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# PID 1 after switch_root (host bash via the 9p root).  It reads the command
# as NUL-separated argv/env files: nothing is ever parsed by a shell.
GUEST_INIT = f"""#!/bin/bash
export PATH={GUEST_PATH} HOME=/root TERM=dumb LANG=C.UTF-8
S={GUEST_SHARED}
mount -t tmpfs tmpfs /run
# No tmpfs over /tmp: the overlay root is writable already, and a checkout
# (or a CI clone) under the host's /tmp must stay visible.
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
modprobe configfs 2>/dev/null
mount -t configfs configfs /sys/kernel/config 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
ip link set lo up 2>/dev/null
hostname realkernel-guest
echo "GUEST-START uptime=$(cut -d' ' -f1 /proc/uptime) kernel=$(uname -r)"
mapfile -d '' -t ARGV < "$S/argv"
mapfile -d '' -t ENVV < "$S/env"
for kv in "${{ENVV[@]}}"; do export "$kv"; done
rc=0
if [ -f "$S/cwd" ]; then cd -- "$(cat "$S/cwd")" || rc=97; fi
if [ $rc = 0 ]; then "${{ARGV[@]}}" > "$S/out.log" 2>&1 < /dev/null; rc=$?; fi
echo "$rc" > "$S/rc"
echo "GUEST-DONE rc=$rc uptime=$(cut -d' ' -f1 /proc/uptime)"
sync
echo o > /proc/sysrq-trigger
# builtins only from here: the 9p root goes away during power-off
while :; do :; done
"""


class GuestError(RuntimeError):
    """The guest did not finish (timeout, panic, QEMU error); the message has the logs."""


@dataclass(frozen=True)
class GuestResult:
    rc: int
    output: str
    seconds: float
    accel: str
    console: str


def kvm_usable() -> bool:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    if os.path.exists("/sys/module/kvm_pvm"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        return False
    return re.search(r"^flags\s*:.*\b(vmx|svm)\b", cpuinfo, re.M) is not None


def choose_accel() -> str:
    forced = os.environ.get("NODEAGENT_REALKERNEL_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    return "kvm" if kvm_usable() else "tcg"


def _qarg(path: Path | str) -> str:
    """Escape a value for QEMU's comma-separated option syntax."""
    return str(path).replace(",", ",,")


@functools.cache
def has_igb() -> bool:
    """QEMU >= 8 emulates an 82576 SR-IOV PF (``-device igb``); setup installs one."""
    try:
        p = subprocess.run(
            ["qemu-system-x86_64", "-device", "help"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return '"igb"' in p.stdout


# A q35 machine with one igb PF behind a PCIe root port, always present when QEMU has
# it, so the SR-IOV tests share the session's one boot. Its netdev is QEMU's user
# network with restrict=on: the link is up (igb needs that for VF rate limits) and
# nothing leaves the guest.
IGB_ARGS = (
    "-machine",
    "q35",
    "-device",
    "pcie-root-port,id=rp0,chassis=1",
    "-netdev",
    "user,id=igbnet,restrict=on",
    "-device",
    "igb,netdev=igbnet,bus=rp0",
)


def qemu_argv(
    kernel: Kernel,
    shared: Path,
    *,
    accel: str,
    smp: int = 2,
    mem: str = "1G",
    extra: Sequence[str] = (),
) -> list[str]:
    if accel == "kvm":
        acc = ["-accel", "kvm", "-cpu", "host"]
    else:
        acc = ["-accel", "tcg,thread=multi", "-cpu", "max"]

    def fs(tag: str, path: Path, ro: bool) -> list[str]:
        opts = f"local,id={tag},path={_qarg(path)},security_model=none"
        opts += ",readonly=on" if ro else ""
        opts += ",multidevs=remap" if str(path) == "/" else ""
        return ["-fsdev", opts, "-device", f"virtio-9p-pci,fsdev={tag},mount_tag={tag}"]

    bios = ["-bios", str(QBOOT)] if QBOOT.is_file() else []
    append = (
        f"console=ttyS0 panic=-1 quiet loglevel=4 mitigations=off "
        f"{INIT_CMDLINE_KEY}={GUEST_SHARED}/init"
    )
    return [
        "qemu-system-x86_64",
        *acc,
        "-m",
        mem,
        "-smp",
        str(smp),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        *bios,
        "-kernel",
        str(kernel.image),
        "-initrd",
        str(kernel.initramfs),
        "-append",
        append,
        *fs("hostroot", Path("/"), True),
        *fs("modules", kernel.moddir, True),
        *fs("shared", shared, False),
        *(IGB_ARGS if has_igb() else ()),
        *extra,
    ]


def new_run_dir(prefix: str) -> Path:
    """A fresh shared dir under <cache>/runs; dirs left by killed runs (> 6 h) are pruned."""
    runs = rksetup.cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.iterdir():
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 6 * 3600:
                shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=runs, prefix=prefix))


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def boot(
    cmd: Sequence[str] | str,
    *,
    timeout: float,
    kernel: Kernel | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    shared: Path | None = None,
    accel: str | None = None,
    smp: int = 2,
    mem: str = "1G",
    extra_qemu_args: Sequence[str] = (),
) -> GuestResult:
    """Boot, run `cmd` (an argv list, or a bash script as one string), power off.

    `shared` is a host directory that the guest sees read-write at /mnt/shared;
    by default a temporary one is made (and removed) under the cache dir.
    Raises GuestError when the guest does not report an exit code in time, and
    rksetup.SetupError when the kernel cannot be prepared.
    """
    kernel = kernel or rksetup.ensure()
    accel = accel or choose_accel()
    own_shared = shared is None
    if shared is None:
        shared = new_run_dir("run-")
    try:
        if isinstance(cmd, str):
            (shared / "cmd.sh").write_text("#!/bin/bash\n" + cmd + "\n")
            argv: list[str] = ["/bin/bash", f"{GUEST_SHARED}/cmd.sh"]
        else:
            argv = [os.fspath(a) for a in cmd]
        if not argv or any("\0" in a for a in argv):
            raise ValueError("empty argv or NUL in an argument")
        envv = [f"{k}={v}" for k, v in (env or {}).items()]
        if any(
            "\0" in kv or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kv.split("=", 1)[0])
            for kv in envv
        ):
            raise ValueError("bad environment variable name or NUL in a value")
        (shared / "argv").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (shared / "env").write_bytes(b"".join(kv.encode() + b"\0" for kv in envv))
        if cwd is not None:
            (shared / "cwd").write_text(os.fspath(cwd))
        init = shared / "init"
        init.write_text(GUEST_INIT)
        init.chmod(0o755)
        for stale in ("rc", "out.log"):
            (shared / stale).unlink(missing_ok=True)
        if shutil.which("qemu-system-x86_64") is None:
            raise rksetup.SetupError("qemu-system-x86_64 not installed")
        argv_q = qemu_argv(kernel, shared, accel=accel, smp=smp, mem=mem, extra=extra_qemu_args)
        console_path = shared / "console.log"
        t0 = time.monotonic()
        with open(console_path, "wb") as console:
            proc = subprocess.Popen(
                argv_q,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            try:
                proc.wait(timeout=timeout)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                seconds = time.monotonic() - t0
        console_text = console_path.read_text(errors="replace")
        out_path = shared / "out.log"
        output = out_path.read_text(errors="replace") if out_path.exists() else ""
        try:
            rc = int((shared / "rc").read_text())
        except (OSError, ValueError):
            raise GuestError(
                f"guest did not finish (qemu rc={proc.returncode}, {seconds:.1f}s, {accel})\n"
                f"--- console (tail) ---\n{_tail(console_text)}\n"
                f"--- command output (tail) ---\n{_tail(output)}"
            ) from None
        return GuestResult(rc=rc, output=output, seconds=seconds, accel=accel, console=console_text)
    except subprocess.TimeoutExpired:
        out_path = shared / "out.log"
        partial = out_path.read_text(errors="replace") if out_path.exists() else ""
        console_path = shared / "console.log"
        console_text = console_path.read_text(errors="replace") if console_path.exists() else ""
        raise GuestError(
            f"guest timed out after {timeout:.0f}s ({accel}); QEMU killed\n"
            f"--- console (tail) ---\n{_tail(console_text)}\n"
            f"--- command output so far (tail) ---\n{_tail(partial)}"
        ) from None
    finally:
        if own_shared:
            shutil.rmtree(shared, ignore_errors=True)


def run_in_guest(
    argv_or_script: Sequence[str] | str, timeout: float = 120, **kw: object
) -> tuple[int, str]:
    """Boot once, run the command, return (exit code, combined stdout+stderr)."""
    r = boot(argv_or_script, timeout=timeout, **kw)  # type: ignore[arg-type]
    return r.rc, r.output


def main(args: Sequence[str]) -> int:
    t = time.monotonic()
    try:
        k = rksetup.ensure()
        r = boot(list(args) or ["uname", "-r"], timeout=300, kernel=k, cwd=os.getcwd())
    except (rksetup.SetupError, GuestError) as e:
        print(f"realkernel: {e}", file=sys.stderr)
        return 125
    sys.stdout.write(r.output)
    print(
        f"[realkernel] rc={r.rc} boot+run={r.seconds:.1f}s total={time.monotonic() - t:.1f}s "
        f"accel={r.accel} kernel={k.kver}",
        file=sys.stderr,
    )
    return r.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
