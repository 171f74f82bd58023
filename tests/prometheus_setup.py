"""Debian's Prometheus server for the scrape test (idempotent).

    python -m tests.prometheus_setup        # from the repository root

Finds ``prometheus`` on PATH, else (as root, with apt) installs Debian's
``prometheus`` package without letting it start its service: the package's
postinst starts one (``/etc/init.d/prometheus``, or ``prometheus.service``
under systemd) listening on 0.0.0.0:9090 unless a ``policy-rc.d`` forbids it.
So while apt runs, a ``/usr/sbin/policy-rc.d`` that denies every start is put
in place when there is none (and removed afterwards); whatever still got
started is stopped, and under systemd the unit the package enabled is disabled.
A Prometheus already on PATH is used as it is, its service left alone. (On
the project's machines, containers with no init and Docker's deny-all
policy-rc.d, nothing starts either way; invoke-rc.d finds no runlevel.)
Anything that cannot be done raises :class:`SetupError` with a one-line reason,
which the test uses as its skip reason. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.chromium_setup import SetupError, apt_install

PACKAGE = "prometheus"
UNIT = "prometheus.service"
INIT_SCRIPT = Path("/etc/init.d/prometheus")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
# invoke-rc.d and deb-systemd-invoke ask this; 101 is "action forbidden".
DENY_STARTS = "#!/bin/sh\n# tests.prometheus_setup: no service starts during apt-get\nexit 101\n"

__all__ = ["SetupError", "ensure"]


def _servers(binary: str) -> list[int]:
    """Processes running this binary (only root can see every process's exe)."""
    target = os.path.realpath(binary)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe")
        except OSError:  # gone, a kernel thread, or not ours to see
            continue
        if exe.removesuffix(" (deleted)") == target:
            pids.append(int(entry.name))
    return pids


def _quiet(*argv: str) -> None:
    """Run it; its outcome is judged by what is still running afterwards."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)


def _stop_service(binary: str) -> None:
    """Stop (and under systemd disable) the service the package may have started."""
    if Path("/run/systemd/system").is_dir():
        _quiet("systemctl", "disable", "--now", UNIT)
    elif INIT_SCRIPT.exists() and _servers(binary):
        _quiet(str(INIT_SCRIPT), "stop")
    running = _servers(binary)
    if running:
        raise SetupError(f"{PACKAGE} installed, but its service still runs (pid {running[0]})")


def _install() -> str:
    """The package, its service neither started nor left running; the binary's path."""
    placed = False
    if os.geteuid() == 0 and not os.path.lexists(POLICY_RC_D):
        try:
            POLICY_RC_D.write_text(DENY_STARTS)
            POLICY_RC_D.chmod(0o755)
            placed = True
        except OSError as e:
            raise SetupError(f"cannot write {POLICY_RC_D}: {e.strerror}") from e
    try:
        apt_install(PACKAGE)
    finally:
        if placed:
            POLICY_RC_D.unlink(missing_ok=True)
    binary = shutil.which(PACKAGE)
    if binary is None:
        raise SetupError(f"apt-get installed {PACKAGE}, yet it is not on PATH")
    _stop_service(binary)
    return binary


def ensure() -> str:
    """The path of the ``prometheus`` binary, installing Debian's package when needed."""
    return shutil.which(PACKAGE) or _install()


if __name__ == "__main__":
    try:
        print(ensure())
    except SetupError as err:
        sys.exit(f"prometheus setup: {err}")  # on stderr, exit status 1
