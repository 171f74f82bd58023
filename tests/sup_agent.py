"""A stand-in agent for ``tests/test_supervise.py``: ``python -m tests.sup_agent DIR [--exit-on-term
CODE | --exit-now CODE]``. It writes ``DIR/agent.<pid>`` at start, starts a child in a
session of its own (as the hold's responder is) and writes its pid to
``DIR/agent.<pid>.child``, notes each SIGTERM/SIGINT in ``DIR/agent.<pid>.signals`` and,
with ``--exit-on-term``, exits with CODE at the first one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    where = Path(argv[1])
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    me = where / f"agent.{os.getpid()}"
    if "--exit-now" in opts:
        me.write_text("")
        return int(opts["--exit-now"])
    code = int(opts.get("--exit-on-term", "0"))

    def on_signal(signum: int, frame: object) -> None:
        with open(f"{me}.signals", "a") as f:
            f.write(signal.Signals(signum).name + "\n")
        sys.exit(code)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL)
    Path(f"{me}.child.tmp").write_text(str(child.pid))
    os.rename(f"{me}.child.tmp", f"{me}.child")
    me.write_text("")
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
