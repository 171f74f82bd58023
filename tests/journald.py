"""A real Debian ``systemd-journald`` in a private mount namespace, for the journal tests.

    with private_journald(host_root) as jd:  # jd.root: the namespace seen from outside
        ...  # send to jd.root/<host_root>/run/systemd/journal/socket
        jd.entries(SYSLOG_IDENTIFIER="nodeagent")  # journalctl -o json, read back

The namespace gets its own tmpfs ``/run`` (so journald's sockets and runtime
journal are private; nothing reaches the machine's journal) and a bind of its
``/run/systemd/journal`` into ``<host_root>/run/systemd/journal``, where the
agent looks for the socket. Processes outside reach both through
``/proc/<journald pid>/root``. The ``systemd`` package is installed on first use
as tests/realkernel/setup.py installs its tools (idempotent, as root); anything
missing raises SetupError with a one-line reason, which the tests skip on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.realkernel.setup import SetupError, _Apt
from tests.waiting import WAIT, until

JOURNALD = Path("/lib/systemd/systemd-journald")

NAMESPACE_SCRIPT = """
set -e
mount --make-rprivate /
mount -t tmpfs tmpfs /run
if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi
mkdir -p /run/systemd/journal /run/log/journal "$1/run/systemd/journal"
mount --bind /run/systemd/journal "$1/run/systemd/journal"
exec "$2"
"""


def ensure_tools() -> tuple[Path, str, str]:
    """(journald, journalctl, unshare), installing ``systemd`` if needed."""
    if os.geteuid() != 0:
        raise SetupError("not root: a private journald needs a mount namespace (and apt-get)")
    if not JOURNALD.exists() or shutil.which("journalctl") is None:
        if shutil.which("apt-get") is None:
            raise SetupError("systemd-journald is not installed and there is no apt-get")
        _Apt().install(["systemd"])
    journalctl, unshare = shutil.which("journalctl"), shutil.which("unshare")
    if not JOURNALD.exists() or journalctl is None:
        raise SetupError(f"{JOURNALD} or journalctl missing after installing systemd")
    if unshare is None:
        raise SetupError("unshare (util-linux) is missing")
    return JOURNALD, journalctl, unshare


@dataclass
class PrivateJournald:
    proc: subprocess.Popen[bytes]
    journalctl: str

    @property
    def root(self) -> Path:
        """The namespace's root, as processes outside it see it."""
        return Path(f"/proc/{self.proc.pid}/root")

    def entries(self, **match: str) -> list[dict[str, Any]]:
        argv = [self.journalctl, "-D", str(self.root / "run/log/journal"), "-o", "json", "--all"]
        argv += [f"{k}={v}" for k, v in match.items()]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]

    def wait_for(
        self, what: str, done: Callable[[list[dict[str, Any]]], bool], **match: str
    ) -> list[dict[str, Any]]:
        """The matching entries once ``done`` holds of them (journald writes
        asynchronously: wait for the entries a test needs, not for a count of any)."""
        found: list[dict[str, Any]] = []

        def ready() -> bool:
            found[:] = self.entries(**match)
            return done(found)

        try:
            until(ready, what)
        except AssertionError as exc:
            kinds = [(e.get("NODEAGENT_KIND"), e.get("NODEAGENT_GUARD")) for e in found]
            raise AssertionError(f"{exc}; the journal has {kinds}") from None
        return found


@contextlib.contextmanager
def private_journald(host_root: Path) -> Iterator[PrivateJournald]:
    journald, journalctl, unshare = ensure_tools()
    argv = [unshare, "--mount", "sh", "-c", NAMESPACE_SCRIPT, "sh", str(host_root), str(journald)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    jd = PrivateJournald(proc, journalctl)
    try:
        socket_path = jd.root / str(host_root).lstrip("/") / "run/systemd/journal/socket"
        deadline = time.monotonic() + WAIT
        while not socket_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
                raise SetupError(f"private journald did not start: {err.strip()[-300:]}")
            time.sleep(0.05)
        yield jd
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
