"""MOFED's driver container on the guest: its entrypoint run in a mount namespace of its
own, stepped by the test, its ready flag and blacklist (``replay_upgrade.py``,
``replay_vf.py``)."""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests import waiting

WAIT = 120.0  # a hang detector under TCG, where a modprobe takes seconds
MOFED_ROOT = Path("/run/mellanox/drivers")
READY = MOFED_ROOT / ".driver-ready"
BLACKLIST = Path("/etc/modprobe.d/blacklist-ofed-modules.conf")
RESTARTS = 2  # the kubelet's restarts of a failed driver container the replay waits for


# The MOFED container's entrypoint around openibd restart. Its steps wait for the test's
# word where the seeds spend minutes (the build; the insert, timed against the GPU load).
# Every MOFED entrypoint's start: its flock on .lock, held to its exit (as the shipped
# entrypoint's), the blacklist removed at exit (its EXIT trap), the ready flag removed.
MOFED_PROLOGUE = f"""#!/bin/sh
D={MOFED_ROOT}
say() {{ echo "[mofed] $*"; }}
exec 9>"$D/.lock"
flock 9
trap 'rm -f {BLACKLIST}' EXIT
say "Unsetting driver ready state"
rm -f "$D/.driver-ready"
"""


@dataclass
class Mofed:
    """The MOFED container: its entrypoint in a mount namespace of its own."""

    proc: subprocess.Popen[bytes]
    log: Path

    def step(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def said(self, words: str) -> bool:
        return words in self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_mofed(entrypoint: str, top: Path, starts: list[Mofed]) -> Mofed:
    """A MOFED container start: ``entrypoint`` (a shell script) in a mount namespace of its
    own, its log ``top/mofed-<n>.log``; appended to ``starts``, returned once it began."""
    script = top / "mofed-entrypoint"
    script.write_text(entrypoint)
    log = top / f"mofed-{len(starts)}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", str(script)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    mofed = Mofed(proc, log)
    starts.append(mofed)
    waiting.until(lambda: mofed.said("Unsetting"), "MOFED started", WAIT)
    return mofed
