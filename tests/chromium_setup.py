"""Debian's Chromium for the HTML timeline test (idempotent).

    python -m tests.chromium_setup        # from the repository root

Finds ``chromium`` on PATH, else (as root, with apt) installs the ``chromium``
package. Anything that cannot be done raises :class:`SetupError` with a
one-line reason, which the test uses as its skip reason. Standard library
only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

PACKAGE = "chromium"
APT = ("apt-get", "-o", "DPkg::Lock::Timeout=300")
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}

# Headless, and nothing that reaches out to the network on its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class SetupError(RuntimeError):
    """Chromium cannot be had here; ``str(err)`` is a one-line reason."""


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [*APT, *args],
            env=APT_ENV,
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise SetupError(f"apt-get {args[0]} timed out") from e


def apt_install(*packages: str) -> None:
    """Debian's packages, as root; SetupError with a one-line reason when that cannot be."""
    if os.geteuid() != 0:
        raise SetupError(f"{' '.join(packages)}: not installed, and installing needs root")
    if shutil.which("apt-get") is None:
        raise SetupError(f"{' '.join(packages)}: not installed, and there is no apt-get")
    install = ("install", "-y", "--no-install-recommends", *packages)
    done = _apt(*install)
    if done.returncode != 0:  # stale package lists: refresh once, then try again
        _apt("update")
        done = _apt(*install)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SetupError(f"apt-get install {' '.join(packages)} failed: {last[0]}")


def ensure() -> str:
    """The path of a Chromium binary, installing Debian's package when needed."""
    found = shutil.which(PACKAGE)
    if found:
        return found
    apt_install(PACKAGE)
    found = shutil.which(PACKAGE)
    if not found:
        raise SetupError(f"apt-get installed {PACKAGE}, yet it is not on PATH")
    return found


if __name__ == "__main__":
    try:
        print(ensure())
    except SetupError as err:
        print(f"chromium setup: {err}", file=sys.stderr)
        sys.exit(1)
